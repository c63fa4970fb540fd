"""Fixtures of the real-browser test: a JupyterLab of this project's .venv, and Chromium driven by Playwright.

This folder is collected only when it is named on the command line (`make browser` runs
`pytest tests/browser` on NB_WORKERS pytest-xdist workers, 2 by default, each with its own
JupyterLab and Chromium): `pytest tests` -- and so `make unit` and `make notebooks` -- leave it
alone, because it needs Chromium and takes two to three minutes.

Settings (environment variables):

- ``GACCUM_BROWSER_NOTEBOOKS``: notebooks to test instead of every ``notebooks/*.ipynb``,
  separated by ``:`` (files, or folders whose ``*.ipynb`` are all taken). For trying the test
  on a scratch notebook; CI never sets it. JupyterLab still serves every lesson next to them.
- ``GACCUM_CHROMIUM``: the Chrome/Chromium executable (default: the first that ``chromium.py``
  finds on the PATH, in the usual Linux places or in a macOS application bundle; ``make browser``
  installs Debian's Chromium first where it can). Where none is found every test FAILS, saying
  how to get one.
  The browser is never skipped and never downloaded (no ``playwright install``).
- The browser itself comes from pytest-playwright (``page``), launched with the two fixtures
  below that name the executable and its flags.
- ``GACCUM_COLAB_LESSONS``: notebooks (names without ``.ipynb``, separated by spaces) whose kernels
  Accelerate is to take for Colab's (every kernel JupyterLab starts runs
  ``tests/colab/kernel_startup.py``, which changes only those). ``make browser`` names the
  launching lessons, so Run All (and lesson 04's launch button) take a Colab learner's path; the
  other lessons get a plain kernel. Unset: no start-up script, every kernel plain.
- ``GACCUM_SCREENSHOTS``: where the screenshots go (default ``build/screenshots``).
- ``GACCUM_BROWSER_EXECUTED``: where each notebook is saved as Run All left it (default
  ``build/browser/executed``; ``make browser`` sets it from its BROWSER_EXECUTED and then checks
  the Colab lessons' outputs there).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import chromium  # this folder's finder (pytest puts the folder on sys.path)
import pytest
from accelerate.utils.other import get_free_port
from jupyter_pages import Server, stop

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
SCREENSHOTS = Path(os.environ.get("GACCUM_SCREENSHOTS", ROOT / "build" / "screenshots"))
EXECUTED = Path(os.environ.get("GACCUM_BROWSER_EXECUTED", ROOT / "build" / "browser" / "executed"))
COLAB_STARTUP = ROOT / "tests" / "colab" / "kernel_startup.py"

# Flags for a headless Chromium that talks to nothing but the local JupyterLab.
CHROMIUM_FLAGS = [
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--no-default-browser-check",
    "--disable-dev-shm-usage",
]

# JupyterLab user settings for the test: every cell attached to the page (so the test sees all
# outputs), and no news or update checks (they would reach the internet and pop up a toast).
LAB_SETTINGS = {
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false",
                                                                        "checkForUpdates": False},
}


def pytest_ignore_collect(collection_path, config):
    """Collect this folder only when the command line names it (or a file in it)."""
    if collection_path.parent != HERE or collection_path.suffix != ".py":
        return None
    for arg in config.args:
        target = Path(str(arg).split("::")[0]).resolve()
        if target == HERE or HERE in target.parents:
            return None
    return True


def notebooks_under_test() -> list[Path]:
    spec = os.environ.get("GACCUM_BROWSER_NOTEBOOKS", "").strip()
    entries = [Path(p) for p in spec.split(":") if p.strip()] if spec else [ROOT / "notebooks"]
    found = []
    for entry in entries:
        if entry.is_dir():
            found += sorted(entry.glob("*.ipynb"))
        elif entry.suffix == ".ipynb" and entry.exists():
            found.append(entry)
        else:
            raise pytest.UsageError(f"GACCUM_BROWSER_NOTEBOOKS names {entry}: not a notebook or folder")
    if not found:
        raise pytest.UsageError(f"no notebook found in {entries}")
    return found


def colab_lessons() -> set[str]:
    return set(os.environ.get("GACCUM_COLAB_LESSONS", "").split())


def find_chromium() -> str:
    found = chromium.find()  # `make browser` installs Debian's Chromium first where it may
    if found is None:
        pytest.fail(f"Chrome/Chromium not found, so the notebooks cannot be tested in a real browser. {chromium.HOW}",
                    pytrace=False)
    return found


@pytest.fixture(scope="session")
def lab(tmp_path_factory):
    """JupyterLab from .venv on 127.0.0.1 with a token, serving copies of the notebooks under test."""
    base = tmp_path_factory.mktemp("lab")
    root = base / "notebooks"
    root.mkdir()
    # Copies (the committed notebooks are never touched), and all of them: a lesson may check its
    # siblings (00 compares the lesson map with the folder), as under `make notebooks`.
    for notebook in [*sorted((ROOT / "notebooks").glob("*.ipynb")), *notebooks_under_test()]:
        shutil.copy(notebook, root / notebook.name)
    settings = base / "settings"
    for name, values in LAB_SETTINGS.items():
        (settings / name).parent.mkdir(parents=True, exist_ok=True)
        (settings / name).write_text(json.dumps(values))
    dirs = {"JUPYTER_CONFIG_DIR": "config", "JUPYTER_RUNTIME_DIR": "runtime", "JUPYTER_DATA_DIR": "data",
            "JUPYTERLAB_WORKSPACES_DIR": "workspaces", "IPYTHONDIR": "ipython"}
    env = dict(os.environ, JUPYTERLAB_SETTINGS_DIR=str(settings), JUPYTER_PLATFORM_DIRS="1",
               **{key: str(base / name) for key, name in dirs.items()})
    if colab_lessons():  # the script reads GACCUM_COLAB_LESSONS, which JupyterLab's kernels inherit
        startup = base / "ipython" / "profile_default" / "startup"
        startup.mkdir(parents=True)
        shutil.copy(COLAB_STARTUP, startup / COLAB_STARTUP.name)
    token = secrets.token_hex(24)
    port = get_free_port()
    # Token auth on 127.0.0.1 only; no news, update check or extension manager: nothing goes online.
    command = [str(Path(sys.executable).parent / "jupyter"), "lab", "--no-browser",
               "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}", "--ServerApp.port_retries=0",
               f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}",
               "--LabApp.news_url=", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
               "--LabApp.extension_manager=readonly"]
    if os.geteuid() == 0:
        command.append("--allow-root")
    log = base / "jupyterlab.log"
    with log.open("w") as sink:
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, env=env, cwd=root,
                                   start_new_session=True)
    server = Server(f"http://127.0.0.1:{port}", token, root, process, log)
    _LAB_LOG.append(log)
    try:
        deadline = time.monotonic() + 60
        while True:
            if process.poll() is not None:
                pytest.fail(f"JupyterLab exited with {process.returncode}:\n{server.log_tail()}", pytrace=False)
            with contextlib.suppress(OSError, urllib.error.URLError):
                server.api("GET", "/api/status")
                break
            if time.monotonic() > deadline:
                pytest.fail(f"JupyterLab did not answer within 60 s:\n{server.log_tail()}", pytrace=False)
            time.sleep(0.25)
        yield server
    finally:
        stop(process)


# pytest-playwright launches the browser and gives each test a fresh context and page; these two
# fixtures point it at Debian's (or the user's) Chromium, never at a downloaded one.
@pytest.fixture(scope="session")
def browser_type_launch_args(browser_type_launch_args):
    as_root = os.geteuid() == 0  # Chromium's sandbox cannot run as root
    return {**browser_type_launch_args, "executable_path": find_chromium(), "headless": True,
            "args": [*CHROMIUM_FLAGS, *(["--no-sandbox"] if as_root else [])], "chromium_sandbox": not as_root}


@pytest.fixture(scope="session")
def browser_context_args(browser_context_args):
    return {**browser_context_args, "viewport": {"width": 1280, "height": 900}}


def pytest_generate_tests(metafunc):
    if "notebook" in metafunc.fixturenames:
        # The longest lessons queued first (the lesson map's run times): xdist hands them out two, then
        # one at a time to whichever worker is free, and the short ones fill the end.
        from gaccum_course.lessons import longest_first

        notebooks = longest_first(notebooks_under_test())
        metafunc.parametrize("notebook", notebooks, ids=[p.name for p in notebooks])


@pytest.fixture(scope="session")
def screenshots() -> Path:
    return SCREENSHOTS


@pytest.fixture(scope="session")
def colab_kernels() -> set[str]:
    """The notebooks (names without .ipynb) whose kernels are Colab-like."""
    return colab_lessons()


@pytest.fixture(scope="session")
def executed() -> Path:
    EXECUTED.mkdir(parents=True, exist_ok=True)
    return EXECUTED


_RESULTS: list[dict] = []
_LAB_LOG: list[Path] = []


@pytest.fixture(scope="session")
def results():
    """Timings and screenshot paths, printed at the end of the run."""
    return _RESULTS


def _records(terminalreporter) -> list[dict]:
    """Every test's timings, from the tests' reports (a pytest-xdist worker's come back that way)."""
    records = [value for reports in terminalreporter.stats.values() for report in reports
               if getattr(report, "when", None) == "call"
               for key, value in getattr(report, "user_properties", ()) if key == "browser"]
    return sorted(records, key=lambda r: r["notebook"]) if records else list(_RESULTS)


def pytest_terminal_summary(terminalreporter):
    records = _records(terminalreporter)
    if not records:
        return
    write = terminalreporter.write_line
    if terminalreporter.stats.get("failed") or terminalreporter.stats.get("error"):
        # Each JupyterLab (one per worker) logs to its own file; the records name them.
        for log in sorted({Path(r["lab_log"]) for r in records if r.get("lab_log")} | set(_LAB_LOG)):
            terminalreporter.section(f"JupyterLab log (last 30 lines): {log}")
            write("\n".join(log.read_text(errors="replace").splitlines()[-30:]))
    terminalreporter.section("notebooks in a real browser")
    nan = float("nan")
    for r in records:
        kernel = "colab" if r.get("colab") else "plain"
        write(f"{r['notebook']:<36} {kernel}  open {r.get('open_s', nan):4.1f} s  "
              f"run all {r.get('run_s', nan):4.1f} s  whole test {r.get('total_s', nan):4.1f} s  "
              f"sliders moved {r.get('sliders', 0)}  buttons clicked {r.get('buttons', 0)}")
    write(f"screenshots ({len(records)}), one per notebook:")
    for r in records:
        write(f"  {r.get('screenshot', '(none)')}")

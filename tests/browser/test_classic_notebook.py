"""The explorers on classic Notebook 6.5 with ipywidgets 7.7.1: the closest frontend to Colab's this machine runs.

Colab's frontend is the classic notebook's widget manager of ipywidgets 7 (its custom manager for 8 is
off by default). This test starts classic Notebook from a venv of Colab's set (GACCUM_CLASSIC_PYTHON,
e.g. build/platforms/colab/bin/python, which `make floors` builds) and drives it with the system's
Chromium, headless, through Playwright:

- the suite comes from a fresh wheel of this tree, unpacked into a folder of its own that the server's
  kernels find first (PYTHONPATH): the venv itself, and its torch, accelerate, transformers and
  ipywidgets, are left as they are; the widgets nbextension is enabled in the venv if it is not;
- lessons 01 and 03 are copied to a temporary folder. 03 shows ``variable_length_explorer()``;
  01 only names ``regression_explorer()`` for self-study, so its copy gets that one cell at the end,
  as a learner would type it;
- each lesson: Cell > Run All, wait until no cell runs and the kernel is idle; no error output (the
  notebook's JSON in the page, cells tagged raises-exception excepted), no widget error text; each
  explorer renders (an <img> holding a PNG in the widget area, and a jQuery UI slider:
  ``.widget-slider .ui-slider-handle``); its first slider moves one step (focus, ArrowRight) and the
  image's bytes change; no console error or page error;
- a screenshot of each lesson goes to build/screenshots/classic/ (GACCUM_SCREENSHOTS/classic).

Marked ``classic``; skipped unless GACCUM_CLASSIC_PYTHON is set (so `make browser` skips it and
`make unit` never collects tests/browser). `make floors` runs it after scripts/run_platforms.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from accelerate.utils.other import get_free_port
from jupyter_pages import ANSI, Server, error_outputs, stop, wait_until

ROOT = Path(__file__).resolve().parents[2]
SCREENSHOTS = Path(os.environ.get("GACCUM_SCREENSHOTS", ROOT / "build" / "screenshots"))
CLASSIC_PYTHON = os.environ.get("GACCUM_CLASSIC_PYTHON", "")
pytestmark = [pytest.mark.classic,
              pytest.mark.skipif(not CLASSIC_PYTHON, reason="GACCUM_CLASSIC_PYTHON is not set (`make floors` sets it)")]

LESSONS = ["01_why_accumulate", "03_variable_length_trap"]
# A learner's own cell at the end of lesson 01, which names this explorer for self-study but shows none.
EXTRA_CELLS = {"01_why_accumulate": "from gaccum_course.widgets import regression_explorer\n\nregression_explorer()"}
OPEN_TIMEOUT_S = 90
RUN_TIMEOUT_S = 600
SLIDER_TIMEOUT_S = 30
BAD_TEXT = re.compile(r"Error displaying widget|model not found|Failed to load model class|"
                      r"Loading widget|Could not render|Error rendering", re.IGNORECASE)
# A widget view's output area, in classic Notebook with ipywidgets 7.
WIDGET_AREA = "#notebook-container .output_subarea.jupyter-widgets-view"
EXPLORER = f"{WIDGET_AREA}:has(img.widget-image):has(.widget-slider)"

# The bytes behind an <img> (a blob: URL for ipywidgets' Image): their SHA-256 and whether they are a PNG.
IMAGE_BYTES_JS = """async img => {
  if (!img.src) return {digest: '', png: false, src: ''};
  const data = new Uint8Array(await (await fetch(img.src)).arrayBuffer());
  const png = data.length > 8 && [137, 80, 78, 71, 13, 10, 26, 10].every((b, i) => data[i] === b);
  const digest = Array.from(new Uint8Array(await crypto.subtle.digest('SHA-256', data)))
    .map(b => b.toString(16).padStart(2, '0')).join('');
  return {digest, png, src: img.src};
}"""


def _classic_python() -> Path:
    python = Path(CLASSIC_PYTHON)  # not resolved: a venv's python is a link to the base interpreter
    return python if python.is_absolute() else ROOT / python


def _run(command: list, **kwargs) -> str:
    done = subprocess.run([str(c) for c in command], capture_output=True, text=True, **kwargs)
    if done.returncode:
        pytest.fail(f"{' '.join(map(str, command))} exited with {done.returncode}:\n{done.stdout}\n{done.stderr}",
                    pytrace=False)
    return done.stdout


def _lesson_copy(name: str, folder: Path) -> None:
    nb = json.loads((ROOT / "notebooks" / f"{name}.ipynb").read_text())
    if name in EXTRA_CELLS:
        nb["cells"].append({"cell_type": "code", "execution_count": None, "metadata": {}, "outputs": [],
                            "source": EXTRA_CELLS[name].splitlines(keepends=True)})
    (folder / f"{name}.ipynb").write_text(json.dumps(nb, indent=1))


@pytest.fixture(scope="module")
def classic(tmp_path_factory):
    """Classic Notebook from GACCUM_CLASSIC_PYTHON's venv on 127.0.0.1 with a token, serving lesson copies."""
    python = _classic_python()
    jupyter = python.parent / "jupyter"
    if not jupyter.exists():
        pytest.fail(f"GACCUM_CLASSIC_PYTHON={CLASSIC_PYTHON}: no {jupyter} (`make floors` builds it)",
                    pytrace=False)
    versions = json.loads(_run([python, "-c", "import importlib.metadata as m, json; print(json.dumps("
                                "{p: m.version(p) for p in ('notebook', 'ipywidgets', 'widgetsnbextension')}))"]))
    if not versions["notebook"].startswith("6."):
        pytest.fail(f"{python} has notebook {versions['notebook']}, not the classic 6.x", pytrace=False)
    base = tmp_path_factory.mktemp("classic")
    # The suite as this tree builds it, beside the venv (whose own packages stay as they are).
    wheels, site = base / "wheel", base / "site"
    _run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", wheels, ROOT])
    _run([python, "-m", "pip", "install", "--quiet", "--no-deps", "--target", site, *wheels.glob("*.whl")])
    listed = subprocess.run([jupyter, "nbextension", "list"], capture_output=True, text=True)
    if not re.search(r"jupyter-js-widgets/extension\s+enabled", ANSI.sub("", listed.stdout + listed.stderr)):
        _run([jupyter, "nbextension", "enable", "--py", "widgetsnbextension", "--sys-prefix"])
    root = base / "notebooks"
    root.mkdir()
    for name in LESSONS:
        _lesson_copy(name, root)
    dirs = {"JUPYTER_CONFIG_DIR": "config", "JUPYTER_RUNTIME_DIR": "runtime", "JUPYTER_DATA_DIR": "data",
            "IPYTHONDIR": "ipython"}
    env = dict(os.environ, JUPYTER_PLATFORM_DIRS="1", PYTHONPATH=str(site),
               **{key: str(base / name) for key, name in dirs.items()})
    env.pop("VIRTUAL_ENV", None)
    token = secrets.token_hex(24)
    port = get_free_port()
    command = [str(jupyter), "notebook", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
               "--NotebookApp.port_retries=0", f"--NotebookApp.token={token}", f"--notebook-dir={root}"]
    if os.geteuid() == 0:
        command.append("--allow-root")
    log = base / "notebook.log"
    with log.open("w") as sink:
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, env=env, cwd=root,
                                   start_new_session=True)
    server = Server(f"http://127.0.0.1:{port}", token, root, process, log)
    server.versions, server.site = versions, site
    try:
        deadline = time.monotonic() + 60
        while True:
            if process.poll() is not None:
                pytest.fail(f"classic Notebook exited with {process.returncode}:\n{server.log_tail()}", pytrace=False)
            with contextlib.suppress(OSError, urllib.error.URLError):
                server.api("GET", "/api/status")
                break
            if time.monotonic() > deadline:
                pytest.fail(f"classic Notebook did not answer within 60 s:\n{server.log_tail()}", pytrace=False)
            time.sleep(0.25)
        yield server
    finally:
        stop(process)


KERNEL_IDLE_JS = """() => {
  const nb = window.Jupyter && Jupyter.notebook;
  const busy = Array.from(document.querySelectorAll('#notebook-container .code_cell'))
    .some(c => c.classList.contains('running'));
  return !!(nb && nb.kernel && nb.kernel.is_connected() && !busy &&
            document.querySelector('#kernel_indicator_icon.kernel_idle_icon'));
}"""


def _idle(page) -> bool:
    return page.evaluate(KERNEL_IDLE_JS)


def _settled(page, timeout_s: float, what: str) -> None:
    """Idle, and still idle a moment later (between two queued cells the kernel is idle too)."""
    def settled():
        if not _idle(page):
            return False
        time.sleep(0.7)
        return _idle(page)
    wait_until(settled, timeout_s, what)


def _notebook_json(page) -> dict:
    return page.evaluate("() => Jupyter.notebook.toJSON()")


@pytest.mark.parametrize("lesson", LESSONS)
def test_explorers_in_classic_notebook(lesson, classic, page):
    console_errors = []
    page.on("console", lambda m: m.type == "error" and console_errors.append(f"console: {m.text} ({m.location})"))
    page.on("pageerror", lambda e: console_errors.append(f"page error: {e}"))
    shots = SCREENSHOTS / "classic"
    try:
        page.goto(f"{classic.url}/notebooks/{lesson}.ipynb?token={classic.token}", wait_until="domcontentloaded")
        page.wait_for_function("() => window.Jupyter && Jupyter.notebook && Jupyter.notebook._fully_loaded",
                               timeout=OPEN_TIMEOUT_S * 1000)
        wait_until(lambda: _idle(page), OPEN_TIMEOUT_S, "the kernel to be ready")
        # The widget manager of ipywidgets 7's nbextension is there before anything runs.
        assert page.evaluate("() => !!(Jupyter.WidgetManager || (Jupyter.notebook.kernel.widget_manager))"), \
            "the widgets nbextension did not load (no Jupyter.WidgetManager)"

        page.locator("#menus a.dropdown-toggle", has_text=re.compile(r"^\s*Cell\s*$")).click()
        page.locator("#run_all_cells > a").click()
        wait_until(lambda: not _idle(page), 15, "Run All to start")
        _settled(page, RUN_TIMEOUT_S, "Run All to finish")

        nb = _notebook_json(page)
        assert error_outputs(nb) == [], "error outputs after Run All"
        code = [c for c in nb["cells"] if c["cell_type"] == "code" and "".join(c["source"]).strip()
                and "skip-execution" not in c.get("metadata", {}).get("tags", [])]
        ran = sum(1 for c in code if c.get("execution_count"))
        assert ran == len(code), f"Run All ran {ran} of {len(code)} code cells"
        printed = "".join("".join(o.get("text", "")) for c in code for o in c.get("outputs", []))
        assert f"from {classic.site}" in printed, "the kernel did not import the suite from this tree's wheel"

        explorers = page.locator(EXPLORER)
        try:  # views render a moment after the kernel went idle
            wait_until(lambda: explorers.count() > 0, 30, "an explorer (image and slider) to render")
        finally:
            text = page.locator("#notebook-container").inner_text()
            bad = BAD_TEXT.search(text)
            assert not bad, f"the notebook shows {bad.group(0)!r} after Run All"

        for i in range(explorers.count()):
            explorer = explorers.nth(i)
            image = explorer.locator("img.widget-image").first
            handle = explorer.locator(".widget-slider .ui-slider-handle").first
            assert handle.count(), f"explorer {i}: no jQuery UI slider handle"
            before = wait_until(lambda image=image: (b := image.evaluate(IMAGE_BYTES_JS))["digest"] and b, 15,
                                 f"explorer {i}'s image")
            assert before["png"], f"explorer {i}: its image is not a PNG ({before['src'][:60]})"
            handle.scroll_into_view_if_needed()
            handle.focus()
            handle.press("ArrowRight")

            def changed(image=image, before=before):
                now = image.evaluate(IMAGE_BYTES_JS)
                return now["digest"] not in ("", before["digest"]) and now
            try:
                after = wait_until(changed, SLIDER_TIMEOUT_S, "the plot to redraw", interval_s=0.3)
            except AssertionError as exc:
                raise AssertionError(f"explorer {i}: slider moved (ArrowRight), but its image did not change within "
                                     f"{SLIDER_TIMEOUT_S} s. It shows:\n{explorer.inner_text()}") from exc
            assert after["png"] and after["src"] != before["src"], f"explorer {i}: the redrawn image is not a new PNG"
            _settled(page, SLIDER_TIMEOUT_S, "the kernel to finish the redraw")
            text = explorer.inner_text()
            bad = BAD_TEXT.search(text) or re.search(r"Traceback|\u26a0", text)
            assert not bad, f"explorer {i}: after the slider moved it shows {bad.group(0)!r}:\n{text[-3000:]}"

        assert error_outputs(_notebook_json(page)) == [], "error outputs after using the explorers"
        assert console_errors == [], "the browser console reported errors"
    finally:
        shots.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(Exception):  # a failed screenshot must not hide the test's own failure
            page.set_viewport_size({"width": 1280, "height": int(min(max(900, page.evaluate(
                "() => document.querySelector('#notebook').scrollHeight") + 150), 12_000))})
            page.wait_for_timeout(300)
            page.screenshot(path=str(shots / f"{lesson}.png"), full_page=True)
        with contextlib.suppress(OSError):
            classic.shutdown_kernels()

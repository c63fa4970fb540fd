"""The environment the Makefile builds: pins, CPU-only torch, environment.yml, JupyterLab security."""

import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from importlib import metadata
from pathlib import Path

import pytest
import torch
from accelerate.utils.other import get_free_port

from gaccum_course.env import environment

ROOT = Path(__file__).resolve().parents[1]


def _lock_pins():
    lines = (ROOT / "requirements" / "lock.txt").read_text().splitlines()
    return {line.split("==")[0].lower(): line.split("==")[1] for line in lines if line and not line.startswith("#")}


def _makefile_torch():
    return re.search(r"^TORCH_VERSION := (\S+)$", (ROOT / "Makefile").read_text(), re.M).group(1)


def test_environment_yml_reads_the_lock_and_pins_the_makefiles_torch():
    text = (ROOT / "environment.yml").read_text()
    pip_lines = re.findall(r"^\s+- (.+)$", text.split("- pip:", 1)[1], flags=re.M)
    assert f"torch=={_makefile_torch()}+cpu" in pip_lines
    assert "-r requirements/lock.txt" in pip_lines and "-e ." in pip_lines
    # Every other requirement comes from the lock: nothing here can drift from it.
    assert [line for line in pip_lines if "==" in line] == [f"torch=={_makefile_torch()}+cpu"]
    assert (ROOT / "requirements" / "lock.txt").exists()


def test_every_lock_pin_is_what_is_installed():
    wrong = {name: (pin, metadata.version(name)) for name, pin in _lock_pins().items()
             if metadata.version(name) != pin}
    assert wrong == {}


def test_torch_is_the_pinned_cpu_build_and_no_cuda_package_is_installed():
    assert torch.__version__.split("+")[0] == _makefile_torch()
    env = environment()
    if env.gpus == 0:
        assert torch.version.cuda is None, "a CUDA build of torch on a machine without GPU"
        assert env.cuda_packages == ()


def test_lock_does_not_pin_torch_so_gpu_users_can_choose_a_build():
    assert "torch" not in _lock_pins()


def test_environment_table_lists_versions():
    table = environment().table()
    # the distribution's version: PyPI's CUDA wheel says 2.13.0 where torch.__version__ says 2.13.0+cu130
    assert re.search(rf"^torch\s+{re.escape(metadata.version('torch'))}$", table, re.M)
    assert re.search(rf"^accelerate\s+{re.escape(metadata.version('accelerate'))}$", table, re.M)


def test_a_second_make_env_has_nothing_to_do():
    assert (ROOT / ".venv" / ".gaccum-installed").exists(), "run the tests through `make test`"
    result = subprocess.run(["make", "-q", "env"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, "make env would reinstall although nothing changed"
    dry = subprocess.run(["make", "-n", "lab"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert "pip install" not in dry


def test_make_lab_binds_localhost_and_never_disables_the_token():
    dry = subprocess.run(["make", "-n", "lab"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert "--ServerApp.ip=127.0.0.1" in dry
    assert "token=''" not in dry and 'token=""' not in dry and "0.0.0.0" not in dry


def test_jupyterlab_started_like_make_lab_refuses_requests_without_the_token(tmp_path):
    port = get_free_port()
    token = "gaccum-test-token"
    args = [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--ServerApp.ip=127.0.0.1",
            f"--ServerApp.port={port}", f"--IdentityProvider.token={token}",
            f"--ServerApp.root_dir={ROOT / 'notebooks'}"]
    if os.geteuid() == 0:
        args.append("--allow-root")
    env = {**os.environ, "JUPYTER_RUNTIME_DIR": str(tmp_path), "JUPYTER_CONFIG_DIR": str(tmp_path / "cfg")}
    server = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}/api/contents"
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{url}?token={token}", timeout=2) as response:
                    assert response.status == 200
                    break
            except (urllib.error.URLError, ConnectionError):
                assert time.monotonic() < deadline, "JupyterLab did not start within 60 s"
                time.sleep(0.5)
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(url, timeout=5)
        assert refused.value.code == 403
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)


def test_gpus_are_counted_without_the_cuda_check_that_breaks_a_later_fork(monkeypatch):
    # torch.cuda.is_available() runs cuInit; forked launcher children then cannot use CUDA.
    # Stand in for a 2-GPU machine whose every fork-unsafe probe fails loudly.
    import importlib.util

    from gaccum_launch import choose_device

    spec = importlib.util.spec_from_file_location("bench", Path(__file__).parents[1] / "benchmarks" / "bench.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    machine = bench.machine

    def fork_poisoning_probe():
        raise AssertionError("torch.cuda.is_available() was called before a launch")

    monkeypatch.setattr(torch.cuda, "is_available", fork_poisoning_probe)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert environment().gpus == 2
    assert environment().launch_backend == "NCCL on 2 GPUs"
    assert machine()["gpus"] == 2
    assert choose_device(2) == "gpu"
    assert not torch.cuda.is_initialized()


def _environment_with(**changes):
    import dataclasses

    from gaccum_course.env import environment

    env = environment()
    return dataclasses.replace(env, versions={**env.versions, **changes.pop("versions", {})}, **changes)


def test_readiness_names_each_missing_or_old_package_with_its_fix():
    from gaccum_course.env import readiness

    # cuda_build None: on a CUDA build without a GPU (make pythons) readiness adds a note, tested apart
    problems, notes = readiness(_environment_with(versions={"transformers": None, "accelerate": "1.6.0"},
                                                  cuda_build=None))
    assert len(problems) == 2 and notes == []
    old, missing = sorted(problems)
    assert old.startswith("accelerate 1.6.0 is too old: lessons 02-09 need accelerate>=1.13")
    assert "`%pip install 'accelerate>=1.13'`" in old and "`make env`" in old
    assert missing.startswith("transformers is not installed: lessons 05 and 08 need transformers>=5.10.1")
    assert readiness(_environment_with(versions={"accelerate": "1.13.0"}))[0] == []  # the floor itself is enough


def test_readiness_takes_colabs_own_versions():
    # Colab's published set (late 2026): lesson 00 must not refuse it, nor tell a learner to upgrade ipywidgets.
    from gaccum_course.env import readiness

    colab = {"torch": "2.11.0", "accelerate": "1.14.0", "transformers": "5.15.0", "ipywidgets": "7.7.1"}
    assert readiness(_environment_with(versions=colab))[0] == []
    old_widgets = readiness(_environment_with(versions={**colab, "ipywidgets": "7.6.5"}))[0]
    assert len(old_widgets) == 1 and old_widgets[0].startswith("ipywidgets 7.6.5 is too old")


def test_readiness_takes_a_cuda_torch_without_a_gpu_and_a_lone_lesson_as_notes():
    from gaccum_course.env import readiness
    from gaccum_course.lessons import LESSONS

    problems, notes = readiness(_environment_with(cuda_build="12.8", gpus=0), lessons_here=["04_many_processes.ipynb"])
    assert problems == []
    cuda, alone = notes
    assert cuda.startswith("torch is a CUDA 12.8 build and no GPU is visible: the lessons run on the CPU")
    assert alone == f"{len(LESSONS) - 1} of the {len(LESSONS)} lessons are not in this folder: each runs on its own; " \
                    "clone the repository for the rest."  # one short line, not every missing name
    assert readiness(_environment_with(), lessons_here=[f"{i:02d}" for i in range(11)])[1] != []  # names, not counts


def test_the_floors_in_pyproject_are_the_ones_lesson_00_checks():
    import tomllib

    from gaccum_course.env import MINIMUMS

    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    for name, (minimum, _, _) in MINIMUMS.items():
        assert f"{name}>={minimum}" in dependencies

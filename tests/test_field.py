"""Where learners run it, outside this repository (`make field`; not part of `make test`: several minutes).

- A wheel built from the repository, installed (not editable) into a fresh venv, runs every
  lesson from a folder that is not the repository: what a plain `pip install` gives.
- A fresh venv with nothing but Jupyter's kernel and runner: a lesson's install cell installs
  torch and the suite (pointed at the local CPU torch and the fresh wheel), and the lesson runs.

The wheel's contents are checked in `make test` too (test_the_wheel_holds_what_the_lessons_read).
"""

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from gaccum_course.lessons import LESSONS

ROOT = Path(__file__).resolve().parents[1]
TORCH = "torch==2.13.0+cpu"  # the wheel on this machine's disk; a plain `torch` would be PyPI's CUDA build
RUNNER = ["nbmake", "pytest", "pytest-xdist"]


def _run(command, **kwargs):
    result = subprocess.run(command, capture_output=True, text=True, **kwargs)
    assert result.returncode == 0, f"{command[:4]} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


def _clean_env(**extra):
    keep = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV", "GACCUM"))}
    return {**keep, **extra}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    dist = tmp_path_factory.mktemp("dist")
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet", "-w", str(dist),
          str(ROOT)])
    [built] = dist.glob("gaccum_lib-*.whl")
    return built


def test_the_wheel_holds_what_the_lessons_read(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "gaccum_course/saved/benchmarks.json" in names  # lesson 07
    assert any(n.startswith("gaccum_lib/assets/") for n in names)
    assert {"gaccum_lib/__init__.py", "gaccum_check/__init__.py", "gaccum_course/__init__.py"} <= names
    metadata = next(zipfile.ZipFile(wheel).read(n).decode() for n in names if n.endswith(".dist-info/METADATA"))
    assert "License-Expression: MIT" in metadata and "Requires-Python: >=3.11" in metadata
    assert "Requires-Dist: transformers>=5.10.1" in metadata and "Requires-Dist: accelerate>=1.13" in metadata


def _venv(where, *packages):
    python = where / "bin" / "python"
    _run([sys.executable, "-m", "venv", str(where)])
    if packages:
        _run([str(python), "-m", "pip", "install", "--quiet", *packages], env=_clean_env())
    return python


@pytest.mark.field
def test_every_lesson_runs_from_the_installed_wheel_outside_the_repository(wheel, tmp_path):
    python = _venv(tmp_path / "venv", TORCH, str(wheel), *RUNNER)
    lessons = tmp_path / "lessons"
    shutil.copytree(ROOT / "notebooks", lessons)
    where = _run([str(python), "-c", "import gaccum_lib, gaccum_course; print(gaccum_lib.__file__)"],
                 cwd=tmp_path, env=_clean_env()).stdout
    assert str(tmp_path / "venv") in where and str(ROOT) not in where  # the installed copy, not the source tree
    result = subprocess.run([str(python), "-m", "pytest", "--nbmake", "-n", "2", "-q", "-p", "no:cacheprovider",
                             str(lessons)], cwd=tmp_path, env=_clean_env(), capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-5000:]
    assert f"{len(LESSONS)} passed" in result.stdout


@pytest.mark.field
@pytest.mark.parametrize("lesson", ["00_start_here.ipynb", "07_benchmarks.ipynb"])
def test_a_lessons_install_cell_installs_what_a_bare_jupyter_lacks(wheel, tmp_path, lesson):
    python = _venv(tmp_path / "venv", "ipykernel", *RUNNER)
    _run([str(python), "-c", "import importlib.util as u; assert u.find_spec('torch') is None"])
    shutil.copy(ROOT / "notebooks" / lesson, tmp_path / lesson)  # one lesson alone, as Colab opens it
    env = _clean_env(GACCUM_SOURCE=str(wheel), GACCUM_TORCH=TORCH)
    result = subprocess.run([str(python), "-m", "pytest", "--nbmake", "--overwrite", "-q", "-p", "no:cacheprovider",
                             str(tmp_path / lesson)], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-5000:]
    first_output = (tmp_path / lesson).read_text()
    assert f"installing {wheel}" in first_output and "gaccum_lib 0.1.0 from" in first_output
    if lesson == "00_start_here.ipynb":  # opened alone: a note, not a failure
        assert f"note: {len(LESSONS) - 1} of the {len(LESSONS)} lessons are not in this folder" in first_output
        assert "environment OK: CPU only" in first_output

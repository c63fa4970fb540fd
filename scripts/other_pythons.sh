#!/usr/bin/env bash
# The suite on the other Pythons learners have (`make pythons`; not part of `make test`).
#
# For each version in $PYTHONS (default 3.12 3.13): a venv in build/py<version> with the lock,
# torch 2.13.0 and the suite (editable), then the unit tests and every notebook under nbmake.
# Only 3.11 has a CPU torch wheel on the project's machines; elsewhere pip takes PyPI's CUDA build
# (about 5 GB with its nvidia packages; it runs on the CPU), which is why this stays out of
# `make test`. Two tests are about the repository's own .venv and are left out here: the CPU build
# check (these venvs hold a CUDA build on purpose) and "a second make env has nothing to do".
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHONS=${PYTHONS:-"3.12 3.13"}
TORCH=${TORCH:-torch==2.13.0}

interpreter() {  # pyenv's python<version>, else one on the PATH that runs (a pyenv shim may not)
  local root candidate; root=$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")
  for candidate in $(ls -d "$root"/versions/"$1".*/bin/python 2>/dev/null | sort -rV) "python$1"; do
    "$candidate" -c '' 2>/dev/null && { command -v "$candidate"; return; }
  done
}

for version in $PYTHONS; do
  python=$(interpreter "$version")
  [[ -n "$python" ]] || { echo "no Python $version found (PATH or pyenv)"; exit 1; }
  venv=build/py$version
  echo ">> Python $version ($python) in $venv"
  [[ -x $venv/bin/python ]] || "$python" -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet "$TORCH" uv
  "$venv/bin/uv" pip install --quiet --python "$venv/bin/python" --no-deps -r requirements/lock.txt
  "$venv/bin/uv" pip install --quiet --python "$venv/bin/python" --no-deps -e .
  "$venv/bin/python" -m pip check
  "$venv/bin/python" -c 'import sys, torch, accelerate, transformers; print("python", sys.version.split()[0], "torch", torch.__version__, "accelerate", accelerate.__version__, "transformers", transformers.__version__)'
  "$venv/bin/python" -m pytest tests -q -p no:cacheprovider -n 2 --dist worksteal \
    -m "not notebooks and not colab_outputs and not field" \
    --deselect tests/test_environment.py::test_torch_is_the_pinned_cpu_build_and_no_cuda_package_is_installed \
    --deselect tests/test_environment.py::test_a_second_make_env_has_nothing_to_do
  rm -rf "$venv/executed" && mkdir -p "$venv/executed" && cp notebooks/*.ipynb "$venv/executed/"
  "$venv/bin/python" -m pytest --nbmake -n 2 -q -p no:cacheprovider "$venv"/executed/*.ipynb
  echo ">> Python $version: unit tests and all notebooks passed"
done

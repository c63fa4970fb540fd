# gaccum: two commands from a fresh clone.
#   make lab    environment + JupyterLab on 127.0.0.1 (token auth)
#   make test   environment + every check (lint, unit tests, notebooks, notebooks in a real browser;
#               on a fresh Debian/Ubuntu machine it installs Chromium for that as well)
#   make html   environment + the lessons as a static, offline site in build/site/
#
# The environment is .venv, built from requirements/lock.txt (exact pins) plus torch, whose
# build depends on the machine: CPU by default, so no CUDA package lands on a machine
# without a GPU. A GPU user picks a CUDA build, e.g. `make lab TORCH_VARIANT=cu128`.

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.gaccum-installed
TORCH_VERSION := 2.13.0
TORCH_VARIANT ?= cpu
# With the CPU build of torch, DeepSpeed (an optional extra that make installs) can only use the CPU: say so
# up front, or every process that imports it (Accelerate's unwrap_model does) warns that it found no GPU.
ifeq ($(TORCH_VARIANT),cpu)
export DS_ACCELERATOR ?= cpu
endif
TORCH_INDEX_URL ?= https://download.pytorch.org/whl/$(TORCH_VARIANT)
LAB_PORT ?= 8888
# Unit tests, notebooks (also `make colab`, and `make html`'s runs) and the browser run NB_WORKERS at a time;
# `make test NB_WORKERS=0` runs them one by one.
NB_WORKERS ?= 2
EXECUTED := build/executed

.PHONY: help env lab test lint unit notebooks colab field floors pythons browser html bench bench-save determinism strip lock clean

help:
	@echo "make lab    - set up .venv (first time only) and start JupyterLab on http://127.0.0.1:$(LAB_PORT)"
	@echo "make test   - set up .venv (first time only) and run lint, unit tests and every notebook (also in a browser)"
	@echo "make html   - execute every notebook and render a static, offline site in build/site/"
	@echo "make field  - a wheel in a fresh venv runs every lesson outside the repository; the install cell in a bare Jupyter"
	@echo "make floors - every lesson at pyproject's floors and on Colab's and Kaggle's versions (several GB; PLATFORMS.md)"
	@echo "make pythons - the unit tests and every notebook on Python 3.12 and 3.13 (PyPI's CUDA torch, about 5 GB)"
	@echo "make colab  - the launching lessons in a kernel Accelerate takes for Colab's (make browser does it in the browser)"
	@echo "make bench  - measure what accumulation costs and saves (a few minutes); writes build/bench/results.*"
	@echo "make bench-save - the same, and replace the committed results (gaccum_course/saved/benchmarks.json, benchmarks/results.png)"
	@echo "make determinism - run every notebook 3 times and check it prints the same numbers"
	@echo "make strip  - remove outputs from the notebooks (the committed form)"
	@echo "make lock   - re-resolve requirements/top-level.txt into requirements/lock.txt (pip-tools)"

env: $(STAMP)

# Rebuilt only when the pins or the package metadata change: a second `make lab` installs nothing.
# This machine's pip.conf names index folders that do not exist; drop pip's warning about each.
QUIET_PIP := sed -u '/is ignored: it is neither a file nor a directory/d'
PIP_INSTALL := $(PY) -m pip install --quiet
# uv installs the lock in seconds where pip takes a minute (parallel downloads, no resolver work:
# the lock pins everything, so --no-deps, and `pip check` then proves the set consistent). Where uv
# cannot reach an index pip can (a pip.conf mirror), pip takes over.
UV_VERSION := 0.13.9
# --compile-bytecode: write every module's .pyc at install time, as pip does; where PYTHONDONTWRITEBYTECODE
# is set (CI) nothing would be cached later, and every process would compile torch's modules again.
UV_INSTALL := $(VENV)/bin/uv pip install --quiet --python $(PY) --no-deps --compile-bytecode

$(STAMP): requirements/lock.txt pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "gaccum needs Python 3.11 or newer, found " + sys.version.split()[0])'
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo ">> installing torch $(TORCH_VERSION)+$(TORCH_VARIANT) (from a local wheel if pip finds one, else $(TORCH_INDEX_URL))"
	@$(PIP_INSTALL) --no-deps --no-index "torch==$(TORCH_VERSION)+$(TORCH_VARIANT)" 2>/dev/null \
	  || $(PIP_INSTALL) --no-deps --index-url $(TORCH_INDEX_URL) "torch==$(TORCH_VERSION)+$(TORCH_VARIANT)" 2>&1 | $(QUIET_PIP)
	@echo ">> installing the pinned dependencies (requirements/lock.txt) with uv $(UV_VERSION)"
	@$(PIP_INSTALL) "uv==$(UV_VERSION)" 2>&1 | $(QUIET_PIP)
	@$(UV_INSTALL) -r requirements/lock.txt || $(PIP_INSTALL) -r requirements/lock.txt 2>&1 | $(QUIET_PIP)
	@$(UV_INSTALL) -e ".[deepspeed]" || $(PIP_INSTALL) --no-deps -e ".[deepspeed]" 2>&1 | $(QUIET_PIP)
	@$(PY) -m pip check
	@touch $(STAMP)

lab: $(STAMP)
	@echo ">> JupyterLab on 127.0.0.1:$(LAB_PORT); open the URL with the token that it prints below"
	$(VENV)/bin/jupyter lab --no-browser --ServerApp.ip=127.0.0.1 --ServerApp.port=$(LAB_PORT) \
	  --ServerApp.root_dir=notebooks $(if $(filter 0,$(shell id -u)),--allow-root,)

test: lint unit notebooks browser

lint: $(STAMP)
	$(VENV)/bin/ruff check gaccum_lib gaccum_launch gaccum_check gaccum_course benchmarks tests scripts examples solutions notebooks
	$(PY) scripts/check_notebooks.py notebooks

# Two workers, as for the notebooks: the real-process tests take their ports from the OS and their
# files from tmp_path, so they run side by side (make pythons runs the same tests so). The slow tests
# (marked slow) are queued first, and a worker that runs out takes the tail of the other's queue
# (worksteal): none starts near the end, and the workers end within about one slow test of each other.
unit: $(STAMP)
	$(PY) -m pytest tests -q -m "not notebooks and not colab_outputs and not field" -p no:cacheprovider \
	  $(if $(filter 0,$(NB_WORKERS)),,-n $(NB_WORKERS) --dist worksteal)

# Executes copies of the notebooks (nbmake keeps their outputs there), then checks what the
# executed outputs show: the reference figures must appear, not just the asserts pass. The longest
# lessons are queued first (the lesson map's run times); xdist hands them out two, then one at a time
# to whichever worker is free, and the short ones fill the end.
# The kernels get the site's alt-text start-up script, so `make html` can render these very outputs.
notebooks: $(STAMP)
	rm -rf $(EXECUTED) build/ipython && mkdir -p $(EXECUTED) build/ipython/profile_default/startup
	cp notebooks/*.ipynb $(EXECUTED)/ && cp scripts/site_alt_text.py build/ipython/profile_default/startup/
	order="$$($(PY) scripts/longest_first.py $(EXECUTED)/*.ipynb)" && [ -n "$$order" ] && \
	IPYTHONDIR=$(CURDIR)/build/ipython $(PY) -m pytest --nbmake --overwrite \
	  $(if $(filter 0,$(NB_WORKERS)),,-n $(NB_WORKERS)) -p no:cacheprovider -q $$order
	touch $(EXECUTED)/.complete
	$(PY) -m pytest tests -q -m notebooks -p no:cacheprovider

# The lessons that launch processes, in kernels that Accelerate takes for Colab's (an IPython start-up
# script changes what str(get_ipython()) says; Accelerate reads nothing else): there notebook_launcher
# forks nothing below 2 GPUs, and the lessons must start real processes another way, same figures.
# `make test` runs them so in the browser (`make browser`, below); `make colab` is the same check under
# nbmake, for a machine without Chromium.
COLAB_LESSONS := 04_many_processes 05_capstone_language_model 06_pitfalls_gallery 08_your_real_stack 09_schedulers_across_processes 10_fsdp_and_deepspeed 12_capstone_further
colab: $(STAMP)
	rm -rf build/colab && mkdir -p build/colab/run build/colab/ipython/profile_default/startup
	for lesson in $(COLAB_LESSONS); do cp notebooks/$$lesson.ipynb build/colab/run/; done
	cp tests/colab/kernel_startup.py build/colab/ipython/profile_default/startup/
	GACCUM_COLAB_LESSONS= IPYTHONDIR=$(CURDIR)/build/colab/ipython $(PY) -m pytest --nbmake --overwrite \
	  $(if $(filter 0,$(NB_WORKERS)),,-n $(NB_WORKERS)) -p no:cacheprovider -q build/colab/run/*.ipynb
	GACCUM_COLAB_EXECUTED=build/colab/run $(PY) -m pytest tests -q -m colab_outputs -p no:cacheprovider

# Where learners run it, outside the repository: a wheel in a fresh venv runs every lesson from another
# folder, and a lesson's install cell sets up a venv that has only Jupyter. Several minutes and PyPI (or
# this machine's mirror), so not part of `make test`; run it before a release.
field: $(STAMP)
	$(PY) -m pytest tests/test_field.py -q -m field -p no:cacheprovider

# Every lesson on the software learners have (scripts/run_platforms.py): a venv at pyproject.toml's floors,
# one of Colab's published set (Python 3.13, ipywidgets 7.7.1) and a Kaggle-like one (3.12, ipywidgets 8.1.5),
# each lesson run in a kernel Accelerate takes for the platform's and installed by its own install cell, which
# must leave torch, accelerate, transformers and ipywidgets as they were. Several GB from PyPI: not in make test.
# Writes benchmarks/PLATFORMS.md.
floors: $(STAMP)
	$(PY) scripts/run_platforms.py
	GACCUM_CLASSIC_PYTHON=build/platforms/colab/bin/python GACCUM_CHROMIUM="$$($(PY) tests/browser/chromium.py --provide)" $(PY) -m pytest tests/browser/test_classic_notebook.py -q -m classic --tb=short -p no:cacheprovider

# The unit tests and every notebook on Python 3.12 and 3.13 (build/py3.12, build/py3.13). PyPI's torch
# for them is the CUDA build (about 5 GB): out of `make test`, run it before a release.
pythons:
	scripts/other_pythons.sh

# Every notebook in a real browser: JupyterLab from .venv (127.0.0.1, token) driven through the
# system's Chromium by Playwright -- Run All, no error output or console error, sliders redraw their
# plots, launch buttons answer. Screenshots go to build/screenshots/. The browser comes first:
# tests/browser/chromium.py finds an installed Chrome/Chromium, or installs Debian's Chromium
# (as root or through passwordless sudo), or stops here naming the one command that fixes it.
# Two workers, as for the notebooks (longest first too): each runs its own JupyterLab and Chromium
# (203 s -> 127-160 s here, the Colab kernels included).
# The launching lessons run there in kernels Accelerate takes for Colab's (the check `make colab` makes
# under nbmake, here without a third run of these lessons): their Run All outputs, saved to
# BROWSER_EXECUTED, must show the seed's figures from real processes. nbmake has already run every
# lesson in a plain kernel. With GACCUM_BROWSER_NOTEBOOKS set (a scratch run) that check is left out.
BROWSER_EXECUTED ?= build/browser/executed
browser: $(STAMP)
	@mkdir -p build && $(PY) tests/browser/chromium.py --provide > build/chromium-path
	rm -rf $(BROWSER_EXECUTED)
	GACCUM_CHROMIUM="$$(cat build/chromium-path)" GACCUM_COLAB_LESSONS="$(COLAB_LESSONS)" \
	  GACCUM_BROWSER_EXECUTED=$(BROWSER_EXECUTED) $(PY) -m pytest tests/browser -q --tb=short -p no:cacheprovider \
	  $(if $(filter 0,$(NB_WORKERS)),,-n $(NB_WORKERS))
	if [ -z "$${GACCUM_BROWSER_NOTEBOOKS:-}" ]; then \
	  GACCUM_COLAB_EXECUTED=$(BROWSER_EXECUTED) $(PY) -m pytest tests -q -m colab_outputs -p no:cacheprovider; \
	else echo ">> GACCUM_BROWSER_NOTEBOOKS is set: the Colab lessons' outputs are not checked"; fi

# The lessons as a static site that works offline: renders build/site/index.html and one page per
# notebook from the outputs `make notebooks` left in build/executed (widgets keep their last state),
# or, when those are missing or older than a notebook or the library, executes the notebooks first.
html: $(STAMP)
	if [ -f $(EXECUTED)/.complete ] && [ -z "$$(find notebooks gaccum_lib gaccum_check gaccum_course -newer $(EXECUTED)/.complete -name '*.ipynb' -o -newer $(EXECUTED)/.complete -name '*.py')" ]; then \
	  echo ">> rendering the notebooks make notebooks executed ($(EXECUTED))"; \
	  $(PY) scripts/build_site.py --out build/site --executed $(EXECUTED); \
	  executed=$(EXECUTED); \
	else \
	  $(PY) scripts/build_site.py --out build/site --jobs $(if $(filter 0,$(NB_WORKERS)),1,$(NB_WORKERS)); \
	  executed=build/site-run; \
	fi; \
	GACCUM_SITE=build/site GACCUM_SITE_EXECUTED=$$executed $(PY) -m pytest tests/test_site.py -q -p no:cacheprovider

# Ratios and counts measured in one run. `make bench` writes build/bench/ and leaves the committed results
# alone: lesson 07 and the README show those, and a run on a busy machine must not rewrite them under
# `make test`. `make bench-save` measures and replaces the committed copy (say the machine's load when
# you commit it).
bench: $(STAMP)
	mkdir -p build/bench
	$(PY) benchmarks/bench.py --out build/bench/results.json --plot build/bench/results.png

bench-save: $(STAMP)
	$(PY) benchmarks/bench.py --out gaccum_course/saved/benchmarks.json --plot benchmarks/results.png
	$(PY) benchmarks/write_results.py

determinism: $(STAMP)
	$(PY) scripts/check_determinism.py --runs 3

strip: $(STAMP)
	$(PY) scripts/check_notebooks.py --strip notebooks

# pip-tools resolves requirements/top-level.txt into exact pins, without building an environment to
# freeze. torch is held at the Makefile's CPU build while resolving (so no CUDA package is pinned) and
# left out of the lock: `make env` installs the variant the machine needs. environment.yml reads the lock.
lock:
	rm -rf build/locktools && $(PYTHON) -m venv build/locktools
	build/locktools/bin/pip install --quiet pip-tools 2>&1 | $(QUIET_PIP)
	echo "torch==$(TORCH_VERSION)+cpu" > build/locktools/torch.txt
	build/locktools/bin/pip-compile --quiet --strip-extras --no-header --no-annotate --allow-unsafe --unsafe-package torch \
	  -c build/locktools/torch.txt -o build/locktools/lock.txt requirements/top-level.txt
# --allow-unsafe pins setuptools too: make env installs the lock with --no-deps, and torch needs a
# newer setuptools than a fresh venv has.
	{ head -n 2 requirements/lock.txt; grep -v -E '^(#|--|[[:space:]]*$$|torch==)' build/locktools/lock.txt; } > requirements/lock.tmp
	mv requirements/lock.tmp requirements/lock.txt

clean:
	rm -rf build .pytest_cache

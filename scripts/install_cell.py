"""The first code cell of every lesson, kept in one place: `python scripts/install_cell.py --write notebooks`.

On Colab, Kaggle or a JupyterHub it installs what the lessons need, once per runtime: torch only
where none is present (the CPU build; an installed CUDA torch is left alone), then this suite at
its pinned release. In `make lab`'s kernel, or wherever the wheel is installed, gaccum_lib imports
and the cell installs nothing. It is plumbing, not a lesson: JupyterLab shows it collapsed
(`jupyter.source_hidden`; a click opens it). `scripts/check_notebooks.py` fails a lesson whose
first cell differs or is not collapsed.

`GACCUM_SOURCE` and `GACCUM_TORCH` replace what it installs (the field test points them at a
freshly built wheel and the local CPU torch).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

#: The cell's metadata: collapsed in JupyterLab (Colab ignores it and shows the code).
INSTALL_CELL_METADATA = {"jupyter": {"source_hidden": True}}

#: Where the lessons install the suite from: this release, so a lesson and its library match.
RELEASE = "gaccum_lib @ git+https://github.com/gaccum/gaccum@v0.1.0"

INSTALL_CELL = f'''\
# Colab, Kaggle, a JupyterHub: install what the lessons need (in `make lab`'s kernel, nothing).
import importlib.metadata
import importlib.util
import os
import subprocess
import sys

if importlib.util.find_spec("gaccum_lib") is None:
    # only-if-needed: a torch, accelerate, transformers or ipywidgets the suite accepts stays as it is
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--upgrade-strategy", "only-if-needed"]
    if importlib.util.find_spec("torch") is None:  # no torch at all: the CPU build; a CUDA torch stays as it is
        torch = os.environ.get("GACCUM_TORCH", "torch --index-url https://download.pytorch.org/whl/cpu")
        subprocess.run(pip + torch.split(), check=True)
    source = os.environ.get("GACCUM_SOURCE", "{RELEASE}")
    print("installing", source)
    subprocess.run(pip + [source], check=True)  # fails with pip's reason; else clone and `make lab` (README)
    importlib.invalidate_caches()
if "google.colab" in sys.modules and not importlib.metadata.version("ipywidgets").startswith("7."):
    from google.colab import output  # Colab shows ipywidgets 8's widgets only with its own widget manager

    output.enable_custom_widget_manager()
import gaccum_lib

print("gaccum_lib", gaccum_lib.__version__, "from", os.path.dirname(gaccum_lib.__file__))'''


def write(folder: Path) -> list[str]:
    """Make every lesson's first code cell the install cell; returns the lessons that changed."""
    changed = []
    for path in sorted(folder.glob("[0-9][0-9]_*.ipynb")):
        nb = json.loads(path.read_text())
        first = next(c for c in nb["cells"] if c["cell_type"] == "code")
        lines = INSTALL_CELL.split("\n")
        source = [line + "\n" for line in lines[:-1]] + [lines[-1]]
        if first["source"] != source or first.get("metadata") != INSTALL_CELL_METADATA:
            first["source"], first["metadata"] = source, dict(INSTALL_CELL_METADATA)
            path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
            changed.append(path.name)
    return changed


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", type=Path, required=True, help="the folder of lessons to update")
    print("updated:", ", ".join(write(parser.parse_args().write)) or "nothing", file=sys.stderr)

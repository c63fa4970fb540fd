"""Enforce the notebook policy: committed notebooks carry no outputs and follow the lesson shape.

    python scripts/check_notebooks.py notebooks          # check, exit 1 with a list of problems
    python scripts/check_notebooks.py --strip notebooks  # remove outputs and volatile metadata

Policy (why): outputs are produced by `make test` / `make html`, never committed, so diffs
stay readable and nothing stale is shown as if it were current. Every lesson opens with what
you will learn, prerequisites and time, ends with a summary and exercises, starts with a
cell that installs what a hosted kernel lacks (scripts/install_cell.py), keeps code cells to
25 lines (the take-home function aside), and asserts what its prose claims. A lesson is one
topic: at most 1,500 words of prose. What a learner reads is the claim, not the plumbing: no
source line numbers of other libraries (they change with every release), no reading of library
source, and no exact float pinned in a visible assert (``cmp(...)`` with a tolerance reads as
the claim; exact pins live in the tests of the executed notebooks).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from install_cell import INSTALL_CELL, INSTALL_CELL_METADATA  # noqa: E402 -- beside this script, not a package

KEPT_METADATA = ("kernelspec", "language_info", "execution")
OPENING = ("What you will learn", "Prerequisites", "Time")
MAX_PROSE_WORDS = 1500
# "line 3413", "lines 1134-1136": a pinned release's source lines, stale at the next release.
SOURCE_LINE = re.compile(r"\blines? \d+")
READS_SOURCE = re.compile(r"\binspect\.getsource|\binspect\.getsourcelines|__code__")
# An assert that pins a measured float: `round(x, 3) == 0.883`, `x == [0.621, 0.379]` (a whole number
# written as a float, `== 0.0` or `== 1.0`, is an exact fact, not a rounding).
EXACT_FLOAT = re.compile(r"^\s*assert\b.*(==\s*\[?\s*-?\d*\.\d*[1-9]|\d*\.\d*[1-9]\d*\s*\]?\s*==)", re.M)
CLOSING = ("Summary", "Exercises")
# A lesson cell a learner can read at a glance; only the take-home function (tagged) is longer,
# because it is meant to be copied whole into a training script.
MAX_CODE_LINES = 25
LONG_CELL_TAG = "take-home"


def problems_of(path: Path) -> list[str]:
    try:
        nb = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        return [f"cannot be read as JSON: {exc}"]
    found = []
    if nb.get("nbformat") != 4:
        found.append(f"nbformat must be 4, found {nb.get('nbformat')}")
    if nb.get("metadata", {}).get("kernelspec", {}).get("name") != "python3":
        found.append("kernelspec name must be python3")
    extra = sorted(set(nb.get("metadata", {})) - set(KEPT_METADATA))
    if extra:
        found.append(f"notebook metadata has {extra}: run `make strip`")
    cells = nb.get("cells", [])
    code = [c for c in cells if c.get("cell_type") == "code"]
    markdown = ["".join(c.get("source", "")) for c in cells if c.get("cell_type") == "markdown"]
    for i, cell in enumerate(code):
        if cell.get("outputs"):
            found.append(f"code cell {i} has outputs: run `make strip`")
        if cell.get("execution_count") is not None:
            found.append(f"code cell {i} has an execution count: run `make strip`")
    for i, cell in enumerate(cells):  # counted over all cells, as JupyterLab shows them
        lines = len("".join(cell.get("source", "")).splitlines())
        if (cell.get("cell_type") == "code" and lines > MAX_CODE_LINES
                and LONG_CELL_TAG not in cell.get("metadata", {}).get("tags", [])):
            found.append(f"cell {i} has {lines} lines of code (at most {MAX_CODE_LINES} unless tagged "
                         f"'{LONG_CELL_TAG}'): move plumbing to the library or split it")
    sources = ["".join(c.get("source", "")) for c in code]
    if not any("assert" in s for s in sources):
        found.append("no assert in any code cell: nbmake would pass it whatever it shows")
    if not sources or sources[0] != INSTALL_CELL or code[0].get("metadata") != INSTALL_CELL_METADATA:
        found.append("the first code cell must be the install cell, collapsed: "
                     "python scripts/install_cell.py --write notebooks")
    if not markdown or not all(h in markdown[0] for h in OPENING):
        found.append(f"the first markdown cell must name: {', '.join(OPENING)}")
    for heading in CLOSING:
        if not any(f"## {heading}" in m for m in markdown):
            found.append(f"missing a '## {heading}' section")
    words = sum(len(m.split()) for m in markdown)
    if words > MAX_PROSE_WORDS:
        found.append(f"{words} words of prose (at most {MAX_PROSE_WORDS}): one topic a lesson; split it or cut")
    for i, cell in enumerate(cells):
        text = "".join(cell.get("source", ""))
        if SOURCE_LINE.search(text):
            found.append(f"cell {i} cites a source line number ({SOURCE_LINE.search(text).group(0)}): name the "
                         "function instead")
        if cell.get("cell_type") != "code" or cell.get("metadata", {}).get("jupyter", {}).get("source_hidden"):
            continue
        if READS_SOURCE.search(text):
            found.append(f"cell {i} reads library source: pin such facts in a test of the executed notebook")
        if EXACT_FLOAT.search(text):
            found.append(f"cell {i} pins an exact float in an assert ({EXACT_FLOAT.search(text).group(0).strip()}): "
                         "assert the claim with cmp(..., tol) and pin the number in tests/test_executed_notebooks.py")
    return found


def strip(path: Path) -> bool:
    """Clear outputs and volatile metadata with nbconvert's own preprocessors; write with nbformat.

    What nbconvert does not decide for us: which metadata a lesson keeps. The notebook keeps
    its kernelspec, language name and nbmake's execution settings; a cell keeps its tags
    (``raises-exception``, ``skip-execution``) and ``jupyter`` (a collapsed, hidden source).
    """
    import nbformat
    from nbconvert.preprocessors import ClearMetadataPreprocessor, ClearOutputPreprocessor

    before = path.read_text()
    nb = nbformat.reads(before, as_version=4)
    nb, _ = ClearOutputPreprocessor().preprocess(nb, {})
    nb, _ = ClearMetadataPreprocessor(
        preserve_nb_metadata_mask={(key,) for key in KEPT_METADATA},
        preserve_cell_metadata_mask={"tags", "jupyter"}).preprocess(nb, {})
    after = nbformat.writes(nb) + "\n"
    if after != before:
        path.write_text(after)
    return after != before


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+", type=Path)
    parser.add_argument("--strip", action="store_true", help="remove outputs instead of checking")
    args = parser.parse_args(argv)
    paths = sorted(p for folder in args.folders for p in folder.glob("*.ipynb"))
    if not paths:
        print(f"no notebooks found in {', '.join(map(str, args.folders))}", file=sys.stderr)
        return 1
    if args.strip:
        for p in paths:
            print(f"{'stripped' if strip(p) else 'clean   '} {p}")
        return 0
    failures = {str(p): problems_of(p) for p in paths}
    failures = {p: f for p, f in failures.items() if f}
    for p, found in failures.items():
        for problem in found:
            print(f"{p}: {problem}")
    print(f"{len(paths)} notebooks checked, {len(failures)} with problems")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

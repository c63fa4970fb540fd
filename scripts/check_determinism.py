"""Run every notebook several times and check that they print the same numbers each time.

    python scripts/check_determinism.py            # 3 runs of every notebook (make determinism)
    python scripts/check_determinism.py --runs 2 notebooks/03_variable_length_trap.ipynb

Compares the text each code cell prints (stdout and text results). Durations and widget
timings are the only numbers allowed to change between runs; they are masked (see VOLATILE).
Exit status 1 and a diff on any other difference.
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
# Text that legitimately differs from run to run: wall times, process ids, ports, memory addresses.
VOLATILE = [
    (re.compile(r"\d+(\.\d+)?\s?(ms|s)\b"), "<time>"),
    (re.compile(r"pid[ =:]\s*\d+", re.I), "pid <n>"),
    (re.compile(r"0x[0-9a-f]{6,}"), "<address>"),
    (re.compile(r"port \d+"), "port <n>"),
    (re.compile(r"/tmp/[^\s'\"]+"), "<tmp>"),
]


def printed(path: Path) -> list[str]:
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}).execute()
    lines = []
    for index, cell in enumerate(nb.cells):
        for output in cell.get("outputs", []):
            if output.get("output_type") == "stream" and output.get("name") == "stdout":
                text = output["text"]
            elif "data" in output and "text/plain" in output["data"] and "image/png" not in output["data"]:
                text = output["data"]["text/plain"]
            else:
                continue
            for line in text.splitlines():
                for pattern, replacement in VOLATILE:
                    line = pattern.sub(replacement, line)
                if line.strip():
                    lines.append(f"[cell {index}] {line}")
    # Launched processes print concurrently: their order within a cell is not a result.
    return sorted(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="*", type=Path)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args(argv)
    if args.runs < 2:
        parser.error("--runs must be at least 2 to compare anything")
    paths = args.notebooks or sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    failures = 0
    for path in paths:
        runs = [printed(path) for _ in range(args.runs)]
        numbers = sum(len(re.findall(r"\d\.\d+", line)) for line in runs[0])
        different = [i for i in range(1, args.runs) if runs[i] != runs[0]]
        if different:
            failures += 1
            print(f"DIFFERENT {path.name}: run 1 vs run {different[0] + 1}")
            sys.stdout.writelines(line + "\n" for line in difflib.unified_diff(
                runs[0], runs[different[0]], "run 1", f"run {different[0] + 1}", lineterm="", n=1))
        else:
            print(f"same      {path.name}: {args.runs} runs, {len(runs[0])} printed lines, {numbers} decimal numbers")
    print(f"{len(paths) - failures} of {len(paths)} notebooks printed the same numbers in {args.runs} runs")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

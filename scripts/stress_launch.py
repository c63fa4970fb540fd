"""Launch real processes many times from inside a Jupyter kernel and count launches that hang.

    python scripts/stress_launch.py                     # 100 launches of 3 processes
    python scripts/stress_launch.py --launches 300 --processes 2

Rare races (a fork inheriting a lock held by another thread of the kernel) show only in a
real kernel, under load, once in dozens of launches: too slow for `make test`, so this is a
tool to run after touching gaccum_lib/launch.py. Running a CPU-heavy process beside it
makes races more likely. Exit status 1 if any launch failed.
"""

from __future__ import annotations

import argparse
import sys

import nbformat
from nbclient import NotebookClient

CELL = """
import time
from gaccum_lib import LaunchError, real_run, seed_sequences, simulate
simulate(seed_sequences(8), "token_normalised", grad_accum_steps=2, micro_batch_size=4)  # threads used first
failures, seconds = [], []
for i in range({launches}):
    start = time.time()
    try:
        real_run(seed_sequences(8 * {processes}), "token_normalised", grad_accum_steps=2, micro_batch_size=4,
                 num_processes={processes}, timeout={timeout})
    except LaunchError as error:
        failures.append((i, str(error).splitlines()[0][:160]))
    seconds.append(time.time() - start)
print(f"{{len(failures)}} of {launches} launches failed; slowest {{max(seconds):.1f}} s")
for failure in failures:
    print(failure)
"""


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launches", type=int, default=100)
    parser.add_argument("--processes", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=25.0, help="seconds before a launch counts as hung")
    args = parser.parse_args(argv)
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(CELL.format(**vars(args)))]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    NotebookClient(nb, timeout=None, kernel_name="python3").execute()
    text = "".join(o.get("text", "") for o in nb.cells[0].outputs if o.get("output_type") == "stream")
    print(text)
    return 0 if text.startswith("0 of") else 1


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""Print the given notebooks, the longest-running lesson first (the lesson map's run time).

    python scripts/longest_first.py build/executed/*.ipynb

`make notebooks` hands nbmake's two pytest-xdist workers the notebooks in this order: xdist gives
each worker two, then one at a time as they finish, so the long lessons start first and the short
ones fill the end.
A notebook the map does not know (a scratch one) comes last.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gaccum_course.lessons import longest_first  # noqa: E402 -- the repository's copy, not an installed one

if __name__ == "__main__":
    print(" ".join(longest_first(sys.argv[1:])))

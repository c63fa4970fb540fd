"""Write environment.yml from requirements/lock.txt, so conda users get the same pins.

    python scripts/sync_environment.py          # rewrite environment.yml
    python scripts/sync_environment.py --check  # exit 1 if it is out of date

tests/test_environment.py fails when the two disagree.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "requirements" / "lock.txt"
ENV = ROOT / "environment.yml"


def torch_version() -> str:
    match = re.search(r"^TORCH_VERSION := (\S+)$", (ROOT / "Makefile").read_text(), re.M)
    if not match:
        raise SystemExit("Makefile has no 'TORCH_VERSION := ...' line")
    return match.group(1)


def lock_pins() -> list[str]:
    return [line.strip() for line in LOCK.read_text().splitlines() if line.strip() and not line.startswith("#")]


def render() -> str:
    pins = "\n".join(f"      - {p}" for p in lock_pins())
    return f"""# Generated from requirements/lock.txt by scripts/sync_environment.py: edit the lock, not this file.
# CPU build of torch; for CUDA replace the index and the +cpu suffix (see README, "GPU users").
name: gaccum
channels:
  - conda-forge
dependencies:
  - python=3.11
  - pip
  - pip:
      - --extra-index-url https://download.pytorch.org/whl/cpu
      - torch=={torch_version()}+cpu
{pins}
      - -e .
"""


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = ENV.read_text() if ENV.exists() else ""
        if current != text:
            print("environment.yml is out of date with requirements/lock.txt: run `make lock` "
                  "or `python scripts/sync_environment.py`")
            return 1
        return 0
    ENV.write_text(text)
    print(f"wrote {ENV.relative_to(ROOT)} ({len(lock_pins()) + 1} pins)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Turn a lesson drafted as a percent-format script into a stripped notebook.

    python scripts/percent_to_notebook.py draft/03_my_lesson.py            # -> notebooks/03_my_lesson.ipynb
    python scripts/percent_to_notebook.py draft.py --out /tmp/notebooks/   # elsewhere

Cells start with `# %%` (code), `# %% [markdown]` (text, each line prefixed by `# `) and may
carry tags: `# %% tags=["raises-exception"]`. The notebook is the source of truth afterwards;
this is only a convenient way to write a first draft in an editor.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _markdown_line(line: str) -> str:
    if line.startswith("# "):
        return line[2:]
    return line[1:] if line.startswith("#") else line


def convert(source: Path) -> dict:
    parts = re.split(r"^# %%(.*)$", source.read_text(), flags=re.M)
    cells = []
    for index, (header, body) in enumerate(zip(parts[1::2], parts[2::2], strict=True)):
        header, body = header.strip(), body.strip("\n")
        metadata = {}
        tags = re.search(r"tags=(\[.*?\])", header)
        if tags:
            metadata["tags"] = json.loads(tags.group(1))
        cell_id = f"{source.stem[:2]}-{index:03d}"
        if header.startswith("[markdown]"):
            text = "\n".join(_markdown_line(line) for line in body.splitlines())
            cells.append({"cell_type": "markdown", "id": cell_id, "metadata": metadata,
                          "source": text.splitlines(True)})
        else:
            cells.append({"cell_type": "code", "execution_count": None, "id": cell_id, "metadata": metadata,
                          "outputs": [], "source": body.splitlines(True)})
    kernelspec = {"display_name": "Python 3", "language": "python", "name": "python3"}
    return {"cells": cells, "metadata": {"kernelspec": kernelspec, "language_info": {"name": "python"}},
            "nbformat": 4, "nbformat_minor": 5}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sources", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, default=ROOT / "notebooks")
    args = parser.parse_args(argv)
    for source in args.sources:
        target = args.out / f"{source.stem}.ipynb"
        target.write_text(json.dumps(convert(source), indent=1, ensure_ascii=False) + "\n")
        print(f"wrote {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

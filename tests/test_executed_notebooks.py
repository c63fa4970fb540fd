"""What the executed notebooks show (run by `make notebooks` after nbmake wrote the outputs).

nbmake fails a notebook on an error or a failed assert; these tests add that the reference
figures are visible in the outputs a learner reads.
"""

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXECUTED = ROOT / "build" / "executed"

# Text each executed notebook must show somewhere in its outputs.
EXPECTED_FIGURES = {
    "00_start_here.ipynb": ["weight after one accumulated update: 2.04000",
                            "weight after one full-batch step:    2.04000"],
}

NOTEBOOKS = sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb"))


def _output_text(path: Path) -> str:
    nb = json.loads(path.read_text())
    parts = []
    for cell in nb["cells"]:
        for output in cell.get("outputs", []):
            if output.get("output_type") == "stream":
                parts.append("".join(output["text"]))
            elif "data" in output:
                parts.append("".join(output["data"].get("text/plain", "")))
                parts.append("".join(output["data"].get("text/markdown", "")))
            elif output.get("output_type") == "error":
                parts.append(f"ERROR {output.get('ename')}: {output.get('evalue')}")
    return "\n".join(parts)


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_was_executed_without_error(name):
    path = EXECUTED / name
    assert path.exists(), f"{path} missing: run `make notebooks`"
    nb = json.loads(path.read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert any(c.get("outputs") for c in code), "no outputs: was it executed?"
    errors = [o for c in code for o in c.get("outputs", []) if o.get("output_type") == "error"
              and "raises-exception" not in c.get("metadata", {}).get("tags", [])]
    assert errors == []


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_reference_figures_appear_in_the_outputs(name):
    assert name in EXPECTED_FIGURES, f"add the figures {name} must show to EXPECTED_FIGURES"
    text = _output_text(EXECUTED / name)
    missing = [figure for figure in EXPECTED_FIGURES[name] if figure not in text]
    assert missing == []

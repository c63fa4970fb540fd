"""The README's Python examples run and do what the README says."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_readme_python_examples_run(capsys):
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert blocks, "the README should show at least one runnable Python example"
    for i, block in enumerate(blocks):
        exec(compile(block, f"README.md python block {i}", "exec"), {"__name__": "readme_example"})
    assert "check_accumulation passed" in capsys.readouterr().out


def test_readme_opens_with_the_two_commands():
    text = (ROOT / "README.md").read_text()
    first_block = re.search(r"```bash\n(.*?)```", text, re.S).group(1)
    assert first_block.splitlines()[0].startswith("make lab") and first_block.splitlines()[1].startswith("make test")



def test_readme_and_contributing_stay_within_their_word_bounds():
    # What `wc -w` counts: whitespace-separated words, the whole file.
    assert len((ROOT / "README.md").read_text().split()) <= 1200
    assert len((ROOT / "CONTRIBUTING.md").read_text().split()) <= 600


def test_readme_links_point_at_files_in_the_repository():
    links = re.findall(r"\]\(([^)#]+)\)", (ROOT / "README.md").read_text())
    assert links, "the README links to the results, the docs and the contributing guide"
    assert [link for link in links if not link.startswith("http") and not (ROOT / link).exists()] == []

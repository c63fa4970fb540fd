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


def test_readme_benchmark_table_is_the_saved_measurement():
    from gaccum_course import benchmarks

    results = benchmarks.load()
    text = (ROOT / "README.md").read_text()
    allreduce = results["allreduce"]
    expected = [
        f"{results['strategy_cost']['token_over_naive']:.3f}x",
        f"1 with `no_sync`, {allreduce['allreduce_rounds_per_update']['every_micro_batch']} without",
        f"{allreduce['every_micro_batch_over_no_sync']:.2f}x",
        f"{results['simulator']['real_over_simulated']:.0f}x slower",
        f"regression {results['widgets']['regression_explorer']['median_ms']:.0f} /",
        f"median {results['check']['median_ms']:.0f} ms, first call {results['check']['first_call_ms']:.0f} ms",
        f"({results['notebooks']['bare_notebook_s']:.1f} s)",
        f"packed rows GA 2 {results['time_cost']['packed']['over_big_batch']['2']:.2f}x",
        f"one line per row GA 2 {results['time_cost']['one_line_per_row']['over_big_batch']['2']:.2f}x",
        f"load average {results['machine']['load_average']} as it started",
    ]
    assert [e for e in expected if e not in text] == []

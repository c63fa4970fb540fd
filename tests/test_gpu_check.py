"""scripts/gpu_check.sh, the prepared check for a lent GPU, run on the CPU (EXPECT_DEVICE=cpu).

What needs CUDA (the memory comparison) says it was skipped; everything else runs as it would on
the GPU machine: the take-home script in float32, bf16, fp16 and with --cpu, the verifier on it
in float32, and the bench sections with two launched processes.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.real
@pytest.mark.slow
def test_the_gpu_check_runs_its_cpu_side_and_reports_each_part(tmp_path):
    bin_dir = Path(sys.executable).parent  # `python` in the script is this venv's
    env = {**os.environ, "OUT": str(tmp_path), "EXPECT_DEVICE": "cpu", "EPOCHS": "1",
           "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    result = subprocess.run(["bash", "scripts/gpu_check.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    log = (tmp_path / "gpu_check.log").read_text()
    assert "gpu_check: exit 0" in log
    for name in ("gpu_float32", "gpu_bf16", "gpu_fp16", "forced_cpu"):
        assert "training on cpu, 1 process(es)" in (tmp_path / f"run_{name}.txt").read_text(), name
    assert "invariance check passed" in log
    assert json.loads((tmp_path / "memory.json").read_text()) == {"skipped": "no CUDA"}
    bench = json.loads((tmp_path / "bench.json").read_text())
    assert bench["allreduce"]["num_processes"] == 2 and bench["allreduce"]["device"].startswith("cpu")
    assert "bench: all-reduce on cpu" in log
    assert shutil.which("nvidia-smi") or "nvidia-smi: not available" in log

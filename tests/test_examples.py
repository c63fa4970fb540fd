"""The lesson-04 experiment as a script, under the launchers users run on several GPUs or machines."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from accelerate.utils.other import get_free_port

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train_accumulation.py"
BIN = Path(sys.executable).parent
pytestmark = pytest.mark.real


def _run(command):
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    # Each rank writes whole lines, but launcher logs may still land between them: find the JSON records.
    records = sorted((json.loads(match) for match in re.findall(r"\{\"rank\".*?\]\}", result.stdout)),
                     key=lambda r: r["rank"])
    assert len(records) == 2, f"one record per rank expected\n{result.stdout}\n{result.stderr[-3000:]}"
    return records, result.stdout


def _check(records, stdout, expected):
    assert [r["rank"] for r in records] == [0, 1]
    assert all(r["num_processes"] == 2 and r["distributed_type"] == "DistributedType.MULTI_CPU" for r in records)
    assert [r["local_targets"] for r in records] == [[52], [84]]
    assert all(r["total_targets"] == [136] for r in records)
    for record in records:
        assert [round(w, 4) for w in record["final_weights"]] == expected
    assert float(stdout.split("largest difference ")[1].split()[0]) < 1e-6  # rank 0 vs the simulator


def test_torchrun_two_cpu_processes_reproduce_the_seed():
    records, stdout = _run([str(BIN / "torchrun"), "--nproc_per_node", "2", "--master_port", str(get_free_port()),
                            str(SCRIPT)])
    _check(records, stdout, [0.2117, 0.3172])


def test_accelerate_launch_two_cpu_processes_naive():
    records, stdout = _run([str(BIN / "accelerate"), "launch", "--multi_gpu", "--num_processes", "2",
                            "--main_process_port", str(get_free_port()), str(SCRIPT), "--strategy", "mean_of_means"])
    _check(records, stdout, [0.1622, 0.3668])


@pytest.mark.slow
def test_the_readme_multi_node_line_with_two_nodes_on_this_machine():
    # The README's `torchrun --nnodes 2 --node_rank R --rdzv_endpoint HOST:PORT` line, one process per
    # "node", both nodes here on 127.0.0.1: node 0 hosts the rendezvous, node 1 joins it.
    port = get_free_port()
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"}

    def node(rank):
        return subprocess.Popen([str(BIN / "torchrun"), "--nnodes", "2", "--node_rank", str(rank), "--rdzv_endpoint",
                                 f"127.0.0.1:{port}", "--nproc_per_node", "1", str(SCRIPT)],
                                cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    nodes = [node(0), node(1)]
    outputs = []
    try:
        for process in nodes:
            out, err = process.communicate(timeout=180)
            assert process.returncode == 0, err[-3000:]
            outputs.append(out)
    finally:
        for process in nodes:
            process.kill()
    stdout = "".join(outputs)
    records = sorted((json.loads(match) for match in re.findall(r"\{\"rank\".*?\]\}", stdout)),
                     key=lambda r: r["rank"])
    _check(records, outputs[0], [0.2117, 0.3172])

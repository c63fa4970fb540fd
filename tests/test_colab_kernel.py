"""The launching lessons in a kernel that Accelerate takes for Colab's.

`make browser` (part of `make test`) runs them so in JupyterLab and saves their outputs to
build/browser/executed; `make colab` runs them under nbmake into build/colab/run. These tests read
the folder GACCUM_COLAB_EXECUTED names (build/colab/run when it is unset).

On Colab with fewer than 2 GPUs `notebook_launcher` starts no process; the lessons must notice it
(`gaccum_launch.notebook_launcher_forks`) and start real processes with `debug_launcher`,
with the same figures, never a bare assertion.
"""

import importlib.util
import json
import os
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STARTUP = ROOT / "tests" / "colab" / "kernel_startup.py"
EXECUTED = Path(os.environ.get("GACCUM_COLAB_EXECUTED", ROOT / "build" / "colab" / "run"))
LAUNCHING = ("04_many_processes.ipynb", "05_capstone_language_model.ipynb", "06_pitfalls_gallery.ipynb",
             "08_your_real_stack.ipynb", "09_schedulers_across_processes.ipynb", "10_fsdp_and_deepspeed.ipynb",
             "12_capstone_further.ipynb")


@pytest.fixture(autouse=True)
def _deepspeed_entry_kept(monkeypatch):
    """The start-up script hides DeepSpeed in the process that runs it: this process's entry comes back after."""
    monkeypatch.setitem(sys.modules, "deepspeed", sys.modules.get("deepspeed"))
    if sys.modules["deepspeed"] is None:
        del sys.modules["deepspeed"]  # absent before: importable again meanwhile (the fixture deletes it after)


def test_the_startup_script_makes_accelerate_see_colab_and_the_lessons_see_no_fork(monkeypatch):
    from IPython.core.interactiveshell import InteractiveShell

    from gaccum_launch import notebook as hosts

    monkeypatch.delenv("GACCUM_COLAB_LESSONS", raising=False)  # as under `make colab`: every kernel
    shell = InteractiveShell.instance()
    try:
        assert not hosts.in_colab_kernel()
        exec(STARTUP.read_text(), {"get_ipython": lambda: shell})
        assert "google.colab" in str(shell)  # what Accelerate's notebook_launcher reads
        assert importlib.util.find_spec("deepspeed") is None  # Colab has none: what Accelerate asks sees none
        assert hosts.in_colab_kernel() and not hosts.notebook_launcher_forks()  # no GPU here
        monkeypatch.setenv("KAGGLE_KERNEL_RUN_TYPE", "Interactive")  # Accelerate checks Kaggle first
        assert not hosts.in_colab_kernel()
    finally:
        InteractiveShell.clear_instance()


@pytest.mark.parametrize(("session", "colab_like"), [
    ("04_many_processes.ipynb", True), ("sub/folder/10_fsdp_and_deepspeed.ipynb", True),
    ("00_start_here.ipynb", False), (None, False),
])
def test_with_lessons_named_only_their_kernels_become_colab_like(monkeypatch, session, colab_like):
    # How `make browser` uses the script: one IPYTHONDIR for every kernel JupyterLab starts, each
    # kernel told its notebook's path (JPY_SESSION_NAME), the Colab lessons named in GACCUM_COLAB_LESSONS.
    from IPython.core.interactiveshell import InteractiveShell

    monkeypatch.setenv("GACCUM_COLAB_LESSONS", "04_many_processes 10_fsdp_and_deepspeed")
    if session is None:
        monkeypatch.delenv("JPY_SESSION_NAME", raising=False)
    else:
        monkeypatch.setenv("JPY_SESSION_NAME", session)
    shell = InteractiveShell.instance()
    try:
        namespace = {"get_ipython": lambda: shell}
        exec(STARTUP.read_text(), namespace)
        assert ("google.colab" in str(shell)) is colab_like
        assert [k for k in namespace if not k.startswith("__")] == ["get_ipython"]  # leaves no names behind
        assert (importlib.util.find_spec("deepspeed") is None) is colab_like  # Colab has no DeepSpeed
    finally:
        InteractiveShell.clear_instance()


def _outputs(name):
    cells = json.loads((EXECUTED / name).read_text())["cells"]
    return "\n".join("".join(o.get("text", "")) for c in cells if c["cell_type"] == "code" for o in c["outputs"])


@pytest.mark.colab_outputs
@pytest.mark.parametrize("name", LAUNCHING)
def test_no_launching_lesson_trains_in_the_kernel_in_a_colab_kernel(name):
    text = _outputs(name)
    assert "Launching training on one" not in text  # notebook_launcher's in-kernel branch never ran


@pytest.mark.colab_outputs
def test_lesson_04_launches_two_processes_with_launch_from_notebook_and_prints_their_figures():
    # notebook_launcher's in-kernel branch never ran (test above): two ranks' results, the same as under
    # notebook_launcher elsewhere, come from the processes that launch_from_notebook forked.
    text = _outputs("04_many_processes.ipynb")
    assert "rank 0 of 2 (DistributedType.MULTI_CPU): targets (local, total) per update [(52, 136), (74, 164)], " \
        "weights [0.4773, 0.0516]" in text
    assert "rank 1 of 2 (DistributedType.MULTI_CPU): targets (local, total) per update [(84, 136), (90, 164)], " \
        "weights [0.4773, 0.0516]" in text


@pytest.mark.colab_outputs
def test_lesson_05_and_06_in_a_colab_kernel():
    assert "accelerate (DistributedType.MULTI_CPU, 2 process(es))" in _outputs("05_capstone_language_model.ipynb")
    gallery = _outputs("06_pitfalls_gallery.ipynb")
    assert "notebook_launcher starts no process in this kernel: nothing to show here" in gallery
    assert "gaccum_lib.launch after a reset: [0.2117, 0.3172]" in gallery
    # pitfalls 18 and 19 launch with gaccum_lib.launch, which forks in a Colab kernel too
    assert "read ahead                  the weights moved after micro-batches [3, 4, 5, 6, 7]" in gallery
    assert "evaluation left early            updates at (epoch, micro-batch) [(0, 3), (0, 7), (1, 1), (1, 5), " \
        "(1, 9)]" in gallery


@pytest.mark.colab_outputs
def test_lesson_12_launches_two_processes_in_a_colab_kernel():
    further = _outputs("12_capstone_further.ipynb")
    assert "first update (same weights for all): full batch 4.17589, naive 4.17795, token-normalised 4.17589" in further
    assert "targets per update in the first epoch: full batch [897, 126] {'pad': [897, 126], 'repeat': [897, 210]}" \
        in further


@pytest.mark.colab_outputs
def test_lessons_08_and_09_launch_two_processes_in_a_colab_kernel():
    stack = _outputs("08_your_real_stack.ipynb")
    # The distance is float32 rounding: the same code printed 1.7e-07 on earlier machines and 2.1e-07 on this
    # session's. The counts must match exactly, the distance only stay at rounding level.
    line = re.search(r"2 processes, GA 4 x 2 rows      vs 1 process, full batch: (\S+)   counts \[278, 409\]", stack)
    assert line is not None and float(line.group(1)) < 1e-6
    schedulers = _outputs("09_schedulers_across_processes.ipynb")
    assert "2 processes  12 batches per rank, scheduler steps after each update: [2, 4, 6]" in schedulers
    assert "all-reduces after each update: default [1, 2, 3], sync_each_batch [4, 8, 12]" in schedulers


@pytest.mark.colab_outputs
def test_lesson_10_runs_fsdp_on_two_processes_and_skips_deepspeed_in_a_colab_kernel_without_it():
    # The stand-in kernel hides DeepSpeed, as Colab has none: its part says how to install it, the rest runs.
    sharded = _outputs("10_fsdp_and_deepspeed.ipynb")
    assert "collectives per update {'all-gather': 24, 'reduce-scatter': 3}" in sharded
    assert "gradient elements held after each backward of the first window [369, 369, 369, 193]" in sharded
    assert 'DeepSpeed is not installed, so this part defines its loops but runs none of them. To run them: ' \
        'pip install "gaccum_lib[deepspeed]"' in sharded
    assert "accumulate()'s sync_gradients" not in sharded
    assert "no answer yet: set the variable above" in sharded  # the lesson ran on past DeepSpeed's part, to its end


_KERNEL_THAT_LAUNCHES = """
import sys
from pathlib import Path

import torch

from gaccum_launch import notebook as hosts

out_dir = sys.argv[1]


def rank_and_threads():
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    total = accelerator.reduce(torch.tensor([accelerator.process_index + 1.0]), reduction="sum")
    torch.log_softmax(torch.randn(256, 4096), -1)  # an OpenMP kernel: a forked rank with 2 threads hangs here
    Path(out_dir, f"rank{accelerator.process_index}").write_text(
        f"{accelerator.num_processes} {torch.get_num_threads()} {total.item()}")


hosts.in_colab_kernel = lambda: True  # what a Colab kernel answers
torch.set_num_threads(2)  # a kernel's pool of 2 threads, used before the fork
torch.log_softmax(torch.randn(256, 4096), -1)
hosts.launch_from_notebook(rank_and_threads, num_processes=2)
print("kernel threads after the launch:", torch.get_num_threads())
"""


@pytest.mark.real
def test_launch_from_notebook_forks_with_debug_launcher_where_notebook_launcher_would_not(tmp_path):
    import signal
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # as in a kernel: the variable unset
    kernel = subprocess.Popen([sys.executable, "-c", _KERNEL_THAT_LAUNCHES, str(tmp_path)], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = kernel.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(kernel.pid, signal.SIGKILL)  # the kernel and the ranks it forked
        pytest.fail("the launch hung: a forked rank's OpenMP team waits for threads that do not exist")
    assert kernel.returncode == 0, stderr[-2000:]
    assert "kernel threads after the launch: 2" in stdout  # the kernel's count is given back
    # two ranks that saw each other (1 + 2 = 3), each with one thread
    assert sorted(p.read_text() for p in tmp_path.iterdir()) == ["2 1 3.0", "2 1 3.0"]


def test_launch_from_notebook_names_a_bad_process_count():
    from gaccum_launch import launch_from_notebook

    with pytest.raises(ValueError, match="num_processes"):
        launch_from_notebook(print, num_processes=0)


@pytest.mark.parametrize(("widgets", "turned_on"), [("8.1.9", True), ("7.7.1", False)])
def test_the_install_cell_turns_on_colabs_widget_manager_only_for_ipywidgets_8(monkeypatch, widgets, turned_on):
    # Colab's frontend shows ipywidgets 8's widgets only once its custom widget manager is on; 7.7.1 (what
    # Colab ships) needs nothing. A stand-in google.colab records the call; the suite is installed here.
    import importlib.machinery
    import importlib.metadata
    import types

    import gaccum_lib  # noqa: F401 -- imported before the stand-in exists, as the cell finds it on Colab

    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from install_cell import INSTALL_CELL
    finally:
        sys.path.pop(0)
    calls = []
    colab = types.ModuleType("google.colab")
    colab.__spec__ = importlib.machinery.ModuleSpec("google.colab", None)
    colab.output = types.SimpleNamespace(enable_custom_widget_manager=lambda: calls.append("on"))
    monkeypatch.setitem(sys.modules, "google", types.ModuleType("google"))
    monkeypatch.setitem(sys.modules, "google.colab", colab)
    real_version = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version",
                        lambda name: widgets if name == "ipywidgets" else real_version(name))
    exec(compile(INSTALL_CELL, "install cell", "exec"), {})
    assert calls == (["on"] if turned_on else [])

"""What Accelerate does around a launch from a notebook, as lesson 04 and gaccum_launch rely on it.

Lesson 04 states these as behaviour and keeps library source out of its cells; here a new
Accelerate that changes one of them fails a test instead of a learner's run:

* ``notebook_launcher`` in a kernel that looks like Colab's, below 2 GPUs, starts no process: it
  says so and runs the function once, in the kernel (why the lesson falls back to
  ``gaccum_launch.launch_from_notebook`` there), and returns nothing;
* ``notebook_launcher`` refuses to start while the kernel holds an Accelerator (why the launched
  function creates its own);
* ``accelerator.backward`` divides the loss by GA on every call, however many micro-batches the
  window has (why ``x GA`` stays right in a short last window);
* a CPU process that joins a process group with ``OMP_NUM_THREADS`` unset gets the machine's
  physical cores divided by the local processes (why ``launch_from_notebook`` sets one thread for
  ``debug_launcher``'s ranks, whose local world looks like 1 process).
"""

import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def no_accelerate_state():
    from gaccum_launch import reset_accelerate_state

    reset_accelerate_state(quiet=True)
    yield
    reset_accelerate_state(quiet=True)


def test_notebook_launcher_in_a_colab_kernel_runs_the_function_once_here_and_returns_nothing(
        monkeypatch, capsys, no_accelerate_state):
    import IPython
    import torch
    from accelerate import notebook_launcher

    if torch.cuda.device_count() >= 2:
        pytest.skip("with 2 GPUs notebook_launcher forks on Colab too")
    for key in [k for k in os.environ if k.startswith("KAGGLE")]:
        monkeypatch.delenv(key)  # Accelerate takes a Kaggle kernel first
    monkeypatch.setattr(IPython, "get_ipython", lambda: "<google.colab._shell.Shell object>")
    calls = []

    def function(value):
        calls.append((os.getpid(), value))
        return value

    assert notebook_launcher(function, (42,), num_processes=2) is None
    assert calls == [(os.getpid(), 42)]  # once, in this process
    assert capsys.readouterr().out.startswith("Launching training on one")  # "... one CPU." or "... one GPU."


def test_notebook_launcher_refuses_to_start_while_the_kernel_holds_an_accelerator(monkeypatch, no_accelerate_state):
    from accelerate import Accelerator, notebook_launcher

    import gaccum_launch

    if gaccum_launch.in_colab_kernel():
        pytest.skip("a Colab-like kernel takes the in-kernel branch")
    Accelerator(cpu=True)
    with pytest.raises(ValueError, match="should only be initialized inside your training function"):
        notebook_launcher(print, num_processes=2)


def test_accelerator_backward_divides_by_ga_on_every_call(no_accelerate_state):
    import torch
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=4)
    weight = torch.nn.Parameter(torch.tensor([3.0]))
    accelerator.backward((weight * 2.0).sum())  # a window of one micro-batch: still divided by 4
    assert weight.grad.tolist() == [0.5]


def test_accelerate_source_gives_cpu_processes_the_physical_cores_over_the_local_processes():
    # The rule behind the behaviour test below, as Accelerate writes it.
    from accelerate.state import PartialState

    source = " ".join(inspect.getsource(PartialState.__init__).split())
    assert 'get_int_from_env(["OMP_NUM_THREADS"], 0) == 0' in source
    assert "psutil.cpu_count(logical=False) / dist_information.local_world_size" in source


_RANK = """
import torch
from accelerate import PartialState

state = PartialState(cpu=True)
print(state.distributed_type.value, torch.get_num_threads())
"""


@pytest.mark.real
@pytest.mark.parametrize("local_world_size", [None, 2])
def test_a_cpu_rank_without_omp_num_threads_gets_the_physical_cores_over_its_local_processes(local_world_size):
    # (With OMP_NUM_THREADS set Accelerate leaves the count alone: test_colab_kernel's launch_from_notebook test.)
    import psutil
    from accelerate.utils.other import get_free_port

    physical = psutil.cpu_count(logical=False)
    if not physical:
        pytest.skip("psutil cannot count the physical cores here")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "LOCAL_WORLD_SIZE")}
    # One rank of a group of one; without LOCAL_WORLD_SIZE, as debug_launcher's ranks join theirs.
    env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(get_free_port()),
               GLOO_SOCKET_IFNAME="lo")
    if local_world_size is not None:
        env["LOCAL_WORLD_SIZE"] = str(local_world_size)
    done = subprocess.run([sys.executable, "-c", _RANK], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    distributed_type, threads = done.stdout.split()
    assert distributed_type == "MULTI_CPU"
    assert int(threads) == max(1, physical // (local_world_size or 1))

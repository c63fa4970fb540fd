"""The launcher in the hands of a room of learners: every fault here was reproduced, then fixed.

Each test provokes one fault for real (processes that crash, hang, get killed or interrupted,
ports that are taken) and asserts what the notebook sees: the right numbers, or a
``LaunchError`` / ``KeyboardInterrupt`` that says what happened and to which rank -- in
bounded time, with no process left behind. Everything that could hang runs under a timeout:
a subprocess with ``timeout=`` or ``launch(..., timeout=...)``, so a regression fails the
test instead of hanging the suite. Time bounds are generous (a loaded 2-core machine).
"""

import contextlib
import importlib
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import psutil
import pytest
import torch

from gaccum_launch import choose_device, cpu_process_limit
from gaccum_lib import LaunchError, launch, real_run, reset_accelerate_state, seed_sequences

launch_module = importlib.import_module("gaccum_launch.processes")

pytestmark = pytest.mark.real
PRINTED = 5e-5
SEED_WEIGHTS = [0.2117, 0.3172]  # the seed's 2-process token-normalised result (test_real_runs)
SEED_COUNTS = [[52, 84]]


def _seed_run(**kwargs):
    return real_run(seed_sequences(16), "token_normalised", grad_accum_steps=2, micro_batch_size=4,
                    num_processes=2, **kwargs)


def _assert_seed_numbers(run):
    assert "MULTI_CPU" in run.source  # two processes that saw each other
    np.testing.assert_allclose(run.final_weights, SEED_WEIGHTS, atol=PRINTED)
    assert run.token_counts.tolist() == SEED_COUNTS


GUARD_SECONDS = 240  # no test here comes near; past it the guard below ends the test's processes


def _children() -> set:
    """This test process's descendants (zombies included), as (pid, start time) pairs."""
    found = set()
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            found.add((child.pid, child.create_time()))
    return found


@pytest.fixture(autouse=True)
def guarded():
    """Every test: leaves no process behind, not even a zombie, and cannot hang.

    A regression that makes a launch hang would hang the suite (no pytest-timeout here): after
    GUARD_SECONDS this kills the processes the test started, which makes the launch return, and
    fails the test.
    """
    before = _children()
    fired = threading.Event()

    def kill_new_children():
        fired.set()
        for child in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if (child.pid, child.create_time()) not in before:
                    child.kill()

    timer = threading.Timer(GUARD_SECONDS, kill_new_children)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
    assert not fired.is_set(), f"the test ran past {GUARD_SECONDS} s: its processes were killed"
    assert _children() <= before, "the test left processes behind"


# ----------------------------------------------------------------------------------------------
# Functions the launched processes run (module level: a forked child finds them as they are).


def _rank_and_world():
    from accelerate import Accelerator

    accelerator = Accelerator()
    return accelerator.process_index, accelerator.num_processes


def _rank_one_fails_while_rank_zero_gathers():
    from accelerate import Accelerator

    accelerator = Accelerator()
    if accelerator.process_index == 1:
        raise RuntimeError("rank one breaks before the gather")
    return accelerator.gather(torch.tensor([1.0])).tolist()  # waits for rank 1, which never comes


def _rank_one_fails_before_its_accelerator_exists():
    if int(os.environ["RANK"]) == 1:
        raise RuntimeError("rank one breaks before creating its Accelerator")
    from accelerate import Accelerator

    Accelerator().wait_for_everyone()  # rank 0 waits here for a peer that never arrives (in C++: deaf to SIGTERM)
    return "unreachable"


def _rank_one_is_killed():
    from accelerate import Accelerator

    accelerator = Accelerator()
    if accelerator.process_index == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return accelerator.gather(torch.tensor([1.0])).tolist()


def _rank_one_returns_a_lambda():
    from accelerate import Accelerator

    accelerator = Accelerator()
    return (lambda: "cannot be pickled") if accelerator.process_index == 1 else "fine"


def _rank_one_never_joins_the_gather():
    from accelerate import Accelerator

    accelerator = Accelerator()
    if accelerator.process_index == 1:
        time.sleep(600)
    return accelerator.gather(torch.tensor([1.0])).tolist()


def _rank_one_never_returns():
    from accelerate import Accelerator

    accelerator = Accelerator()
    if accelerator.process_index == 1:
        time.sleep(600)
    return "done"


# ----------------------------------------------------------------------------------------------
# Subprocesses: a launching process we can interrupt, kill, or run beside another one.

PYTHON = sys.executable

# Launches two processes that never finish: rank 0 waits in a collective rank 1 never joins,
# rank 1 sleeps. Each writes its pid into the folder given as argv[1] once it runs. With
# argv[2] == "shielded" they ignore SIGINT, as code that protects itself from Ctrl-C does.
STUCK_LAUNCH = textwrap.dedent("""
    import os, signal, sys, time
    from gaccum_lib import launch

    # Ctrl-C raises KeyboardInterrupt here as in a terminal, even where the test runner ignores SIGINT and
    # so this process inherited that (a job a non-interactive shell started with & ignores it)
    signal.signal(signal.SIGINT, signal.default_int_handler)

    def stuck():
        if sys.argv[2] == "shielded":
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        from accelerate import Accelerator
        accelerator = Accelerator()
        path = os.path.join(sys.argv[1], f"rank{accelerator.process_index}")
        with open(path + ".tmp", "w") as file:
            file.write(str(os.getpid()))
        os.rename(path + ".tmp", path)
        if accelerator.process_index == 0:
            accelerator.wait_for_everyone()
        time.sleep(600)

    try:
        launch(stuck, num_processes=2, quiet=True, timeout=300)
    except KeyboardInterrupt as exc:
        print("KeyboardInterrupt:", exc, flush=True)
        print("SIGINT handler restored:", signal.getsignal(signal.SIGINT) is signal.default_int_handler, flush=True)
        sys.exit(42)
    print("the launch returned", flush=True)
""")

SEED_LAUNCH = textwrap.dedent("""
    import json
    from gaccum_lib import real_run, seed_sequences

    run = real_run(seed_sequences(16), "token_normalised", grad_accum_steps=2, micro_batch_size=4, num_processes=2)
    print("RESULT", json.dumps({"weights": run.final_weights.tolist(), "counts": run.token_counts.tolist(),
                                "source": run.source}), flush=True)
""")

# Failed launches whose errors nobody keeps, then a good one. Under notebook_launcher each failed
# launch left its rendezvous store (a TCPStore server) as garbage in the kernel; a later launch's
# children inherited it, collected it, and waited forever in its destructor: the third launch hung.
# The file rendezvous leaves no server behind, and the ranks never collect the kernel's garbage.
FAILURES_THEN_SEED = textwrap.dedent("""
    import sys
    from gaccum_lib import LaunchError, launch, real_run, seed_sequences

    def fails_on_both_ranks():
        import torch
        from accelerate import Accelerator
        accelerator = Accelerator()
        model = accelerator.prepare(torch.nn.Linear(1, 2, bias=False))
        return model.weight.tolist()  # the model is wrapped in DDP: AttributeError

    for attempt in range(5):
        try:
            launch(fails_on_both_ranks, num_processes=2, quiet=True, timeout=40)
        except LaunchError as failure:
            first_line = str(failure).splitlines()[0]
        print(attempt, first_line, flush=True)
        if "AttributeError" not in first_line:
            sys.exit(1)
    run = real_run(seed_sequences(16), "token_normalised", grad_accum_steps=2, micro_batch_size=4, num_processes=2)
    print("weights", run.final_weights.tolist(), "counts", run.token_counts.tolist(), flush=True)
""")

# The kernel ran a multi-threaded op before launching: its OpenMP pool does not survive the fork.
THREADS_THEN_LAUNCH = textwrap.dedent("""
    import torch

    torch.set_num_threads(2)
    logits = torch.randn(400, 10)
    torch.nn.functional.cross_entropy(logits, torch.zeros(400, dtype=torch.long))

    from gaccum_lib import launch

    def parallel_op():
        import torch
        from accelerate import Accelerator
        Accelerator()
        x = torch.randn(400, 10)
        return float(torch.nn.functional.cross_entropy(x, torch.zeros(400, dtype=torch.long))) > 0

    print("results:", launch(parallel_op, num_processes=2, quiet=True, timeout=90), flush=True)
""")


@contextlib.contextmanager
def _subprocess(script, *args, env=None):
    """A Python running ``script``, in its own session; killed with everything it started on the way out.

    Yields the Popen and a list to which the test adds processes to kill as well (ranks orphaned
    when the launching process is gone are no longer its descendants).
    """
    proc = subprocess.Popen([PYTHON, "-c", script, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True, env=env)
    extra = []
    try:
        yield proc, extra
    finally:
        family = []
        if proc.poll() is None:  # still ours: its pid cannot have been reused
            with contextlib.suppress(psutil.Error):
                family = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        for member in family + extra:  # psutil checks the start time: never a recycled pid
            with contextlib.suppress(psutil.Error):
                member.kill()
        proc.kill()
        proc.wait(timeout=60)
        proc.stdout.close()


def _wait_for_stuck_ranks(proc, folder, extra, limit=120.0):
    """The two launched processes of STUCK_LAUNCH, once both run (as psutil processes, also put in extra)."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        paths = [folder / f"rank{rank}" for rank in range(2)]
        if all(path.exists() for path in paths):
            extra.extend(psutil.Process(int(path.read_text())) for path in paths)
            return list(extra)
        if proc.poll() is not None:
            pytest.fail(f"the launching process ended early:\n{proc.stdout.read()}")
        time.sleep(0.1)
    pytest.fail(f"the launched processes did not start within {limit} s")


def _gone(process: psutil.Process) -> bool:
    """Whether a process has ended (a zombie waiting for a reaper has ended too)."""
    try:
        return not process.is_running() or process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _all_gone(processes, within=30.0) -> bool:
    deadline = time.monotonic() + within
    while not all(_gone(p) for p in processes):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


# ----------------------------------------------------------------------------------------------
# 1. The launcher run twice in a kernel, and after other code created an Accelerator in it


def test_twice_in_a_kernel_and_after_an_accelerator_in_the_parent_gives_the_seed_numbers():
    from accelerate import Accelerator

    _assert_seed_numbers(_seed_run())
    Accelerator(cpu=True, gradient_accumulation_steps=4)  # an earlier cell, with other settings
    _assert_seed_numbers(_seed_run())
    _assert_seed_numbers(_seed_run(sync_mode="accumulate"))  # uses Accelerate's own accumulation state
    _assert_seed_numbers(_seed_run())
    # And the kernel is left clean: a new Accelerator there is an ordinary single process.
    accelerator = Accelerator(cpu=True)
    assert (accelerator.num_processes, accelerator.process_index) == (1, 0)
    assert reset_accelerate_state(quiet=True) is True


def test_launches_after_failed_launches_in_the_same_kernel_do_not_hang():
    with _subprocess(FAILURES_THEN_SEED) as (proc, _):
        out, _ = proc.communicate(timeout=200)
    assert proc.returncode == 0, out
    lines = [line for line in out.splitlines() if line[:1].isdigit()]
    assert [line.split(" ", 1)[1][:40] for line in lines] == ["rank 0 of 2 failed with AttributeError: "] * 5
    weights = json.loads(out.split("weights ", 1)[1].split(" counts")[0])
    np.testing.assert_allclose(weights, SEED_WEIGHTS, atol=PRINTED)
    assert "counts [[52, 84]]" in out


def test_a_function_using_the_kernels_accelerator_is_told_to_create_its_own():
    from accelerate import Accelerator

    kernel_accelerator = Accelerator(cpu=True)

    def uses_the_kernels_accelerator():
        return kernel_accelerator.num_processes  # the state was reset by the launch: no silent 1

    with pytest.raises(LaunchError, match=r"rank 0 of 2 failed with AttributeError") as info:
        launch(uses_the_kernels_accelerator, num_processes=2, quiet=True)
    assert "Create the Accelerator inside the launched function" in str(info.value)


def test_a_process_group_in_the_kernel_is_refused_with_what_to_do(tmp_path):
    store = torch.distributed.FileStore(str(tmp_path / "store"), 1)
    torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        # Without the check the forked children inherit the group and wait forever.
        with pytest.raises(LaunchError, match=r"already initialised .*destroy_process_group\(\)"):
            launch(_rank_and_world, num_processes=2, quiet=True)
    finally:
        torch.distributed.destroy_process_group()
    assert launch(_rank_and_world, num_processes=2, quiet=True) == [(0, 2), (1, 2)]


def test_a_launch_leaves_the_signal_handlers_and_the_environment_as_they_were():
    names = ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT")
    handlers = {name: signal.getsignal(getattr(signal, name)) for name in names}
    import torch._dynamo  # noqa: F401 - the launch imports it once; importing it sets TORCHINDUCTOR_CACHE_DIR (torch's doing)

    environment = dict(os.environ)
    assert launch(_rank_and_world, num_processes=2, quiet=True) == [(0, 2), (1, 2)]
    # The ranks set their variables (RANK, ACCELERATE_USE_CPU, ...) after the fork, in themselves; under
    # notebook_launcher, torchelastic replaced these handlers and left TORCHELASTIC_SIGNALS_TO_HANDLE behind.
    assert {name: signal.getsignal(getattr(signal, name)) for name in names} == handlers
    assert dict(os.environ) == environment


def test_one_launch_at_a_time_in_a_process():
    def launches_again():
        return launch(_rank_and_world, num_processes=2, quiet=True)

    with pytest.raises(LaunchError, match="rank 0 of 1 failed with LaunchError: another launch is still running"):
        launch(launches_again, num_processes=1, quiet=True)
    assert launch(_rank_and_world, num_processes=2, quiet=True) == [(0, 2), (1, 2)]


# ----------------------------------------------------------------------------------------------
# 2. Multi-threaded torch ops in the parent before the launch


def test_multithreaded_torch_in_the_kernel_does_not_hang_the_children():
    # A regression (no torch.set_num_threads(1) in the child) hangs the children's first
    # parallel op; launch's timeout and the subprocess timeout turn that into a failure.
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    with _subprocess(THREADS_THEN_LAUNCH, env=env) as (proc, _):
        out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 0, out
    assert "results: [True, True]" in out


# ----------------------------------------------------------------------------------------------
# 3. Ports: the default one taken, one taken between choosing and binding, two launches at once


def _listening_ports_of_the_launcher():
    from accelerate import Accelerator

    Accelerator()  # the process group a training function would make
    launcher = psutil.Process(os.getppid())
    return sorted({c.laddr.port for c in launcher.net_connections("tcp") if c.status == psutil.CONN_LISTEN})


def test_the_ranks_meet_through_a_file_so_no_port_can_be_taken():
    # The rendezvous is a file in the launch's own folder, as in Accelerate's debug_launcher: the launching
    # process opens no port (so none can be taken by another program or a parallel launch) and runs no
    # store thread that a forked rank could inherit mid-call (the old TCP store's resolver-lock hang).
    with socket.socket() as default_port:
        with contextlib.suppress(OSError):  # someone else holds 29500: just as taken
            default_port.bind(("127.0.0.1", 29500))
            default_port.listen()
        before = {c.laddr.port for c in psutil.Process().net_connections("tcp") if c.status == psutil.CONN_LISTEN}
        seen_by_ranks = launch(_listening_ports_of_the_launcher, num_processes=2, quiet=True)
    assert seen_by_ranks[0] == seen_by_ranks[1] == sorted(before)


def test_two_launches_at_once_with_the_default_port_taken():
    blocker = socket.socket()
    try:
        try:
            blocker.bind(("127.0.0.1", 29500))
            blocker.listen()
        except OSError:
            pass  # someone else holds 29500: just as taken
        with _subprocess(SEED_LAUNCH) as (first, _), _subprocess(SEED_LAUNCH) as (second, _):
            procs = [first, second]  # both launch at the same moment
            outputs = [proc.communicate(timeout=240)[0] for proc in procs]
    finally:
        blocker.close()
    for proc, out in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, out
        result = json.loads(out.split("RESULT ", 1)[1])
        assert "MULTI_CPU" in result["source"]
        np.testing.assert_allclose(result["weights"], SEED_WEIGHTS, atol=PRINTED)
        assert result["counts"] == SEED_COUNTS


# ----------------------------------------------------------------------------------------------
# 4. A child that fails while the other rank waits in a collective


def test_a_rank_failing_while_the_other_waits_in_a_gather():
    start = time.monotonic()
    with pytest.raises(LaunchError, match=r"^rank 1 of 2 failed with RuntimeError: rank one breaks") as info:
        launch(_rank_one_fails_while_rank_zero_gathers, num_processes=2, quiet=True)
    assert time.monotonic() - start < 60
    message = str(info.value)
    assert "traceback of rank 1" in message and "_rank_one_fails_while_rank_zero_gathers" in message
    # Rank 0 lost its peer: reported below, not blamed.
    assert "the other ranks:\n  rank 0:" in message
    _assert_seed_numbers(_seed_run())  # and the next launch in this process is fine


def test_a_rank_failing_before_its_accelerator_exists_ends_in_seconds():
    # Rank 0 waits in a barrier, deaf to SIGTERM, for a peer that is gone; gloo's own timeout is 30 min.
    start = time.monotonic()
    with pytest.raises(LaunchError, match=r"^rank 1 of 2 failed with RuntimeError: rank one breaks before"):
        launch(_rank_one_fails_before_its_accelerator_exists, num_processes=2, quiet=True)
    assert time.monotonic() - start < 25


# ----------------------------------------------------------------------------------------------
# 5-6. Interrupted, terminated or killed launching process: no process survives


@pytest.mark.parametrize(("target", "children"), [
    ("launching process", "plain"),
    ("process group", "plain"),  # Ctrl-C in a terminal, Jupyter's stop button: every process gets SIGINT
    ("process group", "shielded"),  # ranks that ignore SIGINT are killed after a grace period
])
def test_an_interrupted_launch_stops_every_process_and_raises_keyboard_interrupt(tmp_path, target, children):
    with _subprocess(STUCK_LAUNCH, str(tmp_path), children) as (proc, extra):
        ranks = _wait_for_stuck_ranks(proc, tmp_path, extra)
        start = time.monotonic()
        if target == "process group":
            os.killpg(proc.pid, signal.SIGINT)
        else:
            os.kill(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
        elapsed = time.monotonic() - start
        still_running = [rank.pid for rank in ranks if not _gone(rank)]
    assert proc.returncode == 42, out
    assert "KeyboardInterrupt: launch of 2 processes interrupted; its processes were stopped" in out
    assert "SIGINT handler restored: True" in out
    assert elapsed < 45
    assert still_running == []  # gone before the launching process returned


def test_sigterm_to_the_launching_process_ends_it_and_its_processes(tmp_path):
    with _subprocess(STUCK_LAUNCH, str(tmp_path), "plain") as (proc, extra):
        ranks = _wait_for_stuck_ranks(proc, tmp_path, extra)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        # SIGTERM's default action ends the launching process at once; its ranks follow through
        # PR_SET_PDEATHSIG, which the kernel delivers as the parent exits: a moment later, not before
        # communicate() returns (a busy CI machine once saw one rank still running at that instant).
        all_gone = _all_gone(ranks, within=10)
    # Ended by SIGTERM as it would have been without a launch, and no process survives it.
    assert proc.returncode == -signal.SIGTERM, out
    assert all_gone, [rank.pid for rank in ranks if not _gone(rank)]


@pytest.mark.parametrize("children", ["plain", "shielded"])
def test_killing_the_launching_process_takes_its_processes_with_it(tmp_path, children):
    # torch's own fork helper asks for SIGINT when the parent dies, which "shielded" code ignores;
    # launch asks for SIGKILL instead.
    with _subprocess(STUCK_LAUNCH, str(tmp_path), children) as (proc, extra):
        ranks = _wait_for_stuck_ranks(proc, tmp_path, extra)
        proc.kill()  # SIGKILL: the launcher gets no chance to clean up
        proc.wait(timeout=60)
        all_gone = _all_gone(ranks, within=30)
    assert proc.returncode == -signal.SIGKILL
    assert all_gone


# ----------------------------------------------------------------------------------------------
# 7. More processes than make sense


def test_too_many_cpu_processes_are_refused_before_anything_starts():
    limit = cpu_process_limit()
    with pytest.raises(ValueError, match=rf"num_processes={limit + 1} is more than makes sense on \d+ CPU cores; "
                                         rf"use num_processes in \[1, {limit}\]"):
        launch(_rank_and_world, num_processes=limit + 1, device="cpu")


def test_gpu_requests_beyond_the_machine_say_what_exists(monkeypatch):
    monkeypatch.setattr(launch_module, "gpu_count", lambda: 2)
    with pytest.raises(ValueError, match=r"num_processes=3 GPUs requested but this machine has 2; "
                                         r"use num_processes in \[1, 2\] or device='cpu'"):
        choose_device(3, "gpu")
    assert choose_device(3, "auto") == "cpu"  # auto falls back to CPU processes
    monkeypatch.setattr(launch_module, "gpu_count", lambda: 0)
    with pytest.raises(ValueError, match=r"GPUs requested but this machine has 0 \(torch sees no CUDA device\); "
                                         r"use device='cpu'"):
        launch(_rank_and_world, num_processes=2, device="gpu")


def test_a_gpu_launch_from_a_kernel_that_used_cuda_says_to_restart(monkeypatch):
    monkeypatch.setattr(launch_module, "choose_device", lambda num_processes, device: "gpu")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(LaunchError, match="already used CUDA.*restart the kernel"):
        launch(_rank_and_world, num_processes=2, device="gpu")


# ----------------------------------------------------------------------------------------------
# 8. A result that cannot be sent back; a child killed by a signal


def test_a_result_that_cannot_be_sent_back_names_the_rank():
    with pytest.raises(LaunchError, match=r"^rank 1 of 2 failed with LaunchError: rank 1 returned a function that "
                                          r"cannot be sent back .*return tensors, numbers"):
        launch(_rank_one_returns_a_lambda, num_processes=2, quiet=True)


def test_a_rank_killed_by_a_signal_is_named():
    start = time.monotonic()
    with pytest.raises(LaunchError, match=r"^rank 1 of 2 ended without returning a result") as info:
        launch(_rank_one_is_killed, num_processes=2, quiet=True)
    assert time.monotonic() - start < 60
    assert "out-of-memory killer" in str(info.value)


# ----------------------------------------------------------------------------------------------
# 9. Bounded time: a launch whose processes hang


def test_a_hanging_launch_is_stopped_after_its_timeout():
    start = time.monotonic()
    with pytest.raises(LaunchError, match=r"^the launch did not finish within 5 s: ranks \[0, 1\] of 2 had not "
                                          r"returned, so all its processes were stopped"):
        launch(_rank_one_never_joins_the_gather, num_processes=2, quiet=True, timeout=5)
    assert time.monotonic() - start < 60


@pytest.mark.slow
def test_the_timeout_names_only_the_ranks_that_had_not_finished():
    # Rank 0 is done within a second or two; 10 s leaves a wide margin on a loaded machine.
    with pytest.raises(LaunchError, match=r"within 10 s: ranks \[1\] of 2 had not returned \(ranks \[0\] had\)"):
        launch(_rank_one_never_returns, num_processes=2, quiet=True, timeout=10)


@pytest.mark.parametrize(("timeout", "error", "message"), [
    (0, ValueError, r"timeout must be in \(0.0, inf\), got 0.0"),
    (-1.0, ValueError, r"timeout must be in \(0.0, inf\), got -1.0"),
    ("60", TypeError, "timeout must be a number, got str"),
])
def test_the_timeout_is_checked(timeout, error, message):
    with pytest.raises(error, match=message):
        launch(_rank_and_world, num_processes=2, timeout=timeout)


# ---------------------------------------------------------------------------------------------
# gloo's rendezvous failing (CI saw "Gloo connectFullMesh failed ... Connection closed by peer" once)


def _init_failing_until(markers, real_init):
    def init(backend, *, store, rank, world_size):
        marker = markers / f"failed{rank}"
        if not marker.exists():  # each rank fails its first rendezvous once, as a lost connection does
            marker.touch()
            raise RuntimeError("Gloo connectFullMesh failed with Connection closed by peer (simulated)")
        return real_init(backend, store=store, rank=rank, world_size=world_size)
    return init


def test_a_launch_whose_processes_could_not_connect_starts_again_once_and_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.distributed, "init_process_group",
                        _init_failing_until(tmp_path, torch.distributed.init_process_group))
    with pytest.warns(RuntimeWarning, match="the 2 processes could not connect .*connectFullMesh.*launching them"):
        assert launch(_rank_and_world, num_processes=2, quiet=True) == [(0, 2), (1, 2)]
    assert sorted(m.name for m in tmp_path.iterdir()) == ["failed0", "failed1"]


def test_a_rendezvous_that_keeps_failing_is_reported_after_one_retry(monkeypatch):
    def never_connects(backend, *, store, rank, world_size):
        raise RuntimeError("Gloo connectFullMesh failed (simulated, every time)")

    monkeypatch.setattr(torch.distributed, "init_process_group", never_connects)
    failure = r"rank 0 of 2 failed with RuntimeError: Gloo connectFullMesh failed \(simulated"
    with pytest.warns(RuntimeWarning, match="launching them again"), pytest.raises(LaunchError, match=failure):
        launch(_rank_and_world, num_processes=2, quiet=True, timeout=60)


def test_a_failure_inside_the_function_is_never_launched_again(tmp_path):
    with pytest.raises(LaunchError, match="failed with RuntimeError"):
        launch(_count_runs_then_fail, (str(tmp_path),), num_processes=2, quiet=True, timeout=60)
    assert sorted(m.name for m in tmp_path.iterdir()) == ["ran0", "ran1"]  # once each: no second launch


def _count_runs_then_fail(folder):
    import pathlib

    rank = int(os.environ["RANK"])
    with open(pathlib.Path(folder) / f"ran{rank}", "x"):  # "x": a second run of this rank would fail differently
        pass
    raise RuntimeError("Gloo connectFullMesh failed inside the user's function (simulated)")

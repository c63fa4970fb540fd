"""Run a function in N real processes with Accelerate's ``notebook_launcher`` and get its results back.

``notebook_launcher`` forks the processes, sets up ``torch.distributed`` (gloo on CPU,
NCCL on GPUs) and returns nothing. :func:`launch` wraps it so that a notebook cell can
simply write ``results = launch(train, args, num_processes=2)`` and

* gets every rank's return value, in rank order;
* runs on GPUs when there are enough of them, otherwise on CPU processes talking over
  gloo -- setting ``ACCELERATE_USE_CPU=1`` for the children, without which every child
  would silently train on its own;
* uses a free port, so two notebooks (or ``pytest -n 2``) can launch at once;
* starts from a clean Accelerate state even if an ``Accelerator`` was created earlier in
  the kernel (otherwise ``notebook_launcher`` refuses, or the children inherit the stale
  single-process state and compute wrong numbers);
* turns a crash in any child into a :class:`LaunchError` that names the rank and carries
  its traceback;
* checks that the children really ran as ``num_processes`` processes.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import tempfile
import traceback
from pathlib import Path

import torch

from ._checks import check_choice, check_int


class LaunchError(RuntimeError):
    """A launched process failed; the message names the rank and includes its traceback."""


def cpu_process_limit() -> int:
    """Most CPU processes :func:`launch` accepts: twice the cores (at least 2)."""
    return max(2, 2 * (os.cpu_count() or 1))


def gpu_count() -> int:
    """Number of CUDA devices, found without creating a CUDA context (safe before a fork)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def choose_device(num_processes: int, device: str = "auto") -> str:
    """'gpu' or 'cpu' for a launch of ``num_processes``; raises a clear error when impossible."""
    check_int("num_processes", num_processes, minimum=1)
    check_choice("device", device, ("auto", "cpu", "gpu"))
    gpus = gpu_count()
    if device == "gpu" or (device == "auto" and gpus >= 2 and num_processes <= gpus):
        if num_processes > gpus:
            raise ValueError(f"num_processes={num_processes} GPUs requested but this machine has {gpus}; "
                             f"use num_processes in [1, {gpus}] or device='cpu'")
        return "gpu"
    limit = cpu_process_limit()
    if num_processes > limit:
        raise ValueError(
            f"num_processes={num_processes} is more than makes sense on {os.cpu_count()} CPU cores; "
            f"use num_processes in [1, {limit}] (each process is a full Python interpreter)"
        )
    return "cpu"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def reset_accelerate_state(*, quiet: bool = False) -> bool:
    """Forget any ``Accelerator`` created in this process; return whether there was one.

    Accelerate keeps its state in class-level singletons. A launch must start without it,
    and a fresh single-process ``Accelerator`` in a notebook needs the same after a launch.
    """
    from accelerate.state import AcceleratorState, GradientState, PartialState

    existed = bool(AcceleratorState._shared_state or PartialState._shared_state)
    if existed and not quiet:
        print("note: an Accelerator already existed in this kernel; its state was reset so the new "
              "run starts clean (Accelerators created before this cell should not be used again).")
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    return existed


@contextlib.contextmanager
def _patched_environ(**values):
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update({k: str(v) for k, v in values.items()})
    try:
        yield
    finally:
        for key, old in saved.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old


def _child(result_dir: str, expected_processes: int, function, args) -> None:
    """What every launched process runs: the function, then its result (or error) to a file."""
    rank = int(os.environ.get("RANK", "0"))
    path = Path(result_dir) / f"rank{rank}.pt"
    if expected_processes > 1:
        # A forked child must not enter OpenMP: if the kernel already ran a multi-threaded op
        # (any cross_entropy does), libgomp's thread pool did not survive the fork and the
        # child's first parallel op would hang forever. One thread per process avoids it.
        torch.set_num_threads(1)
        _die_with_parent()
    try:
        result = function(*args)
        from accelerate.state import PartialState

        seen = PartialState().num_processes
        if seen != expected_processes:
            raise LaunchError(
                f"rank {rank} ran as {seen} process(es) instead of {expected_processes}: every process "
                "trained on its own. Create the Accelerator inside the launched function, with cpu=True "
                "on a machine without GPUs (or set ACCELERATE_USE_CPU=1)"
            )
        payload = {"ok": True, "result": result}
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the notebook
        payload = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        _save(payload, path)
        raise
    _save(payload, path)


def _die_with_parent() -> None:
    """Ask Linux to kill this child if the launching process dies (no orphans after a crash)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    pr_set_pdeathsig = 1
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


def _save(payload, path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(payload, tmp)
    tmp.rename(path)  # atomic: the parent never reads half a file


def launch(function, args=(), *, num_processes: int = 2, device: str = "auto", quiet: bool = False) -> list:
    """Run ``function(*args)`` in ``num_processes`` real processes; return their results by rank.

    ``function`` must create its ``Accelerator`` itself (inside the launched process) and
    return something ``torch.save`` can store. On CPU the children run with
    ``ACCELERATE_USE_CPU=1`` (gloo); on GPUs each child gets one GPU (NCCL).
    """
    from accelerate import notebook_launcher

    if not callable(function):
        raise TypeError(f"function must be callable, got {type(function).__name__}")
    if not isinstance(args, tuple):
        raise TypeError(f"args must be a tuple of arguments for function, got {type(args).__name__}")
    kind = choose_device(num_processes, device)
    reset_accelerate_state(quiet=quiet)
    env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "GLOO_SOCKET_IFNAME": "lo"}
    if kind == "cpu":
        env["ACCELERATE_USE_CPU"] = "1"
    with tempfile.TemporaryDirectory(prefix="gaccum-launch-") as result_dir, _patched_environ(**env):
        launcher_error = None
        try:
            with _quiet_stdout(quiet):
                notebook_launcher(_child, args=(result_dir, num_processes, function, args),
                                  num_processes=num_processes, use_port=str(free_port()), master_addr="127.0.0.1")
        except Exception as exc:  # noqa: BLE001 - re-raised below with the children's tracebacks
            launcher_error = exc
        finally:
            # A one-process launch runs in this very process: leave no Accelerator behind.
            reset_accelerate_state(quiet=True)
        payloads = {}
        for rank in range(num_processes):
            path = Path(result_dir) / f"rank{rank}.pt"
            if path.exists():
                payloads[rank] = torch.load(path, weights_only=False)
    failed = {r: p for r, p in payloads.items() if not p["ok"]}
    if failed:
        rank, payload = min(failed.items())
        raise LaunchError(f"rank {rank} of {num_processes} failed with {payload['error']}\n\n"
                          f"traceback of rank {rank}:\n{payload['traceback']}") from launcher_error
    if launcher_error is not None:
        raise LaunchError(f"the launch of {num_processes} processes failed: {launcher_error}") from launcher_error
    missing = [r for r in range(num_processes) if r not in payloads]
    if missing:
        raise LaunchError(f"ranks {missing} of {num_processes} returned no result (killed, or out of memory?)")
    return [payloads[r]["result"] for r in range(num_processes)]


@contextlib.contextmanager
def _quiet_stdout(quiet: bool):
    if not quiet:
        yield
        return
    with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink):
        yield
    sys.stdout.flush()

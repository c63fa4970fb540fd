"""Run a function in N real processes from a notebook, and get every rank's result back.

:func:`launch` starts them as Accelerate's ``debug_launcher`` does (``start_processes`` with ``fork``,
meeting through a file, not a port) and adds: every rank's return value; GPUs when there are enough,
else CPU processes over gloo; a clean Accelerate state; a crash turned into :class:`LaunchError`
naming the rank that failed first, with its traceback; bounded time; no process left behind.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing.connection
import numbers
import os
import signal
import tempfile
import threading
import time
import traceback
import warnings
from pathlib import Path

import torch
from torch.multiprocessing import start_processes

from .failures import error_text, failure_message

#: Seconds a launch may run before its processes are killed (``launch(..., timeout=None)``: no limit).
DEFAULT_TIMEOUT = 300.0
#: Seconds the other ranks get, once one failed (or all returned), to end by themselves before they
#: are killed. A rank blocked in a collective waits for its lost peer forever and never ends.
SHUTDOWN_GRACE = 5.0
RENDEZVOUS_RETRIES = 1  # launches started again when the processes could not connect

_LAUNCH_LOCK = threading.Lock()


class LaunchError(RuntimeError):
    """A launched process failed; the message names the rank and includes its traceback."""


def check_num_processes(num_processes) -> int:
    """``num_processes`` if it is an int of at least 1; a clear error otherwise (True is not 1 process)."""
    if isinstance(num_processes, bool) or not isinstance(num_processes, numbers.Integral):
        raise TypeError(f"num_processes must be an int, got {type(num_processes).__name__} ({num_processes!r})")
    if num_processes < 1:
        raise ValueError(f"num_processes must be in [1, inf), got {num_processes}")
    return int(num_processes)


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent dies (prctl PR_SET_PDEATHSIG, through libc);
    elsewhere nothing: the launcher's own cleanup stops the ranks there."""
    PR_SET_PDEATHSIG = 1  # noqa: N806 - <linux/prctl.h>'s name
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL))


def gpu_count() -> int:
    """CUDA devices, counted through NVML without initialising CUDA, which a later fork would not survive."""
    return torch.cuda.device_count()


def cpu_process_limit() -> int:
    """Most CPU processes :func:`launch` accepts: twice the cores (at least 2)."""
    return max(2, 2 * (os.cpu_count() or 1))


def choose_device(num_processes: int, device: str = "auto") -> str:
    """'gpu' or 'cpu' for a launch of ``num_processes``; raises a clear error when impossible."""
    check_num_processes(num_processes)
    if device not in ("auto", "cpu", "gpu"):
        raise ValueError(f"device must be one of auto, cpu, gpu; got {device!r}")
    gpus = gpu_count()
    if device == "gpu" or (device == "auto" and gpus >= 2 and num_processes <= gpus):
        if gpus == 0:
            raise ValueError(f"num_processes={num_processes} GPUs requested but this machine has 0 (torch sees no "
                             "CUDA device); use device='cpu' or device='auto'")
        if num_processes > gpus:
            raise ValueError(f"num_processes={num_processes} GPUs requested but this machine has {gpus}; "
                             f"use num_processes in [1, {gpus}] or device='cpu'")
        return "gpu"
    if num_processes > cpu_process_limit():
        raise ValueError(f"num_processes={num_processes} is more than makes sense on {os.cpu_count()} CPU cores; use "
                         f"num_processes in [1, {cpu_process_limit()}] (each process is a full Python interpreter)")
    return "cpu"


def reset_accelerate_state(*, quiet: bool = False) -> bool:
    """Forget any ``Accelerator`` made in this process (Accelerate keeps class-level singletons); say if one was.

    A launch must start without one, and so must a fresh one-process ``Accelerator`` after a launch.
    """
    from accelerate.state import AcceleratorState, GradientState, PartialState

    existed = bool(AcceleratorState._shared_state or PartialState._shared_state)
    if existed and not quiet:
        print("note: an Accelerator already existed in this kernel; its state was reset so the new "
              "run starts clean (Accelerators created before this cell should not be used again).")
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    return existed


# --------------------------------------------------------------------------------------------
# What runs in each launched process


def _rank(rank: int, folder: str, world: int, backend: str, parent_pid: int, function, args) -> None:
    """One rank: join the process group through a file, run ``function``, leave its result (or error) in a file."""
    # The variables torchrun would set, so that the Accelerator the function creates finds its place.
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    if backend == "gloo":
        os.environ.update(ACCELERATE_USE_CPU="1", GLOO_SOCKET_IFNAME="lo")  # without it each rank trains alone
        # A CPU rank that imports DeepSpeed (Accelerate's unwrap_model does, where it is installed) gets its CPU
        # back end, as the rank runs on the CPU, instead of a warning that it found no GPU.
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    # Die with the launcher, even one killed outright. torch's start_processes asks Linux for SIGINT
    # on the parent's death, which code that shields itself from Ctrl-C ignores: ask for SIGKILL.
    _die_with_parent()
    if os.getppid() != parent_pid:  # the launcher died before the request took effect
        os._exit(1)
    # OpenMP's thread pool does not survive a fork: a kernel that ran a multi-threaded op would
    # leave the child's first parallel op waiting forever. One thread per process avoids it.
    torch.set_num_threads(1)
    path = Path(folder) / f"rank{rank}.pt"
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        store = torch.distributed.FileStore(str(Path(folder) / "rendezvous"), world)
        try:
            torch.distributed.init_process_group(backend, store=store, rank=rank, world_size=world)
        except RuntimeError as exc:  # before the function ran: the launcher may start again
            raise _RendezvousError(str(exc)) from exc
        result = function(*args)
        from accelerate.state import PartialState

        if PartialState().num_processes != world:
            raise LaunchError(f"rank {rank} ran as {PartialState().num_processes} process(es) instead of {world}: "
                              "every process trained on its own. Create the Accelerator inside the launched function")
        try:
            _save({"ok": True, "result": result}, path)
        except Exception as exc:  # an unpicklable result is the function's fault: say so
            raise LaunchError(f"rank {rank} returned a {type(result).__name__} that cannot be sent back to the "
                              f"launching process ({type(exc).__name__}: {exc}); return tensors, numbers, strings, "
                              "numpy arrays, or lists/dicts of them") from exc
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the notebook
        _save_failure(exc, path)
        raise


class _RendezvousError(RuntimeError):
    """The process group could not be formed; the launched function had not started."""


def _save_failure(exc: BaseException, path: Path) -> None:
    rendezvous = isinstance(exc, _RendezvousError)
    error = f"{type(exc.__cause__ if rendezvous else exc).__name__}: {exc}"
    _save({"ok": False, "error": error, "traceback": traceback.format_exc(),
           "time": time.time(), "interrupted": isinstance(exc, KeyboardInterrupt),
           "rendezvous": rendezvous}, path)
    path.with_suffix(".failed").touch()  # tells the launcher at once, without reading the file


def _save(payload, path: Path) -> None:
    torch.save(payload, path.with_suffix(".tmp"))  # a save that fails leaves only the .tmp file behind
    path.with_suffix(".tmp").rename(path)  # atomic: the launcher never reads half a file


# --------------------------------------------------------------------------------------------
# The launching side


def launch(function, args=(), *, num_processes: int = 2, device: str = "auto", quiet: bool = False,
           timeout: float | None = DEFAULT_TIMEOUT) -> list:
    """Run ``function(*args)`` in ``num_processes`` real processes; return their results by rank.

    ``function`` finds the process group made (gloo on CPU, NCCL with one GPU a rank), creates
    its ``Accelerator`` itself and returns something ``torch.save`` can store. Past ``timeout``
    seconds (``None``: no limit) the processes are killed and :class:`LaunchError` names the
    ranks that had not finished. A one-process launch runs ``function`` here, unbounded.
    """
    if not callable(function):
        raise TypeError(f"function must be callable, got {type(function).__name__}")
    if not isinstance(args, tuple):
        raise TypeError(f"args must be a tuple of arguments for function, got {type(args).__name__}")
    kind = choose_device(num_processes, device)
    if timeout is not None:
        if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
            raise TypeError(f"timeout must be a number, got {type(timeout).__name__} ({timeout!r}); or None: no limit")
        if not 0 < timeout < float("inf"):
            raise ValueError(f"timeout must be in (0.0, inf), got {float(timeout)}")
        timeout = float(timeout)
    if num_processes > 1:
        _check_this_process_can_fork(kind)
    if not _LAUNCH_LOCK.acquire(blocking=False):
        raise LaunchError("another launch is still running in this process: wait for it to finish "
                          "(one launch at a time per kernel)")
    try:
        reset_accelerate_state(quiet=quiet)
        with _quiet_stdout(quiet):
            if num_processes > 1:
                return _launch_processes(function, args, num_processes, "nccl" if kind == "gpu" else "gloo", timeout)
            try:  # one process: this very one, as notebook_launcher does
                return [function(*args)]
            except Exception as exc:
                failure = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
                raise LaunchError(error_text(0, 1, failure)) from exc
    finally:
        reset_accelerate_state(quiet=True)  # a one-process launch ran here: leave no Accelerator behind
        _LAUNCH_LOCK.release()


def _check_this_process_can_fork(kind: str) -> None:
    """Refuse, saying what to do, when forked ranks would inherit something that cannot work."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        raise LaunchError(
            f"torch.distributed is already initialised in this process (world size "
            f"{torch.distributed.get_world_size()}): the launched processes would inherit its process group "
            "and wait forever. Call torch.distributed.destroy_process_group() first (or restart the kernel)")
    if kind == "gpu" and torch.cuda.is_initialized():
        raise LaunchError("this process has already used CUDA, and CUDA does not survive the fork that starts the GPU "
                          "processes: restart the kernel and keep kernel-side work on the CPU before launching")


def _launch_processes(function, args, world: int, backend: str, timeout) -> list:
    for attempt in range(1 + RENDEZVOUS_RETRIES):
        payloads, ended, unfinished = _run_ranks(function, args, world, backend, timeout)
        failed = [p for p in payloads.values() if not p["ok"]]
        if ended or unfinished or not failed or not all(p.get("rendezvous") for p in failed):
            break
        # gloo's connection of every rank to every other failed on a busy machine ("Connection closed
        # by peer"), seen once in a few thousand launches; no rank had run the function: start again
        if attempt < RENDEZVOUS_RETRIES:
            warnings.warn(f"the {world} processes could not connect ({failed[0]['error'].splitlines()[0][:160]}); "
                          "launching them again", RuntimeWarning, stacklevel=3)
    message = failure_message(payloads, ended, unfinished, world, timeout)
    if message is not None:
        raise LaunchError(message)
    return [payloads[r]["result"] for r in range(world)]


def _run_ranks(function, args, world: int, backend: str, timeout):
    """Start the ranks, wait for them, stop them; return (payloads by rank, exit codes of ranks that ended
    without one, ranks unfinished at the timeout or None)."""
    with tempfile.TemporaryDirectory(prefix="gaccum-launch-") as folder:
        context = start_processes(_rank, args=(folder, world, backend, os.getpid(), function, args),
                                  nprocs=world, join=False, start_method="fork")
        try:
            unfinished = _wait(context.processes, Path(folder), timeout)
        except KeyboardInterrupt:  # Ctrl-C, the notebook's stop button: the ranks are stopped below
            raise KeyboardInterrupt(f"launch of {world} processes interrupted; its processes were stopped") from None
        finally:
            killed = _stop(context.processes)
            for error_file in context.error_files:  # torch's own report of a failure: ours is in the folder
                Path(error_file).unlink(missing_ok=True)
        payloads = {}
        for rank in range(world):
            with contextlib.suppress(Exception):  # no file, or an unreadable one: no result
                payloads[rank] = torch.load(Path(folder) / f"rank{rank}.pt", weights_only=False)
    ended = {r: p.exitcode for r, p in enumerate(context.processes) if r not in payloads and r not in killed}
    return payloads, ended, unfinished


def _wait(processes, folder: Path, timeout) -> list | None:
    """Wait for the ranks to end (``SHUTDOWN_GRACE`` s once all returned or one failed); return the ranks
    without a result if ``timeout`` ran out, else None."""
    deadline = None if timeout is None else time.monotonic() + timeout
    settle_by = None
    while alive := [p for p in processes if p.is_alive()]:
        multiprocessing.connection.wait([p.sentinel for p in alive], timeout=0.1)
        now = time.monotonic()
        ended = [(folder / f"rank{r}.pt").exists() for r in range(len(processes))]  # returned, or failed
        if deadline is not None and now >= deadline:
            return [r for r, done in enumerate(ended) if not done]
        vanished = any(not p.is_alive() and not done for p, done in zip(processes, ended, strict=True))
        if settle_by is None and (all(ended) or vanished or any(folder.glob("*.failed"))):
            settle_by = now + SHUTDOWN_GRACE
        if settle_by is not None and now >= settle_by:
            break
    return None


def _stop(processes) -> set:
    """Kill and reap every rank still running; return the ranks that had to be killed."""
    killed = {r for r, p in enumerate(processes) if p.is_alive()}
    for rank in killed:
        processes[rank].kill()
    for process in processes:
        process.join()
    return killed


@contextlib.contextmanager
def _quiet_stdout(quiet: bool):
    with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink) if quiet else contextlib.nullcontext():
        yield

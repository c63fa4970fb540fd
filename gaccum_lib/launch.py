"""Run a function in N real processes with Accelerate's ``notebook_launcher`` and get its results back.

``notebook_launcher`` forks the processes, sets up ``torch.distributed`` (gloo on CPU,
NCCL on GPUs) and returns nothing. :func:`launch` wraps it so that a notebook cell can
simply write ``results = launch(train, args, num_processes=2)`` and

* gets every rank's return value, in rank order;
* runs on GPUs when there are enough of them, otherwise on CPU processes talking over
  gloo -- setting ``ACCELERATE_USE_CPU=1`` for the children, without which every child
  would silently train on its own;
* uses a free port, so two notebooks (or ``pytest -n 2``) can launch at once, and picks
  another one when the port was taken between choosing and binding it;
* starts from a clean Accelerate state even if an ``Accelerator`` was created earlier in
  the kernel (otherwise ``notebook_launcher`` refuses, or the children inherit the stale
  single-process state and compute wrong numbers), and refuses, saying what to do, when the
  kernel holds a ``torch.distributed`` process group or (GPU launches) has used CUDA;
* turns a crash in any child into a :class:`LaunchError` that names the rank and carries
  its traceback -- the rank that failed first, not a peer that merely lost its connection
  to it; a child killed by a signal, or one whose result cannot be sent back, is named too;
* never waits forever: after ``timeout`` seconds the processes are killed and the error
  names the ranks that had not finished;
* leaves no process behind: children die with the launching process (``PR_SET_PDEATHSIG``),
  an interrupted launch (Ctrl-C, the notebook's stop button) stops them and raises
  ``KeyboardInterrupt``, and the signal handlers torchelastic installs are put back;
* checks that the children really ran as ``num_processes`` processes.
"""

from __future__ import annotations

import contextlib
import gc
import os
import re
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

import torch

from ._checks import check_choice, check_float, check_int

#: Seconds a launch may run before its processes are killed (``launch(..., timeout=None)``: no limit).
DEFAULT_TIMEOUT = 300.0
#: Seconds a child gets to stop after the launcher's SIGTERM/SIGINT before it is killed
#: (torchelastic waits 30 s by default; a rank blocked in a collective never reacts).
SHUTDOWN_GRACE = 5
#: Fresh ports tried when the chosen one was taken before the launcher could bind it.
PORT_ATTEMPTS = 4

# torchelastic replaces the handlers of these signals for the length of a launch (and never puts them back).
_ELASTIC_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
# Errors a rank raises only because another rank died: they are never the root cause.
_LOST_PEER = re.compile(r"closed by peer|reset by peer|broken pipe|pair closure|got 0 bytes|remote process exited|"
                        r"communicator was aborted|remote worker", re.IGNORECASE)
_ADDRESS_IN_USE = re.compile(r"EADDRINUSE|address already in use", re.IGNORECASE)
_LAUNCH_LOCK = threading.Lock()


class LaunchError(RuntimeError):
    """A launched process failed; the message names the rank and includes its traceback."""


def gpu_count() -> int:
    """Number of CUDA devices, counted without initialising CUDA (so a later fork still works).

    ``torch.cuda.is_available()`` calls ``cuInit`` (unless PYTORCH_NVML_BASED_CUDA_CHECK=1),
    after which CUDA fails in forked children: notebook_launcher could no longer start GPU
    processes. ``device_count()`` asks NVML first and only falls back to the CUDA runtime when
    NVML cannot answer -- the same check Accelerate makes before it forks.
    """
    return torch.cuda.device_count()


def cpu_process_limit() -> int:
    """Most CPU processes :func:`launch` accepts: twice the cores (at least 2)."""
    return max(2, 2 * (os.cpu_count() or 1))


def choose_device(num_processes: int, device: str = "auto") -> str:
    """'gpu' or 'cpu' for a launch of ``num_processes``; raises a clear error when impossible."""
    check_int("num_processes", num_processes, minimum=1)
    check_choice("device", device, ("auto", "cpu", "gpu"))
    gpus = gpu_count()
    if device == "gpu" or (device == "auto" and gpus >= 2 and num_processes <= gpus):
        if gpus == 0:
            raise ValueError(f"num_processes={num_processes} GPUs requested but this machine has 0 (torch sees no "
                             "CUDA device); use device='cpu' or device='auto'")
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


# --------------------------------------------------------------------------------------------
# What runs in each launched process


def _child(result_dir: str, expected_processes: int, parent_pid: int, function, args) -> None:
    """What every launched process runs: the function, then its result (or error) to a file."""
    rank = int(os.environ.get("RANK", "0"))
    directory = Path(result_dir)
    if expected_processes > 1:
        # Garbage inherited from the parent must never be collected here: an earlier launch's
        # TCPStore server, say, would wait forever in its destructor for a thread that did not
        # survive the fork (a real hang of the launch after a failed one).
        gc.freeze()
        _die_with_parent(parent_pid)
        (directory / f"rank{rank}.pid").write_text(str(os.getpid()))  # lets the parent stop us
        # A forked child must not enter OpenMP: if the kernel already ran a multi-threaded op
        # (any cross_entropy does), libgomp's thread pool did not survive the fork and the
        # child's first parallel op would hang forever. One thread per process avoids it.
        torch.set_num_threads(1)
        _wait_until_every_rank_is_forked(directory, expected_processes)
    path = directory / f"rank{rank}.pt"
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
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the notebook
        _save_failure(exc, path)
        raise
    try:
        _save({"ok": True, "result": result}, path)
    except Exception as exc:  # noqa: BLE001 - an unpicklable result is the function's fault: say so
        error = LaunchError(
            f"rank {rank} returned a {type(result).__name__} that cannot be sent back to the launching process "
            f"({type(exc).__name__}: {exc}); return tensors, numbers, strings, numpy arrays, or lists/dicts of them"
        )
        _save_failure(error, path)
        raise error from exc


def _wait_until_every_rank_is_forked(directory: Path, num_processes: int, limit_s: float = 30.0) -> None:
    """Touch no network until the launcher has forked every rank (each rank writes its pid file first).

    While an early rank connects to the launcher's TCPStore, the store's thread in the
    launching process formats the peer's address with getnameinfo(), which holds glibc's
    resolver lock. A rank forked at that instant inherits the lock held by a thread it does
    not have, and its own first getnameinfo() (in its TCPStore connect) waits forever: a
    launch that hangs about once in thirty on a busy machine. Once every rank exists, no
    fork is left to inherit anything.
    """
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if all((directory / f"rank{r}.pid").exists() for r in range(num_processes)):
            return
        time.sleep(0.005)
    # A rank that never appeared failed to start: the launcher reports it; go on and let the
    # rendezvous say so rather than hide it here.


def _save_failure(exc: BaseException, path: Path) -> None:
    _save(_failure_payload(exc), path)
    path.with_suffix(".failed").touch()  # tells the parent's watchdog without reading the file


def _failure_payload(exc: BaseException) -> dict:
    from torch.distributed.elastic.multiprocessing.api import SignalException

    stopped = None  # the name of the signal that stopped this rank, if one did
    if isinstance(exc, SignalException):
        stopped = signal.Signals(exc.sigval).name
    elif isinstance(exc, KeyboardInterrupt):
        stopped = "SIGINT"
    return {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(),
            "time": time.time(), "stopped": stopped}


def _die_with_parent(parent_pid: int) -> None:
    """Ask Linux to kill this child if the launching process dies (no orphans after a crash)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGKILL))
    if os.getppid() != parent_pid:  # the parent died before the request took effect
        os._exit(1)


def _save(payload, path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    try:
        torch.save(payload, tmp)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    tmp.rename(path)  # atomic: the parent never reads half a file


# --------------------------------------------------------------------------------------------
# The launching side


def launch(function, args=(), *, num_processes: int = 2, device: str = "auto", quiet: bool = False,
           timeout: float | None = DEFAULT_TIMEOUT) -> list:
    """Run ``function(*args)`` in ``num_processes`` real processes; return their results by rank.

    ``function`` must create its ``Accelerator`` itself (inside the launched process) and
    return something ``torch.save`` can store. On CPU the children run with
    ``ACCELERATE_USE_CPU=1`` (gloo); on GPUs each child gets one GPU (NCCL).

    ``timeout`` (seconds, ``None`` for no limit) bounds a multi-process launch: past it the
    processes are killed and :class:`LaunchError` names the ranks that had not finished. A
    one-process launch runs ``function`` in this very process and is not bounded.
    """
    if not callable(function):
        raise TypeError(f"function must be callable, got {type(function).__name__}")
    if not isinstance(args, tuple):
        raise TypeError(f"args must be a tuple of arguments for function, got {type(args).__name__}")
    kind = choose_device(num_processes, device)
    if timeout is not None:
        timeout = check_float("timeout", timeout, minimum=0.0, exclusive_minimum=True)
    if num_processes > 1:
        _check_this_process_can_fork(kind)
    if not _LAUNCH_LOCK.acquire(blocking=False):
        raise LaunchError("another launch is still running in this process: wait for it to finish "
                          "(one launch at a time per kernel)")
    try:
        reset_accelerate_state(quiet=quiet)
        for _attempt in range(PORT_ATTEMPTS):
            outcome = _launch_once(function, args, num_processes, kind, quiet, timeout)
            if not outcome["port_taken"]:
                break
        else:
            raise LaunchError(f"{PORT_ATTEMPTS} free ports in a row were taken by other programs before the launch "
                              f"could use them: {outcome['error']}") from outcome["error"]
        return _results(outcome, num_processes, timeout)
    finally:
        _LAUNCH_LOCK.release()


def _check_this_process_can_fork(kind: str) -> None:
    """Refuse, saying what to do, when forked children would inherit something that cannot work."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        raise LaunchError(
            f"torch.distributed is already initialised in this process (world size "
            f"{torch.distributed.get_world_size()}): the launched processes would inherit its process group "
            "and wait forever. Call torch.distributed.destroy_process_group() first (or restart the kernel)"
        )
    if kind == "gpu" and torch.cuda.is_initialized():
        raise LaunchError(
            "this process has already used CUDA, and CUDA does not survive the fork that starts the GPU "
            "processes: restart the kernel and keep kernel-side work on the CPU before launching"
        )


def _launch_once(function, args, num_processes: int, kind: str, quiet: bool, timeout) -> dict:
    """One try of the launch; never raises for what the children did (see :func:`_results`)."""
    from accelerate import notebook_launcher
    from accelerate.utils import patch_environment  # sets the variables, and restores what was there before

    env = {
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        "GLOO_SOCKET_IFNAME": "lo",
        "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(SHUTDOWN_GRACE)),
        # torchelastic writes this variable and leaves it behind; listing it here restores it afterwards.
        "TORCHELASTIC_SIGNALS_TO_HANDLE": ",".join(_ELASTIC_SIGNALS),
    }
    if kind == "cpu":
        env["ACCELERATE_USE_CPU"] = "1"
    with tempfile.TemporaryDirectory(prefix="gaccum-launch-") as result_dir, patch_environment(**env):
        saved_handlers = _signal_handlers()
        watchdog = _Watchdog(result_dir, num_processes, timeout)
        launcher_error = None
        interrupted = []
        try:
            with watchdog, _quiet_stdout(quiet), _elastic_logs_silenced():
                notebook_launcher(_child, args=(result_dir, num_processes, os.getpid(), function, args),
                                  num_processes=num_processes, use_port=str(free_port()), master_addr="127.0.0.1")
        except Exception as exc:  # noqa: BLE001 - sorted out by _results with the children's reports
            launcher_error = _without_frames(exc)
        finally:
            # Clean up even if a second Ctrl-C arrives meanwhile; it is raised once we are done.
            with _signals_recorded(interrupted, saved_handlers):
                started = _launched_pids(result_dir, num_processes)
                _stop_leftovers(started)
                # A one-process launch runs in this very process: leave no Accelerator behind.
                reset_accelerate_state(quiet=True)
        if interrupted:
            raise KeyboardInterrupt(f"launch of {num_processes} processes interrupted; its processes were stopped")
        payloads = _read_payloads(result_dir, num_processes)
    return {"payloads": payloads, "error": launcher_error, "started": sorted(started),
            "unfinished": watchdog.unfinished,
            "port_taken": (launcher_error is not None and not started
                           and bool(_ADDRESS_IN_USE.search(str(launcher_error))))}


def _without_frames(exc: BaseException) -> BaseException:
    """``exc`` without its traceback, so that a notebook holding the error does not keep the launcher's
    agent, its rendezvous store (a listening port and a thread) and the children's arguments alive."""
    seen, link = set(), exc
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        if link.__traceback__ is not None:
            traceback.clear_frames(link.__traceback__)
            link.__traceback__ = None
        link = link.__cause__ or link.__context__
    return exc


def _results(outcome: dict, num_processes: int, timeout) -> list:
    """The children's results in rank order, or the right exception for what went wrong."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    launcher_error = outcome["error"]
    if isinstance(launcher_error, SignalException):
        sig = signal.Signals(launcher_error.sigval)
        if sig == signal.SIGINT:
            raise KeyboardInterrupt(f"launch of {num_processes} processes interrupted; its processes were stopped")
        # torchelastic caught a signal meant for this process: now that the children are gone and the
        # original handlers are back, let it do what it would have done without the launch.
        signal.raise_signal(sig)
        raise LaunchError(f"the launch was stopped by {sig.name}; its processes were stopped") from launcher_error
    message = _failure_message(outcome, num_processes, timeout)
    if message is not None:
        raise LaunchError(message) from launcher_error
    if launcher_error is not None:
        raise LaunchError(f"the launch of {num_processes} processes failed: "
                          f"{type(launcher_error).__name__}: {launcher_error}") from launcher_error
    payloads = outcome["payloads"]
    missing = [r for r in range(num_processes) if r not in payloads]
    if missing:
        raise LaunchError(f"ranks {missing} of {num_processes} returned no result (killed, or out of memory?)")
    return [payloads[r]["result"] for r in range(num_processes)]


def _failure_message(outcome: dict, num_processes: int, timeout) -> str | None:
    """What to tell the notebook about failed ranks, root cause first; None when every rank succeeded."""
    payloads, unfinished = outcome["payloads"], outcome["unfinished"]
    failed = {r: p for r, p in payloads.items() if not p["ok"]}
    errors = {r: p for r, p in failed.items() if not p.get("stopped")}
    genuine = {r: p for r, p in errors.items() if not _LOST_PEER.search(p["error"])}
    dead = [r for r in outcome["started"] if r not in payloads]
    if genuine:
        # The first rank to fail; ranks failing together (the same bug everywhere) report the lowest rank.
        earliest = min(p["time"] for p in genuine.values())
        rank = min(r for r, p in genuine.items() if p["time"] - earliest < 2.0)
        head = _error_text(rank, num_processes, payloads[rank])
    elif unfinished is not None:
        finished = [r for r in range(num_processes) if r not in unfinished]
        rank = None
        head = (f"the launch did not finish within {timeout:g} s: ranks {unfinished} of {num_processes} had not "
                f"returned{f' (ranks {finished} had)' if finished else ''}, so all its processes were stopped. "
                "A rank waiting in a collective (gather, all-reduce, a synchronising backward) that another rank "
                "never reaches waits forever; if the run is merely slow, pass a larger timeout= to launch")
    elif dead:
        rank = _first_observed_failure(outcome["error"], dead)
        head = (f"rank {rank} of {num_processes} ended without returning a result ({_how_it_ended(outcome, rank)}): "
                "killed from outside, by the out-of-memory killer, or by os._exit")
    elif errors:
        rank = min(errors, key=lambda r: errors[r]["time"])
        head = _error_text(rank, num_processes, payloads[rank])
    elif failed:
        rank = min(failed)
        head = f"rank {rank} of {num_processes} was stopped by {failed[rank]['stopped']} before it finished"
    else:
        return None
    others = []
    for other in range(num_processes):
        if other == rank:
            continue
        if other in failed:
            first_line = failed[other]["error"].splitlines()[0] if failed[other]["error"] else ""
            others.append(f"rank {other}: {first_line[:200]}")
        elif other in dead and not (unfinished and other in unfinished):
            others.append(f"rank {other}: ended without a result (stopped by the launcher, or killed)")
    if others:
        head += "\n\nthe other ranks:\n" + "\n".join(f"  {line}" for line in others)
    return head


def _error_text(rank: int, num_processes: int, payload: dict) -> str:
    text = (f"rank {rank} of {num_processes} failed with {payload['error']}\n\n"
            f"traceback of rank {rank}:\n{payload['traceback']}")
    if "was not reinitialized" in payload["error"]:
        text += ("\nhint: the launched function used an Accelerator (or PartialState) created outside it, in this "
                 "kernel; launching resets that state. Create the Accelerator inside the launched function.")
    if "Cannot re-initialize CUDA in forked subprocess" in payload["error"]:
        text += ("\nhint: this kernel used CUDA before the launch; restart it and keep kernel-side work on the CPU.")
    return text


def _first_observed_failure(launcher_error, candidates: list) -> int:
    """The rank torchelastic saw fail first, if it is one of ``candidates``; else the lowest candidate."""
    failures = getattr(launcher_error, "failures", None) or {}
    observed = [r for r in sorted(failures, key=lambda r: failures[r].timestamp) if r in candidates]
    return observed[0] if observed else min(candidates)


def _how_it_ended(outcome: dict, rank: int) -> str:
    failure = (getattr(outcome["error"], "failures", None) or {}).get(rank)
    if failure is None:
        return "killed by a signal or exited early"
    if failure.exitcode < 0:
        return f"killed by {failure.signal_name()}"
    return f"exit code {failure.exitcode}"


def _read_payloads(result_dir: str, num_processes: int) -> dict:
    payloads = {}
    for rank in range(num_processes):
        path = Path(result_dir) / f"rank{rank}.pt"
        if path.exists():
            with contextlib.suppress(Exception):  # unreadable: counts as no result
                payloads[rank] = torch.load(path, weights_only=False)
    return payloads


def _launched_pids(result_dir: str, num_processes: int) -> dict:
    """rank -> pid of the launched processes that got as far as recording themselves."""
    pids = {}
    for rank in range(num_processes):
        with contextlib.suppress(OSError, ValueError):
            pids[rank] = int((Path(result_dir) / f"rank{rank}.pid").read_text())
    return pids


def _live_children(pids) -> list:
    """The psutil processes among ``pids`` that are still running children of this process."""
    import psutil

    alive = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            proc = psutil.Process(pid)
            if proc.ppid() == os.getpid() and proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(proc)
    return alive


def _kill_launched(result_dir: str, num_processes: int) -> None:
    import psutil

    for proc in _live_children(_launched_pids(result_dir, num_processes).values()):
        with contextlib.suppress(psutil.Error):
            proc.kill()


def _stop_leftovers(started: dict) -> None:
    """Kill and reap any launched process still there (torchelastic normally leaves none)."""
    import multiprocessing

    import psutil

    pids = set(started.values())
    for proc in _live_children(pids):
        with contextlib.suppress(psutil.Error):
            proc.kill()
    deadline = time.monotonic() + 10.0
    while True:
        multiprocessing.active_children()  # reaps the finished ones among multiprocessing's children
        remaining = []
        for pid in pids:
            with contextlib.suppress(psutil.Error):
                if psutil.Process(pid).ppid() == os.getpid():
                    remaining.append(pid)
        if not remaining or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    for pid in remaining:  # not multiprocessing's: reap directly
        with contextlib.suppress(OSError):
            os.waitpid(pid, os.WNOHANG)


class _Watchdog:
    """Bounds a running launch from a thread: kills its processes when it runs too long, or hangs after a failure.

    torchelastic stops the other ranks when one fails, but waits 30 s for each that does not
    react to SIGTERM -- and a rank blocked in a collective or a rendezvous never reacts. So
    ``SHUTDOWN_GRACE`` seconds after a rank failed (reported an error, or vanished without a
    result) whatever is left is killed, and after ``timeout`` seconds everything is.
    """

    def __init__(self, result_dir: str, num_processes: int, timeout):
        self._dir, self._num_processes, self._timeout = Path(result_dir), num_processes, timeout
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="gaccum-launch-watchdog", daemon=True)
        self.unfinished = None  # ranks without a result when the time was up (None: it never was)

    def __enter__(self):
        if self._num_processes > 1:
            self._thread.start()
        return self

    def __exit__(self, *exc_info):
        self._done.set()
        if self._thread.is_alive():
            self._thread.join()

    def _watch(self) -> None:
        started = time.monotonic()
        failed_at = None
        while not self._done.wait(0.2):
            now = time.monotonic()
            if failed_at is None and self._a_rank_failed():
                failed_at = now
            if self._timeout is not None and now - started >= self._timeout and self.unfinished is None:
                self.unfinished = [r for r in range(self._num_processes) if not self._result(r).exists()]
            if self.unfinished is not None or (failed_at is not None and now - failed_at >= SHUTDOWN_GRACE):
                # Again on every round until the launcher returns: a process may record its pid late.
                _kill_launched(str(self._dir), self._num_processes)

    def _result(self, rank: int) -> Path:
        return self._dir / f"rank{rank}.pt"

    def _a_rank_failed(self) -> bool:
        if any((self._dir / f"rank{r}.failed").exists() for r in range(self._num_processes)):
            return True
        pids = _launched_pids(str(self._dir), self._num_processes)
        alive = {proc.pid for proc in _live_children(pids.values())}
        return any(pid not in alive and not self._result(rank).exists() for rank, pid in pids.items())


def _signal_handlers() -> dict:
    return {name: signal.getsignal(getattr(signal, name)) for name in _ELASTIC_SIGNALS if hasattr(signal, name)}


@contextlib.contextmanager
def _signals_recorded(received: list, restore: dict):
    """Record SIGINT instead of raising it inside the block; then put the ``restore`` handlers back."""
    in_main = threading.current_thread() is threading.main_thread()
    if in_main:
        signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    try:
        yield
    finally:
        if in_main:
            for name, handler in restore.items():
                if handler is not None:  # None: installed from C, cannot be put back from Python
                    signal.signal(getattr(signal, name), handler)


@contextlib.contextmanager
def _elastic_logs_silenced():
    """Mute torchelastic's own logging of a failed child: LaunchError carries that traceback already."""
    import logging

    # Import what the launch uses first, so that its loggers exist to be muted.
    import torch.distributed.elastic.agent.server.api  # noqa: F401
    import torch.distributed.elastic.multiprocessing.api  # noqa: F401
    import torch.distributed.launcher.api  # noqa: F401
    import torch.multiprocessing.spawn  # noqa: F401

    loggers = [logging.getLogger(name) for name in list(logging.root.manager.loggerDict)
               if name.startswith(("torch.distributed.elastic", "torch.multiprocessing"))]
    saved = [(logger, logger.level) for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in saved:
            logger.setLevel(level)


@contextlib.contextmanager
def _quiet_stdout(quiet: bool):
    if not quiet:
        yield
        return
    with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink):
        yield
    sys.stdout.flush()

"""What a kernel imports before it forks ranks, so that no rank imports it again at every launch.

Infrastructure for :mod:`gaccum_lib.launch` and :func:`gaccum_lib.hosts.launch_from_notebook`.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import multiprocessing.sharedctypes
import os
import sys
import types

# Set by a forked rank that imported DeepSpeed (shared memory made before any fork, so every rank
# writes the kernel's copy): the next launch imports it once here instead of in every rank.
_RANKS_IMPORTED_DEEPSPEED = multiprocessing.sharedctypes.RawValue("b", 0)
# Set by expect_deepspeed_in_ranks: the ranks will start DeepSpeed's communication, not just import it.
_RANKS_RUN_DEEPSPEED = False


def import_before_fork(function=None) -> None:
    """Import here, once, what every forked rank would otherwise import for itself at each launch.

    torch._dynamo always (a rank's first optimizer imports it: 2 s). DeepSpeed (0.7 s) only where the
    ranks will import it: Accelerate's ``unwrap_model`` does, wherever DeepSpeed is installed, so when
    the launched ``function`` calls it, or once an earlier launch's ranks imported it. A kernel whose
    ranks never need DeepSpeed never pays for it.
    """
    import torch._dynamo  # noqa: F401

    needed = _RANKS_IMPORTED_DEEPSPEED.value or _calls_unwrap_model(function)
    if needed and "deepspeed" not in sys.modules and importlib.util.find_spec("deepspeed") is not None:
        previous = logging.root.manager.disable
        logging.disable(logging.WARNING)  # its import warns, on stdout, that it found no GPU
        try:
            import deepspeed  # noqa: F401
        except Exception:  # noqa: BLE001 - a broken install fails in the ranks, where the error is reported
            pass
        finally:
            logging.disable(previous)
    if _RANKS_RUN_DEEPSPEED and "deepspeed" in sys.modules:
        _without_deepspeed_shared_memory_kernel()


def _without_deepspeed_shared_memory_kernel() -> None:
    """Probe DeepSpeed's optional kernels once here (0.2 s a process), leaving out its CPU shared-memory
    all-reduce: a rank would compile it on first use, about 25 s of C++ on a fresh machine, and only
    ``inference_all_reduce`` uses it (training all-reduces go through torch.distributed either way)."""
    import deepspeed.ops

    try:
        with _stderr_silenced():  # the probe's test compiles print linker errors ("cannot find -laio")
            compatible = deepspeed.ops.__compatible_ops__  # DeepSpeed keeps this one dict: edits to it persist
    except Exception:  # noqa: BLE001 - an older DeepSpeed without the probe: leave it as it is
        return
    compatible["deepspeed_shm_comm"] = False


def _calls_unwrap_model(function) -> bool:
    """Whether ``function`` (or a function defined inside it) calls a method named unwrap_model."""
    code = getattr(function, "__code__", None)
    stack = [code] if code is not None else []
    while stack:
        code = stack.pop()
        if "unwrap_model" in code.co_names:
            return True
        stack.extend(const for const in code.co_consts if isinstance(const, types.CodeType))
    return False


def expect_deepspeed_in_ranks() -> None:
    """Say before a launch that its ranks will run DeepSpeed: the launch imports it here first, without
    the shared-memory kernel (see above)."""
    global _RANKS_RUN_DEEPSPEED
    _RANKS_RUN_DEEPSPEED = True
    _RANKS_IMPORTED_DEEPSPEED.value = 1


def note_rank_imports() -> None:
    """In a forked rank, once its function ended: tell the kernel what it imported (see above)."""
    if "deepspeed" in sys.modules:
        _RANKS_IMPORTED_DEEPSPEED.value = 1


@contextlib.contextmanager
def _stderr_silenced():
    """File descriptor 2 to /dev/null: what subprocesses write there too (a notebook shows it)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as sink:
            os.dup2(sink.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)

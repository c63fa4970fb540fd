"""Run tiny-model work on one intra-op thread, and threads that take turns on one core.

The lessons' models have a few to a few thousand weights: splitting their operations over
threads gains nothing, and on a busy 2-core laptop (a browser, a second kernel, a launch)
OpenMP threads that spin-wait for a core make a 10 ms computation take seconds. Both
settings are restored afterwards (the CPU set for the calling thread only), so the
learner's own code keeps PyTorch's default.
"""

from __future__ import annotations

import contextlib
import os

import torch


@contextlib.contextmanager
def single_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _current_core() -> int | None:
    """The CPU this thread last ran on (Linux's /proc), or None."""
    try:
        with open("/proc/thread-self/stat") as stat:
            return int(stat.read().rsplit(")", 1)[1].split()[36])  # field 39, "processor"
    except (OSError, ValueError, IndexError):
        return None


@contextlib.contextmanager
def one_core():
    """Keep this thread, and every thread or process it starts meanwhile, on the core it runs on now.

    Only where ``os.sched_setaffinity`` exists (Linux); elsewhere it does nothing.

    For Python threads that hold the GIL by turns (the simulated ranks of ``check_accumulation``): on
    several cores they hand the GIL across cores around every small torch kernel, and waking a thread
    on another core is slow. Measured on 2 cores, ``check_accumulation`` of ``tiny_lm(16)`` (median of
    50 calls, interleaved): 84 ms on one core against 98 ms on both, and 88 against 136 ms while another
    process kept one core busy. The thread's own CPU set is restored afterwards; other threads are untouched.
    """
    narrowed_from = None
    if hasattr(os, "sched_setaffinity"):
        previous = os.sched_getaffinity(0)  # 0: this thread
        core = _current_core()
        with contextlib.suppress(OSError):  # a CPU set we may not narrow: run where the OS puts us
            os.sched_setaffinity(0, {core if core in previous else min(previous)})
            narrowed_from = previous
    try:
        yield
    finally:
        if narrowed_from is not None:
            os.sched_setaffinity(0, narrowed_from)

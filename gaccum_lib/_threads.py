"""Run tiny-model work on one intra-op thread.

The lessons' models have a few to a few thousand weights: splitting their operations over
threads gains nothing, and on a busy 2-core laptop (a browser, a second kernel, a launch)
OpenMP threads that spin-wait for a core make a 10 ms computation take seconds. The thread
count is restored afterwards, so the learner's own code keeps PyTorch's default.
"""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def single_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)

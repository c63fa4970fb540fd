"""Lesson 06's launch plumbing: Accelerate's own ``notebook_launcher``, with what a lesson cell should not show.

Pitfalls 13 and 14 of lesson 06 are about ``notebook_launcher`` itself, so they must launch with it,
not with :func:`gaccum_launch.launch`. :func:`notebook_launcher_results` is that launch as one call:

* where ``notebook_launcher`` would start no process (a Colab kernel below 2 GPUs, see
  :mod:`gaccum_launch.notebook`), it launches nothing, says so and returns ``None``;
* each process gets one thread first (a forked process that inherits the kernel's busy OpenMP pool
  can hang in its first parallel operation: lesson 06, pitfall 15);
* a free port instead of the default 29500 (several notebooks may launch at once);
* ``DS_ACCELERATOR=cpu`` in the processes when this machine has no GPU: DeepSpeed, where it is
  installed, is imported by ``accelerator.unwrap_model``, and without that variable it prints
  "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it."
  in every process (DeepSpeed's own documented override; Accelerate is not touched);
* every process's return value comes back, through a queue, in rank order (``notebook_launcher``
  itself returns nothing).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os

import torch

QUEUE_TIMEOUT = 120.0  # seconds to wait for a process's result once notebook_launcher returned


def notebook_launcher_results(function, args=(), *, num_processes: int = 2, fresh: bool = True,
                              needs_no_gpu: bool = False) -> list | None:
    """Run ``function(*args)`` with Accelerate's ``notebook_launcher``; each process's result, sorted.

    ``fresh``: forget any ``Accelerator`` of this kernel first (an earlier cell's would make
    ``notebook_launcher`` refuse: pitfall 14 keeps it on purpose with ``fresh=False``).
    ``needs_no_gpu``: launch nothing on a machine with a GPU (pitfall 13 shows a CPU-only machine).
    Returns ``None``, after saying why, where there is nothing to show.
    """
    from accelerate import notebook_launcher
    from accelerate.utils import patch_environment
    from accelerate.utils.other import get_free_port

    from gaccum_launch import gpu_count, notebook_launcher_forks, reset_accelerate_state

    if not notebook_launcher_forks():  # Colab below 2 GPUs: it would run the function once, here (lesson 04)
        print("notebook_launcher starts no process in this kernel: nothing to show here")
        return None
    if needs_no_gpu and gpu_count() > 0:
        print("this machine has a GPU, and this pitfall needs a machine without one: nothing to show here")
        return None
    if fresh:
        reset_accelerate_state(quiet=True)
    queue = multiprocessing.get_context("fork").Queue()

    def one_process(*function_args):
        torch.set_num_threads(1)  # before any work: the kernel's thread pool did not survive the fork
        queue.put(function(*function_args))

    # DeepSpeed's back end on a machine without GPUs is the CPU: saying so silences its warning.
    quiet_deepspeed = gpu_count() == 0 and "DS_ACCELERATOR" not in os.environ  # a choice of the caller's stays
    cpu_only = patch_environment(ds_accelerator="cpu") if quiet_deepspeed else contextlib.nullcontext()
    with cpu_only:
        notebook_launcher(one_process, args, num_processes=num_processes, use_port=str(get_free_port()))
    return sorted(queue.get(timeout=QUEUE_TIMEOUT) for _ in range(num_processes))


def notebook_launcher_refusal(function, *, num_processes: int = 2) -> str | None:
    """Pitfall 14: launch ``function`` with ``notebook_launcher`` while this kernel's ``Accelerator`` stays.

    Returns the ``ValueError`` message ``notebook_launcher`` refuses with, or ``None``, after saying why,
    where it starts no process (a Colab kernel below 2 GPUs runs ``function`` once, in the kernel).
    """
    try:
        ran = notebook_launcher_results(function, num_processes=num_processes, fresh=False)
    except ValueError as refusal:
        return str(refusal)
    if ran is not None:
        raise AssertionError("expected notebook_launcher to refuse: an Accelerator exists in this kernel")
    return None


__all__ = ["notebook_launcher_refusal", "notebook_launcher_results"]

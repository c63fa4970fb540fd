"""Where a notebook runs, as Accelerate's launchers see it, and a launch that forks everywhere.

Accelerate's ``notebook_launcher`` takes a kernel for Colab's when ``"google.colab"`` is in
``str(get_ipython())`` (and no ``KAGGLE*`` variable is set). There, with fewer than two GPUs,
it starts no process at all: it prints "Launching training on one CPU." (or GPU) and calls the
function once, in the kernel. A lesson that wants two processes then gets one.

Accelerate's ``debug_launcher`` always forks CPU processes (gloo, meeting through a file), on
Colab too. One setting must come with it: its ranks create their process group themselves, so
Accelerate's thread rule (physical cores divided by the local processes, when OMP_NUM_THREADS is
unset) sees a local world of one and gives every rank all the physical cores; a forked rank
that then starts an OpenMP team beside the kernel's own thread pool waits forever (lesson 06,
pitfall 15). ``OMP_NUM_THREADS=1`` makes Accelerate leave the thread count alone (it stays 1
only if the kernel's is; :func:`launch_from_notebook` sets both).
"""

from __future__ import annotations

import os
import sys

import torch
from accelerate import debug_launcher, notebook_launcher
from accelerate.utils import patch_environment
from accelerate.utils.other import get_free_port

from .processes import check_num_processes, gpu_count


def in_colab_kernel() -> bool:
    """What Accelerate's ``notebook_launcher`` decides: a Colab kernel (Kaggle's variables take precedence)."""
    if any(key.startswith("KAGGLE") for key in os.environ):
        return False
    ipython = sys.modules.get("IPython")
    return ipython is not None and "google.colab" in str(ipython.get_ipython())


def notebook_launcher_forks() -> bool:
    """False where ``notebook_launcher`` would run the function once, in this kernel (Colab below 2 GPUs).

    Counts GPUs without starting CUDA in this kernel, so a later fork still works.
    """
    return not (in_colab_kernel() and gpu_count() < 2)


def launch_from_notebook(function, args=(), *, num_processes: int = 2) -> None:
    """Lesson 04's launch cell as a function: ``notebook_launcher`` where it forks, else ``debug_launcher``.

    ``notebook_launcher`` gets a free port (several notebooks may launch at once, and its default
    29500 would collide). ``debug_launcher`` runs CPU processes with one thread each (see above).
    Like both launchers it returns nothing: the function saves what the kernel should read.
    """
    check_num_processes(num_processes)
    if notebook_launcher_forks():
        # The launcher checks on its processes every monitor_interval seconds, and returns at the
        # first check after they ended: 0.1 s (its default) added about 0.05 s to every launch.
        notebook_launcher(function, args, num_processes=num_processes, use_port=str(get_free_port()),
                          monitor_interval=0.02)
        return
    kernel_threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the forked ranks inherit it; OMP_NUM_THREADS keeps Accelerate from raising it
    try:
        with patch_environment(omp_num_threads=1):
            debug_launcher(function, args, num_processes=num_processes)
    finally:
        torch.set_num_threads(kernel_threads)

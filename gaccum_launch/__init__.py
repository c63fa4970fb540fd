"""gaccum_launch: real processes from a notebook, apart from what the lessons teach.

Infrastructure, not the subject: a learner reads :mod:`gaccum_lib` for gradient accumulation and
uses this package only to start the processes that the lessons compare against.

* :mod:`~gaccum_launch.processes` -- :func:`launch`: run a function in N real processes (gloo on
  CPU, NCCL with a GPU a rank) and get every rank's result back, with bounded time, Ctrl-C, and
  no process left behind;
* :mod:`~gaccum_launch.failures` -- what a failed launch tells the notebook: the rank that failed
  first, its traceback and a hint;
* :mod:`~gaccum_launch.notebook` -- lesson 04's ``notebook_launcher`` cell as a function that
  also starts real processes in a kernel Accelerate takes for Colab's.
"""

from .notebook import in_colab_kernel, launch_from_notebook, notebook_launcher_forks
from .processes import LaunchError, choose_device, cpu_process_limit, gpu_count, launch, reset_accelerate_state

__all__ = ["LaunchError", "choose_device", "cpu_process_limit", "gpu_count", "in_colab_kernel", "launch",
           "launch_from_notebook", "notebook_launcher_forks", "reset_accelerate_state"]

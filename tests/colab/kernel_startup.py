"""IPython start-up script: make this kernel one that Accelerate takes for Colab's.

Accelerate's ``notebook_launcher`` decides "Colab" from ``"google.colab" in str(get_ipython())``
alone. Giving the real shell a subclass whose ``repr`` names ``google.colab`` changes that string
and nothing else: the kernel, matplotlib and the widgets keep working. `make colab` runs the
launching lessons in such kernels under nbmake; `make browser` runs them so in JupyterLab, where
every lesson's kernel starts with this script: there GACCUM_COLAB_LESSONS names the notebooks
(without .ipynb) to treat so, and JupyterLab hands each kernel its notebook's path in
JPY_SESSION_NAME. With GACCUM_COLAB_LESSONS unset or empty every kernel that runs it is changed
(`make colab`). tests/test_colab_kernel.py reads what the lessons printed.

Colab has no DeepSpeed (an optional extra of the suite): such a kernel hides it. A ``None`` in
``sys.modules`` makes ``import deepspeed`` raise ImportError and ``importlib.util.find_spec``
(what Accelerate asks) answer None, in the kernel and in every rank it forks.
"""

import os as _os
import pathlib as _pathlib

_only = _os.environ.get("GACCUM_COLAB_LESSONS", "").split()
if not _only or _pathlib.Path(_os.environ.get("JPY_SESSION_NAME", "")).stem in _only:
    _shell = get_ipython()  # noqa: F821 -- IPython runs start-up scripts in the user namespace, where it is defined
    _shell.__class__ = type("ColabLikeShell", (type(_shell),),
                            {"__repr__": lambda self: "<google.colab._shell.Shell object (gaccum's stand-in)>"})
    del _shell
    import sys as _sys

    _sys.modules["deepspeed"] = None
    del _sys
del _os, _pathlib, _only

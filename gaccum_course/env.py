"""What this kernel runs on: versions, devices, and how a multi-process launch would run here."""

from __future__ import annotations

import os
import platform
import sys
from dataclasses import dataclass
from importlib import metadata

from gaccum_launch import gpu_count

# What a learner's lessons import (JupyterLab and nbmake run the notebooks; they are not a lesson's business).
PACKAGES = ("torch", "accelerate", "transformers", "numpy", "matplotlib", "ipywidgets")

#: The oldest release of each package the lessons run with, who needs it, and why (pyproject.toml has the same floors).
MINIMUMS = {
    "torch": ("2.11", "every lesson", "transformers 5.10's float8 types; FSDP2 over gloo in lesson 10"),
    "accelerate": ("1.13", "lessons 02-09", "lesson 06's pitfalls 12 and 14; get_free_port (04-09)"),
    "transformers": ("5.10.1", "lessons 05 and 08", "the Trainer's train_sampling_strategy and Llama's count"),
    "ipywidgets": ("7.7", "the explorers in 01-03 and 09", "the widget API they use, the same in 7.7 and 8"),
}


@dataclass(frozen=True)
class Environment:
    python: str
    platform: str
    cpu_cores: int
    versions: dict
    cuda_build: str | None
    gpus: int
    launch_backend: str
    cuda_packages: tuple

    def table(self) -> str:
        """A small aligned text table, for printing in a notebook."""
        rows = [("python", self.python), ("platform", self.platform), ("CPU cores", str(self.cpu_cores))]
        rows += [(name, version or "not installed") for name, version in self.versions.items()]
        rows += [("torch CUDA build", self.cuda_build or "none (CPU build)"),
                 ("GPUs", str(self.gpus)),
                 ("multi-process launches use", self.launch_backend)]
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def installed_cuda_packages() -> tuple:
    """Names of installed distributions that ship CUDA (nvidia-*, triton): none on a CPU setup."""
    names = {(d.metadata["Name"] or "").lower() for d in metadata.distributions()}
    return tuple(sorted(n for n in names if n.startswith("nvidia-") or n == "triton"))


def environment() -> Environment:
    """Describe this kernel without initialising CUDA (so a later notebook_launcher can still fork).

    GPUs are counted by :func:`gpu_count`; ``get_device_name`` would create a CUDA context,
    which is why GPU names are not listed.
    """
    import torch

    gpus = gpu_count()
    backend = f"NCCL on {gpus} GPUs" if gpus >= 2 else "gloo on CPU processes"
    return Environment(
        python=sys.version.split()[0],
        platform=f"{platform.system()} {platform.machine()}",
        cpu_cores=os.cpu_count() or 1,
        versions={p: _version(p) for p in PACKAGES},
        cuda_build=torch.version.cuda,
        gpus=gpus,
        launch_backend=backend,
        cuda_packages=installed_cuda_packages(),
    )


def _older(version: str, minimum: str) -> bool:
    from packaging.version import Version  # a dependency of accelerate and transformers

    return Version(version) < Version(minimum)


def readiness(env: Environment, lessons_here=None) -> tuple[list[str], list[str]]:
    """What stops a lesson in this kernel (``problems``) and what is only worth knowing (``notes``), in words.

    ``lessons_here`` is the notebook names in the lesson's folder; missing ones are a note, since
    each lesson runs on its own (Colab and Kaggle open one at a time).
    """
    problems, notes = [], []
    for name, (minimum, who, why) in MINIMUMS.items():
        have = env.versions.get(name)
        if have is None or _older(have, minimum):
            found = f"{name} {have} is too old" if have else f"{name} is not installed"
            problems.append(f"{found}: {who} need {name}>={minimum} ({why}). Install it into this kernel with "
                            f"`%pip install '{name}>={minimum}'` and restart the kernel, or run `make env` "
                            "in the repository.")
    if env.cuda_build and env.gpus == 0:
        notes.append(f"torch is a CUDA {env.cuda_build} build and no GPU is visible: the lessons run on the CPU "
                     "(gloo processes), as they would with the smaller CPU build. Nothing to do.")
    if lessons_here is not None:
        from .lessons import LESSONS

        missing = [lesson.notebook for lesson in LESSONS if lesson.notebook not in set(lessons_here)]
        if missing:
            notes.append(f"{len(missing)} of the {len(LESSONS)} lessons are not in this folder: each runs on its own; "
                         "clone the repository for the rest.")
    return problems, notes

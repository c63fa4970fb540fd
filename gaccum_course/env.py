"""What this kernel runs on: versions, devices, and how a multi-process launch would run here."""

from __future__ import annotations

import os
import platform
import sys
from dataclasses import dataclass
from importlib import metadata

from gaccum_lib.launch import gpu_count

PACKAGES = ("torch", "accelerate", "numpy", "matplotlib", "ipywidgets", "jupyterlab", "nbmake")


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

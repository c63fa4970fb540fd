"""Write the bytecode (.pyc) of every module the suite imports, and only of those.

`make env` installs without byte-compiling (uv does not; pip gets `--no-compile`), which would cover every
module of every package, 275 MiB of .pyc of which the lessons, tests and JupyterLab import
about a fifth (transformers alone ships hundreds of models; two are used here). Importing the
suite's entry points with bytecode writing switched on makes Python write exactly the .pyc
those imports need, so imports stay as fast as with pip's full compile (this matters where
PYTHONDONTWRITEBYTECODE is set, as on CI machines: nothing would be cached later).

A module imported later that is not listed here still works: it is compiled in memory when
imported (or cached then, where bytecode writing is allowed).

pytest keeps bytecode of its own for its plugins' packages (hypothesis, nbmake, xdist, anyio, ...):
it rewrites their asserts and caches the result beside the plain .pyc, under another name. Where
bytecode writing is off, each pytest process rewrote them again: 3-4 s of CPU per process here,
in every nbmake run and every xdist worker. One tiny pytest session with writing on, run with one
xdist worker so that the worker's modules are imported too, caches them.
"""

import importlib
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

# Two groups, imported in two processes at once (compiling is CPU-bound: two cores, half the time).
GROUPS = [
    [  # the lessons and the library, with transformers' Trainer and the two model families lesson 08 builds
        "gaccum_lib", "gaccum_lib.real_stack", "gaccum_check", "gaccum_course.plots", "gaccum_course.widgets",
        "gaccum_course.exercises", "gaccum_course.benchmarks", "gaccum_course.env", "gaccum_course.lessons",
        "gaccum_course.lesson10_plots", "gaccum_lib.hosts", "gaccum_lib.memory", "gaccum_lib.schedule",
        "gaccum_lib.sharded", "gaccum_lib.rl_losses", "gaccum_lib.unaccumulable", "torch._dynamo",
        "torch.multiprocessing", "torch.nn.parallel",
        "accelerate", "accelerate.utils", "matplotlib.pyplot", "matplotlib.backends.backend_agg",
        "ipywidgets", "psutil", "transformers", "transformers.trainer", "transformers.training_args",
        "transformers.models.gpt2.modeling_gpt2", "transformers.models.llama.modeling_llama",
    ],
    [  # JupyterLab and the kernel; the checks: pytest and its plugins, notebook tools, the browser driver
        "ipykernel.kernelapp", "ipykernel.ipkernel", "matplotlib_inline.backend_inline", "jupyter_server.serverapp",
        "jupyterlab.labapp", "pytest", "_pytest.python", "xdist.plugin", "nbmake.pytest_plugin", "hypothesis",
        "nbclient", "nbformat", "nbconvert", "jupytext", "playwright.sync_api", "pytest_playwright.pytest_playwright",
        # Imported lazily, during a lesson or in launched ranks, so not by the entries above. Listed from a run of
        # every lesson that logged each module compiled from source (none was cached): DeepSpeed alone, imported
        # by Accelerate's unwrap_model in the kernel and in every rank, compiled 449 files (1.1 s) 15 times.
        "deepspeed", "torch.distributed.algorithms.ddp_comm_hooks", "torch.distributed.launcher.api",
        "torch.distributed.elastic.rendezvous.static_tcp_rendezvous", "torch.utils.serialization",
        "torch.profiler._cupti_monitor",
        "PIL.BmpImagePlugin", "PIL.GifImagePlugin", "PIL.JpegImagePlugin", "PIL.PpmImagePlugin", "zmq.utils.garbage",
        "tqdm.notebook", "transformers.utils.notebook", "contourpy", "packaging.requirements",
    ],
]


def import_group(names: list) -> int:
    sys.dont_write_bytecode = False  # overrides PYTHONDONTWRITEBYTECODE in this worker
    # DeepSpeed imported for its bytecode: no device probe, no notice (on a GPU machine its CUDA accelerator's
    # modules are left to be compiled when first imported)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    for name in names:
        importlib.import_module(name)
    if "transformers" in names:  # lazy attributes: transformers imports their modules on first access
        import transformers

        for attribute in ("Trainer", "TrainingArguments", "GPT2LMHeadModel", "LlamaForCausalLM", "GPT2Config",
                          "LlamaConfig"):
            getattr(transformers, attribute)
    return len(sys.modules)


def cache_pytest_rewrites() -> None:
    """Run one passing test, bytecode writing on, so pytest caches its plugins' rewritten modules."""
    environment = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "test_nothing.py").write_text("def test_nothing():\n    pass\n")
        # Hypothesis's plugin imports hypothesis only at the session's end: the session must run a test.
        subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "1", "test_nothing.py"],
                       cwd=folder, env=environment, check=True, capture_output=True)


def main() -> int:
    start = time.perf_counter()
    with ProcessPoolExecutor(len(GROUPS), mp_context=multiprocessing.get_context("spawn")) as pool:
        counts = list(pool.map(import_group, GROUPS))
    cache_pytest_rewrites()
    seconds = time.perf_counter() - start
    print(f">> bytecode written for the {sum(counts)} modules the suite imports, in {seconds:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

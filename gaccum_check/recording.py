"""Record what every optimizer update did, in code that was never written to be checked.

torch calls a *global* optimizer hook around every ``optimizer.step()`` of every optimizer in
the process, Accelerate's and the Trainer's included (their wrappers call the inner
optimizer's ``step`` only on a real update, so a skipped step records nothing). Before the
step the hook copies the weights and the gradient the step is about to use (after DDP's
averaging and after any clipping); after it, the weights. Global module hooks note which rows
the model was fed before each update (:class:`~gaccum_check.rows.FeedRecorder`). That is all
:mod:`gaccum_check.invariance` compares, so a training function, a script or ``Trainer.train()``
is checked without a line of it changed.

``python -m gaccum_check.recording OUT_DIR script.py [args...]`` runs a script as
``python script.py args`` would, records, and leaves ``OUT_DIR/rank<RANK>.pt`` (torchrun's
``RANK``, 0 without it) however the script ends: with the script's own exception and when it
was raised, if it raised (under torchrun only the failing rank's traceback tells what went wrong).
"""

from __future__ import annotations

import contextlib
import os
import runpy
import sys
import time
import traceback
from pathlib import Path

import torch
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from .rows import FeedRecorder


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).to("cpu", torch.float64) for t in tensors])


def layer_concern(module) -> str | None:
    """What makes this layer's output depend on the batch it sees or on chance, in training; None if nothing."""
    if not module.training:
        return None
    if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
        return f"batch statistics: {type(module).__name__}"  # normalises with the statistics of the batch it sees
    if isinstance(module, torch.nn.modules.dropout._DropoutNd) and module.p > 0:
        return f"randomness: {type(module).__name__}(p={module.p:g})"
    return None


class UpdateRecorder:
    """Weights before and after, and the gradient used, of every optimizer update in this process.

    It also notes the layers that would make the comparison meaningless or impossible: dropout
    in training (its masks depend on the batch's shape) and batch statistics (BatchNorm).
    """

    def __init__(self):
        self.before, self.after, self.gradients = [], [], []
        self.concerns: set[str] = set()
        self.feeds = FeedRecorder()
        self._seen: set[int] = set()

    def _forward_pre(self, module, args):
        self.feeds.forward_started()
        if id(module) not in self._seen:  # look at each module once: this runs on every forward
            self._seen.add(id(module))
            concern = layer_concern(module)
            if concern is not None:
                self.concerns.add(concern)

    def _params(self, optimizer):
        return [p for group in optimizer.param_groups for p in group["params"]]

    def _forward_post(self, module, args, kwargs, output):
        self.feeds.forward_ended(module, args, kwargs)

    def _pre_step(self, optimizer, args, kwargs):
        self.feeds.update_done()
        params = self._params(optimizer)
        self.before.append(_flat(params))
        self.gradients.append(_flat(p.grad if p.grad is not None else torch.zeros_like(p) for p in params))

    def _post_step(self, optimizer, args, kwargs):
        self.after.append(_flat(self._params(optimizer)))

    @contextlib.contextmanager
    def recording(self):
        handles = [register_optimizer_step_pre_hook(self._pre_step), register_optimizer_step_post_hook(self._post_step),
                   register_module_forward_pre_hook(self._forward_pre),
                   register_module_forward_hook(self._forward_post, with_kwargs=True, always_call=True)]
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()

    def result(self) -> dict:
        """What one process did: tensors of shape (updates, weights); empty when it never stepped."""
        if len({len(w) for w in self.before}) > 1:
            raise RuntimeError("the optimizer updates did not all see the same weights (several optimizers, or "
                               "parameters added while training): only one optimizer over fixed parameters is checked")
        stack = lambda rows: torch.stack(rows) if rows else torch.zeros(0, 0, dtype=torch.float64)  # noqa: E731
        return {"before": stack(self.before), "after": stack(self.after), "gradients": stack(self.gradients),
                "concerns": sorted(self.concerns), **self.feeds.result()}


def record_call(function, *args):
    """``function(*args)`` with every update recorded: ``{"result": what it returned, **UpdateRecorder.result()}``."""
    recorder = UpdateRecorder()
    with recorder.recording():
        returned = function(*args)
    return {"result": returned, **recorder.result()}


def script_traceback(exc: BaseException) -> str:
    """The exception as Python prints it, without the frames of this module and runpy above the script's."""
    frames = traceback.extract_tb(exc.__traceback__)
    ours = [i for i, f in enumerate(frames) if f.filename == __file__ or f.filename.startswith("<frozen runpy")]
    frames = frames[(ours[-1] + 1 if ours and ours == list(range(len(ours))) else 0):]
    return "Traceback (most recent call last):\n" + "".join(traceback.format_list(frames)) + \
        "".join(traceback.format_exception_only(exc))


def run_script_recorded(out_dir: str, script: str, script_args: list[str]) -> int:
    """Run ``script`` as ``__main__`` with ``script_args`` and save this process's updates in ``out_dir``."""
    recorder = UpdateRecorder()
    sys.argv = [script, *script_args]
    sys.path.insert(0, str(Path(script).resolve().parent))  # as `python script.py` puts the script's folder first
    status, error = 0, None
    try:
        with recorder.recording():
            runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:  # the script's own sys.exit(main()): keep its status, print its message
        status = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
            error = {"text": str(exc.code), "time": time.time()}
    except BaseException as exc:  # noqa: BLE001 -- the script's, printed as Python would and kept in its file
        error = {"text": script_traceback(exc), "time": time.time()}
        print(error["text"], file=sys.stderr, end="")
        status = 130 if isinstance(exc, KeyboardInterrupt) else 1
    finally:
        path = Path(out_dir) / f"rank{os.environ.get('RANK', '0')}.pt"
        torch.save({**recorder.result(), "error": error}, path.with_suffix(".tmp"))
        path.with_suffix(".tmp").rename(path)
    return status


if __name__ == "__main__":
    if len(sys.argv) < 3:
        raise SystemExit("usage: python -m gaccum_check.recording OUT_DIR script.py [script arguments...]")
    code = run_script_recorded(sys.argv[1], sys.argv[2], sys.argv[3:])
    sys.stdout.flush()
    sys.stderr.flush()
    # Leave without Python's teardown, once the rank's file is saved: freeing a DDP model or the gloo process
    # group there can deadlock (the group's destructor joins gloo's worker thread while holding the GIL, and the
    # worker frees a finished all-gather, which needs the GIL; seen here with Accelerate's examples on 2 CPU
    # processes). The recorder keeps the models it saw alive until then, so the script's own return frees none.
    os._exit(code)

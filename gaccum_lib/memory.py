"""Measure the memory a training step needs, as the batch grows or as accumulation steps grow.

The part of training memory that grows with the batch is the *activations*: tensors the
forward pass saves for the backward pass. :class:`SavedTensorTracker` follows every tensor
autograd saves (``torch.autograd.graph.saved_tensors_hooks``) from the forward that saves it
to the backward that frees it, so it knows how many bytes are held at every moment of a
whole update -- all micro-batches, each storage counted once -- and the peak. It measures
what autograd really keeps, on CPU or GPU, not a formula: a loop that keeps micro-batch
graphs alive (one backward of the summed loss) shows up as memory that grows with GA.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ._checks import check_choice, check_int
from .data import _seeded_init

BACKWARDS = {"each": "a backward per micro-batch", "summed": "one backward of the summed loss"}


class _Held:
    """What autograd stores instead of a saved tensor; dies when autograd frees it."""

    __slots__ = ("tensor", "tracker", "key")

    def __init__(self, tensor, tracker, key):
        self.tensor, self.tracker, self.key = tensor, tracker, key

    def __del__(self):
        self.tracker._release(self.key)


class SavedTensorTracker:
    """Bytes autograd holds for backward passes while the block runs: ``live`` now, ``peak`` so far.

    Storages of ``exclude`` (the weights, which exist anyway) are not counted.
    """

    def __init__(self, exclude=()):
        self._excluded = {t.untyped_storage().data_ptr() for t in exclude}
        self._holders: dict[int, list] = {}  # storage pointer -> [saved tensors holding it, bytes]
        self.live = 0
        self.peak = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, tensor):
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in self._excluded:
            return tensor
        entry = self._holders.setdefault(key, [0, storage.nbytes()])
        if entry[0] == 0:
            self.live += entry[1]
            self.peak = max(self.peak, self.live)
        entry[0] += 1
        return _Held(tensor, self, key)

    @staticmethod
    def _unpack(packed):
        return packed.tensor if isinstance(packed, _Held) else packed

    def _release(self, key) -> None:
        entry = self._holders[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.live -= entry[1]
            del self._holders[key]

    def __enter__(self) -> SavedTensorTracker:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


def memory_demo_model(width: int = 1024, depth: int = 3, features: int = 256, seed: int = 0) -> nn.Module:
    """The demo's MLP; at the defaults, 18.0 MiB of weights + gradients, 0.78 MiB of activations per 32 rows."""
    check_int("width", width, minimum=1, maximum=16384)
    check_int("depth", depth, minimum=1, maximum=32)
    check_int("features", features, minimum=1, maximum=16384)

    def build():
        layers, size = [], features
        for _ in range(depth):
            layers += [nn.Linear(size, width), nn.GELU()]
            size = width
        return nn.Sequential(*layers, nn.Linear(size, 1))

    return _seeded_init(seed, build)


@dataclass(frozen=True)
class StepMemory:
    """Memory of one optimizer update, in bytes."""

    micro_batch_size: int
    grad_accum_steps: int
    parameters: int
    gradients: int
    peak_activations: int

    @property
    def effective_batch(self) -> int:
        return self.micro_batch_size * self.grad_accum_steps

    @property
    def peak(self) -> int:
        """Weights + gradients + the largest set of activations alive at once."""
        return self.parameters + self.gradients + self.peak_activations


def peak_step_memory(model: nn.Module, micro_batch_size: int, grad_accum_steps: int, *, backward: str = "each",
                     features: int = 256, seed: int = 0, device: str = "cpu") -> StepMemory:
    """Run one accumulated update (gradients only, no optimizer step) and measure its memory.

    ``grad_accum_steps`` forward passes of ``micro_batch_size`` examples, each loss divided by
    GA; ``backward="each"`` calls backward after every micro-batch (the accumulation loop),
    ``backward="summed"`` adds the losses up and calls backward once at the end (the same
    gradients, but every micro-batch's activations stay alive until then). Activations are
    tracked over the whole update; gradients are the bytes of ``.grad`` after it. ``device`` is
    where the inputs are made (the model must be there already): scripts/gpu_check.sh sets "cuda"
    to compare this count with ``torch.cuda.max_memory_allocated``.
    """
    check_int("micro_batch_size", micro_batch_size, minimum=1, maximum=65536)
    check_int("grad_accum_steps", grad_accum_steps, minimum=1, maximum=4096)
    check_choice("backward", backward, tuple(BACKWARDS))
    generator = torch.Generator(device=device).manual_seed(seed)
    model.zero_grad(set_to_none=True)
    with SavedTensorTracker(exclude=model.parameters()) as tracker:
        summed = 0.0
        for _ in range(grad_accum_steps):
            inputs = torch.randn(micro_batch_size, features, generator=generator, device=device)
            targets = torch.randn(micro_batch_size, 1, generator=generator, device=device)
            loss = nn.functional.mse_loss(model(inputs), targets) / grad_accum_steps
            if backward == "each":
                loss.backward()
            else:
                summed = summed + loss
        if backward == "summed":
            summed.backward()
    if tracker.live:
        raise RuntimeError(f"{tracker.live} bytes of saved activations outlived the backward pass")
    gradient_bytes = sum(p.grad.untyped_storage().nbytes() for p in model.parameters() if p.grad is not None)
    model.zero_grad(set_to_none=True)
    return StepMemory(micro_batch_size=micro_batch_size, grad_accum_steps=grad_accum_steps,
                      parameters=sum(p.numel() * p.element_size() for p in model.parameters()),
                      gradients=gradient_bytes, peak_activations=tracker.peak)


def memory_table(micro_batch_size: int = 32, accumulation_steps=(1, 2, 4, 8, 16), *, summed: bool = False,
                 **model_kwargs) -> dict:
    """Peak memory for growing effective batches: by a bigger batch, and by accumulation.

    Keys: ``"full_batch"`` (one batch of ``micro_batch_size x GA``), ``"accumulation"``
    (``GA`` micro-batches, a backward each) and, with ``summed=True``, ``"summed_loss"``
    (the same micro-batches, one backward of the summed loss).
    """
    check_int("micro_batch_size", micro_batch_size, minimum=1, maximum=65536)
    if isinstance(accumulation_steps, (str, bytes)) or not hasattr(accumulation_steps, "__iter__"):
        raise TypeError(f"accumulation_steps must be a sequence of ints, got {type(accumulation_steps).__name__}")
    steps = [check_int(f"accumulation_steps[{i}]", ga, minimum=1, maximum=4096)
             for i, ga in enumerate(accumulation_steps)]
    if not steps:
        raise ValueError("accumulation_steps must hold at least one GA, got an empty sequence")
    model = memory_demo_model(**model_kwargs)
    features = model[0].in_features
    table = {"full_batch": [peak_step_memory(model, micro_batch_size * ga, 1, features=features) for ga in steps],
             "accumulation": [peak_step_memory(model, micro_batch_size, ga, features=features) for ga in steps]}
    if summed:
        table["summed_loss"] = [peak_step_memory(model, micro_batch_size, ga, backward="summed", features=features)
                                for ga in steps]
    return table

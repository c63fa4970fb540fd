"""Measure the memory a training step needs, as the batch grows or as accumulation steps grow.

The part of training memory that grows with the batch is the *activations*: tensors the
forward pass saves for the backward pass. :func:`saved_activation_bytes` measures them by
hooking every tensor autograd saves (``torch.autograd.graph.saved_tensors_hooks``), counting
each storage once. It is a measurement of what autograd really keeps, on CPU or GPU, not a
formula; on a GPU :func:`peak_step_memory` also reports CUDA's allocator peak.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ._checks import check_int


def memory_demo_model(width: int = 1024, depth: int = 3, features: int = 256, seed: int = 0) -> nn.Module:
    """An MLP wide enough that its activations dominate: the model of the memory demo."""
    check_int("width", width, minimum=1, maximum=16384)
    check_int("depth", depth, minimum=1, maximum=32)
    check_int("features", features, minimum=1, maximum=16384)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        layers, size = [], features
        for _ in range(depth):
            layers += [nn.Linear(size, width), nn.GELU()]
            size = width
        return nn.Sequential(*layers, nn.Linear(size, 1))


def saved_activation_bytes(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> int:
    """Bytes autograd keeps for the backward of one forward pass (each storage counted once)."""
    seen: dict[int, int] = {}
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:  # weights exist anyway; only count batch-sized tensors
            seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = nn.functional.mse_loss(model(inputs), targets)
    loss.backward()
    model.zero_grad(set_to_none=True)
    return sum(seen.values())


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


def peak_step_memory(model: nn.Module, micro_batch_size: int, grad_accum_steps: int, *, features: int = 256,
                     seed: int = 0) -> StepMemory:
    """Measure one accumulated update: ``grad_accum_steps`` forward/backward passes of ``micro_batch_size``.

    Activations of one micro-batch are freed by its backward before the next forward, so
    the peak is the largest single micro-batch's activations, whatever ``grad_accum_steps``.
    """
    check_int("micro_batch_size", micro_batch_size, minimum=1, maximum=65536)
    check_int("grad_accum_steps", grad_accum_steps, minimum=1, maximum=4096)
    generator = torch.Generator().manual_seed(seed)
    peak = 0
    for _ in range(grad_accum_steps):
        inputs = torch.randn(micro_batch_size, features, generator=generator)
        targets = torch.randn(micro_batch_size, 1, generator=generator)
        peak = max(peak, saved_activation_bytes(model, inputs, targets))
    parameter_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return StepMemory(micro_batch_size=micro_batch_size, grad_accum_steps=grad_accum_steps,
                      parameters=parameter_bytes, gradients=parameter_bytes, peak_activations=peak)


def memory_table(micro_batch_size: int = 32, accumulation_steps=(1, 2, 4, 8, 16), **model_kwargs) -> dict:
    """Peak memory for growing effective batches: by a bigger batch, and by accumulation."""
    model = memory_demo_model(**model_kwargs)
    features = model[0].in_features
    full, accumulated = [], []
    for ga in accumulation_steps:
        full.append(peak_step_memory(model, micro_batch_size * ga, 1, features=features))
        accumulated.append(peak_step_memory(model, micro_batch_size, ga, features=features))
    return {"full_batch": full, "accumulation": accumulated}

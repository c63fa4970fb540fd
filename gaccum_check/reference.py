"""The full-batch reference of :func:`~gaccum_check.check_accumulation`, and its arguments' checks.

The reference is the chosen optimizer stepping once per window on the full batch's mean
gradient (every micro-batch's summed-loss gradient, added up, over the window's targets),
from the same initial weights as the user's loop, with the optimizer settings the user's
optimizer had when each window began (a scheduler stepped once per update is followed), and
clipped to ``max_grad_norm`` when one is given. A ``loss_fn`` that returns a mean, not a sum,
is refused before anything is compared; a model that is not deterministic is named.

Two things can make the reference itself differ from one forward over the whole window, and
are named instead of judged: a batch-dependent layer (BatchNorm in training mode normalises
each micro-batch by its own statistics) and lower precision (autocast in the user's step:
the gradients then agree only to a rounding floor of that precision).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from .inputs import build_model, checked_loss, trainable
from .ranks import flat, flat_grads, optimizer_settings

# A relative tolerance or rounding floor at or above this could not tell a 5 % error from a pass.
LOOSEST = 0.05
# Rounding floor, in units of the dtype's eps times the size of what is compared.
FLOOR_EPS = 4.0
# Lower precision (autocast): the gradients agree to this many units of roundoff of the lower dtype, times the
# micro-batches' cancellation. Measured on the lessons' float32 transformers: 2-3 units in bf16; float16 also
# flushes small activation gradients (its smallest normal number is 6.1e-5) unless a GradScaler scales the
# loss, 5-7 units there, so it gets twice the margin.
PRECISION_UNITS = {torch.bfloat16: 8.0, torch.float16: 16.0}
# The whole window's loss must equal the sum of its micro-batches' to this (float32 rounding of a 16-row sum is
# ~1e-6) before one pass over the whole window stands in for the micro-batches' passes.
ADDITIVE_RTOL = 1e-5
# torch.nn.utils.clip_grad_norm_ divides max_norm by (total norm + this).
CLIP_EPS = 1e-6


def _gradients(model, params, micro_batches, loss_fn):
    """Each micro-batch's gradient of its summed loss (from a fresh copy of it), its number of targets, its loss."""
    grads = np.zeros((len(micro_batches), sum(p.numel() for p in params)))
    counts, losses = [], []
    with torch.enable_grad():  # the caller may be inside torch.no_grad()
        for k, batch in enumerate(micro_batches):
            for p in params:
                p.grad = None
            loss, count = checked_loss(loss_fn(model, copy.deepcopy(batch)), k)
            loss.backward()
            grads[k] = flat_grads(params)
            counts.append(count)
            losses.append(loss.detach())
    for p in params:
        p.grad = None
    return grads, counts, losses


def _additive_whole(model, micro_batches, loss_fn, losses, counts):
    """The window as one batch when ``loss_fn`` adds up over it (one forward shows it), else None.

    Window 2 needs only the window's summed gradient, not each micro-batch's: one pass over the
    concatenated window gives it where the loss of the whole is the sum of the micro-batches' losses
    (no batch-dependent layer, no in-batch negatives). Measured at the initial weights, in one forward.
    """
    if len(micro_batches) == 1:
        return None
    whole, _ = concatenated(micro_batches)
    if whole is None:
        return None
    with torch.no_grad():
        loss, count = checked_loss(loss_fn(model, copy.deepcopy(whole)), "the whole window concatenated")
    summed = float(sum(float(x) for x in losses))
    if count != sum(counts) or abs(float(loss) - summed) > ADDITIVE_RTOL * max(abs(summed), 1e-30):
        return None
    return whole


def _summed_gradient(model, params, micro_batches, loss_fn, whole) -> np.ndarray:
    """The gradient of the window's summed loss: one pass over ``whole`` when given, else one per micro-batch."""
    if whole is None:
        return _gradients(model, params, micro_batches, loss_fn)[0].sum(axis=0)
    with torch.enable_grad():
        for p in params:
            p.grad = None
        loss, _ = checked_loss(loss_fn(model, copy.deepcopy(whole)), "the whole window concatenated")
        loss.backward()
    gradient = flat_grads(params)
    for p in params:
        p.grad = None
    return gradient


def _hand(params, gradient: np.ndarray) -> None:
    """Set every parameter's .grad from one flat vector, as the optimizer would be handed it."""
    start = 0
    for p in params:
        p.grad = torch.from_numpy(gradient[start:start + p.numel()]).reshape(p.shape).to(p.device, p.dtype)
        start += p.numel()


def clipped(gradient: np.ndarray, max_norm: float | None) -> np.ndarray:
    """``torch.nn.utils.clip_grad_norm_(params, max_norm)`` on one flat gradient (unchanged without max_norm)."""
    if max_norm is None:
        return gradient
    coefficient = max_norm / (float(np.linalg.norm(gradient)) + CLIP_EPS)
    return gradient * coefficient if coefficient < 1.0 else gradient


def _apply_settings(optimizer, settings) -> None:
    """Give the optimizer's param groups these settings (lr, momentum, ...), group by group."""
    for group, chosen in zip(optimizer.param_groups, settings, strict=False):
        for key, value in chosen.items():
            group[key] = value.clone() if isinstance(value, torch.Tensor) else copy.deepcopy(value)


# --- inputs the comparison would be misleading on --------------------------------------------------------


def _doubled(batch):
    """The micro-batch with every row twice, when it is a mapping of tensors sharing their first dimension."""
    if not isinstance(batch, Mapping) or not batch or not all(isinstance(v, torch.Tensor) and v.ndim
                                                               for v in batch.values()):
        return None
    if len({v.shape[0] for v in batch.values()}) != 1:
        return None
    return {k: torch.cat([v, v]) for k, v in batch.items()}


def _refuse_a_mean_loss(model, batch, loss_fn, first: torch.Tensor, count: int) -> None:
    """A ValueError for a loss_fn that returns a mean: with every row of micro-batch 0 twice, a sum doubles.

    ``first`` is micro-batch 0's loss from the gradient pass, so the doubled forward is the only extra one.
    Duplicating every row leaves a batch's mean and variance as they were: this holds under BatchNorm too.
    """
    doubled = _doubled(batch)
    if doubled is None or count == 0:
        return
    with torch.no_grad():
        twice, twice_count = checked_loss(loss_fn(model, doubled), 0)
    if twice_count == 2 * count and float(first) != 0.0 and abs(float(twice) - float(first)) <= \
            1e-5 * abs(float(first)):
        raise ValueError(f"loss_fn returns the mean loss, not the summed loss: micro-batch 0 with every row "
                         f"twice gives the same loss ({float(first):.6g}) for twice the targets "
                         f"({count} -> {twice_count}); return the sum (reduction='sum') and the count")


def nondeterminism(model, micro_batches, loss_fn) -> str | None:
    """The diagnosis for a model whose two identical forward passes differ (dropout in train mode), or None.

    Asked only when a check fails: a model that is not deterministic cannot pass, so a pass needs no such proof.
    """
    with torch.no_grad():
        first, _ = checked_loss(loss_fn(model, copy.deepcopy(micro_batches[0])), 0)
        again, _ = checked_loss(loss_fn(model, copy.deepcopy(micro_batches[0])), 0)
    if torch.equal(first, again):
        return None
    return (f"model is not deterministic: two identical forward passes of micro-batch 0 gave losses "
            f"{float(first):.10g} and {float(again):.10g}, so no two runs can be compared; dropout in train "
            "mode or unseeded randomness? Build the model with model.eval() (or dropout 0) for the check")


# --- what makes the reference differ from one forward over the whole window ----------------------------------


def batch_dependent_layers(model) -> list[str]:
    """Layers whose output for one row depends on the other rows of its batch: BatchNorm using batch statistics.

    Per-sample normalisations (LayerNorm, GroupNorm, InstanceNorm, RMSNorm) do not depend on the batch.
    """
    found = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.modules.batchnorm._BatchNorm):  # BatchNorm1d/2d/3d, SyncBatchNorm, Lazy*
            continue
        if module.training:
            found.append(f"{type(module).__name__} at '{name}' in training mode")
        elif module.running_mean is None:
            found.append(f"{type(module).__name__} at '{name}' without running statistics (track_running_stats"
                         "=False, so it normalises by the batch in eval mode too)")
    return found


def _tensor_parts(batch):
    """(layout, tensors) of a batch that is a tensor, a mapping of tensors or a tuple/list of tensors; else None."""
    if isinstance(batch, torch.Tensor):
        return ("tensor",), [batch]
    if isinstance(batch, Mapping):
        parts = (("mapping", *batch.keys()), list(batch.values()))
    elif isinstance(batch, tuple | list):
        parts = ((type(batch).__name__, len(batch)), list(batch))
    else:
        return None
    return parts if all(isinstance(t, torch.Tensor) and t.ndim >= 1 for t in parts[1]) else None


def concatenated(micro_batches):
    """The whole window as one batch (every micro-batch's rows after each other) and None, or None and why not."""
    parts = [_tensor_parts(b) for b in micro_batches]
    if any(p is None for p in parts) or len({p[0] for p in parts}) != 1:
        return None, "they are not all tensors, or mappings / tuples of tensors with the same keys"
    layout = parts[0][0]
    names = list(layout[1:]) if layout[0] == "mapping" else list(range(len(parts[0][1])))
    for slot, name in enumerate(names):
        trailing = {tuple(p[1][slot].shape[1:]) for p in parts}
        if len(trailing) > 1:
            where = f"'{name}'" if layout[0] == "mapping" else f"part {name}"
            return None, f"their {where} have different trailing shapes ({', '.join(map(str, sorted(trailing)))})"
    whole = [torch.cat([p[1][slot] for p in parts]) for slot in range(len(names))]
    if layout[0] == "tensor":
        return whole[0], None
    if layout[0] == "mapping":
        return dict(zip(names, whole, strict=True)), None
    return type(micro_batches[0])(whole), None


def full_batch_distance(make_model, known_params, w0, micro_batches, loss_fn, accumulated):
    """How far accumulation's gradient is from one forward over the whole window (relative), or (None, why not)."""
    whole, why_not = concatenated(micro_batches)
    if whole is None:
        return None, why_not
    model = build_model(make_model, known_params, w0)
    params = trainable(model)
    with torch.enable_grad():
        loss, count = checked_loss(loss_fn(model, whole), "the whole window concatenated")
        loss.backward()
    full = flat_grads(params) / max(count, 1)
    return float(np.linalg.norm(accumulated - full)) / max(float(np.linalg.norm(full)), 1e-300), None


@dataclass(frozen=True)
class Precision:
    """The lower precision a step's forward ran in (autocast), and the rounding floor it gives the gradient."""

    dtype: torch.dtype
    device: str
    unit: float  # unit roundoff: half the distance from 1 to the next number (torch.finfo eps / 2)
    units: float
    floor: float  # relative: units x unit x the micro-batches' cancellation

    @property
    def name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    def describe(self) -> str:
        return (f"the model's forward ran under torch.autocast(\"{self.device}\", dtype=torch.{self.name}) inside "
                f"your step, while the reference runs in the model's dtype: {self.name}'s unit roundoff is "
                f"2^{round(math.log2(self.unit))} = {self.unit:.1e}, so the gradients can differ by rounding alone; "
                f"the check allows {self.units:g} units of it (times how much the micro-batches' gradients "
                f"cancel), {self.floor:.1e} relative, on top of tol")


def lowered_precision(autocast, param_dtypes, cancellation: float) -> Precision | None:
    """The coarsest autocast dtype the forward ran under, when it lowers the model's precision; else None."""
    if torch.float32 not in param_dtypes:  # autocast casts float32 tensors only (a float64 model is not cast)
        return None
    lower = [(device, dtype) for device, dtype in autocast
             if torch.finfo(dtype).eps > torch.finfo(torch.float32).eps]
    if not lower:
        return None
    device, dtype = max(lower, key=lambda pair: torch.finfo(pair[1]).eps)
    unit = torch.finfo(dtype).eps / 2
    units = PRECISION_UNITS.get(dtype, max(PRECISION_UNITS.values()))
    return Precision(dtype=dtype, device=device, unit=unit, units=units, floor=units * unit * cancellation)


# --- the reference ----------------------------------------------------------------------------------


@dataclass
class Reference:
    """The full batch from the initial weights: what every process count's run is compared with."""

    w0: np.ndarray
    grads: np.ndarray  # each micro-batch's summed-loss gradient at w0
    counts: list
    mean_grads: np.ndarray  # [window]: the full batch's mean gradient, before any clip
    eps: float  # the model dtype's
    gradient_floor: float  # rounding of adding the micro-batches' gradients up in the model's dtype (relative)
    cancellation: float  # |sum of the micro-batches' |gradient|| / |sum of their gradients|
    max_grad_norm: float | None
    batch_dependent: list
    model: nn.Module
    param_dtypes: set
    make_optimizer: object
    first_weights: np.ndarray  # after window 1
    before_shift: list | None = None
    _live: tuple = ()  # (params, optimizer) after window 1, before window 2
    _second: dict = field(default_factory=dict)  # settings of window 2 -> weights after it

    def handed(self, window: int) -> np.ndarray:
        """The gradient the full batch hands its optimizer in this window (clipped to max_grad_norm, if given)."""
        return clipped(self.mean_grads[window], self.max_grad_norm)

    def clip_binds(self, window: int = 0) -> bool:
        return self.max_grad_norm is not None and float(np.linalg.norm(self.mean_grads[window])) > self.max_grad_norm

    def step_second_windows(self, settings_list) -> None:
        """Step window 2 once for each distinct setting the runs' optimizers had when it began (a scheduler)."""
        distinct = {repr(s): s for s in settings_list if repr(s) not in self._second}
        for n, (key, settings) in enumerate(distinct.items()):
            # Each from the state after window 1: a copy for all but the last, which may use the live one.
            params, optimizer = self._live if n == len(distinct) - 1 else copy.deepcopy(self._live)
            self._second[key] = self._step(params, optimizer, settings, self.handed(1))

    def weights(self, second_settings) -> np.ndarray:
        """The reference's weights after each window, window 2 with these settings."""
        self.step_second_windows([second_settings])
        return np.stack([self.first_weights, self._second[repr(second_settings)]])

    def replay(self, gradients, settings) -> np.ndarray:
        """Weights after the reference optimizer steps, from the initial weights, on these gradients.

        Under lower precision the update is judged this way: Adam divides each weight's step by the size of
        its gradient, so rounding of small gradient entries moves its update far more than the gradient.
        """
        params, start = [], 0
        for p in self._live[0]:
            values = torch.from_numpy(self.w0[start:start + p.numel()].copy()).reshape(p.shape)
            params.append(nn.Parameter(values.to(p.device, p.dtype)))
            start += p.numel()
        optimizer = self.make_optimizer(params)
        weights = []
        for gradient, chosen in zip(gradients, settings, strict=True):
            if gradient is None:
                break
            weights.append(self._step(params, optimizer, chosen, gradient))
        return np.stack(weights)

    @staticmethod
    def _step(params, optimizer, settings, gradient) -> np.ndarray:
        _apply_settings(optimizer, settings)
        _hand(params, gradient)
        optimizer.step()
        return flat(params)


def reference(model, make_optimizer, micro_batches, loss_fn, max_grad_norm=None) -> Reference:
    """The initial weights, each micro-batch's gradient, the full batch's first update and second gradient.

    Window 2's update waits for :meth:`Reference.step_second_windows`: it follows the settings the
    user's optimizer has when window 2 begins, known only after the user's runs.
    """
    params = trainable(model)
    w0 = flat(params)
    batch_dependent = batch_dependent_layers(model)
    grads, counts, losses = _gradients(model, params, micro_batches, loss_fn)
    whole = None if batch_dependent else _additive_whole(model, micro_batches, loss_fn, losses, counts)
    if whole is None:  # a loss that adds up over the window is a sum (a mean adds up only where all but one is 0)
        _refuse_a_mean_loss(model, micro_batches[0], loss_fn, losses[0], counts[0])
    total = sum(counts)
    if total == 0:
        raise ValueError("loss_fn counts 0 targets in the whole window (micro_batches): there is no loss to "
                         "normalise; the window needs at least 1 target")
    if not np.any(grads.sum(axis=0)):
        raise ValueError("the full-batch gradient is exactly 0 at the initial weights: no loop could be told from "
                         "one that does nothing; use micro_batches / make_model whose loss has a gradient")
    eps = max(torch.finfo(p.dtype).eps for p in params)
    cancellation = float(np.linalg.norm(np.abs(grads).sum(axis=0))) / float(np.linalg.norm(grads.sum(axis=0)))
    # Summing the micro-batches' gradients in the model's dtype rounds by up to eps times the sum of their sizes.
    gradient_floor = FLOOR_EPS * eps * cancellation
    if gradient_floor >= LOOSEST:
        raise ValueError(f"the micro-batches' gradients cancel so much that rounding in {params[0].dtype} alone could "
                         f"move the full-batch gradient by {gradient_floor:.0%}: the check could not tell a 5 % error "
                         "from a pass; use float64 (make_model) or other micro_batches")
    optimizer = make_optimizer(params)
    first = grads.sum(axis=0) / total
    first_weights = Reference._step(params, optimizer, optimizer_settings(optimizer.param_groups),
                                    clipped(first, max_grad_norm))
    second = _summed_gradient(model, params, micro_batches, loss_fn, whole)
    return Reference(w0=w0, grads=grads, counts=counts, mean_grads=np.stack([first, second / total]),
                     eps=eps, gradient_floor=gradient_floor, cancellation=cancellation, max_grad_norm=max_grad_norm,
                     batch_dependent=batch_dependent, model=model, param_dtypes={p.dtype for p in params},
                     make_optimizer=make_optimizer, first_weights=first_weights, _live=(params, optimizer))

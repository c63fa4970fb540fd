"""Losses gradient accumulation cannot reproduce, measured, each with what to do instead.

Accumulation adds up micro-batch gradients. That equals the window's gradient only when the
window's loss is a (weighted) sum of terms that each look at **one example**. Three common
losses look at the whole batch at once, so a micro-batch sees a different loss, not a part of it:

1. **BatchNorm** normalises with the batch's mean and variance: every example's output depends
   on the others in its micro-batch. :func:`norm_case` measures BatchNorm against GroupNorm and
   LayerNorm, which normalise each example on its own and so accumulate exactly.
2. **In-batch negatives** (InfoNCE, CLIP-style contrastive losses): each query's negatives are the
   other keys of its batch, so a micro-batch has fewer, and easier, negatives.
   :func:`in_batch_negatives_case` measures that, and GradCache's remedy: embed the whole window
   without gradients, take the full-window loss's gradient with respect to the embeddings, then
   re-run each micro-batch with gradients and ``backward`` those embedding gradients.
3. **A mixture-of-experts load-balancing loss** (Switch Transformer's ``E * sum_e f_e * P_e``,
   ``f_e`` the fraction of tokens routed to expert e, ``P_e`` its mean router probability) is a
   product of two batch averages, not an average. :func:`load_balancing_case` measures the mean
   of the micro-batch losses against the window's, and the remedy: count ``f_e`` over the window
   first, then let every micro-batch add its share of ``P_e``.

Every function builds its seeded model and data, measures on one CPU thread and returns a small
dict of numbers; :func:`measure_all` gathers them, one row per case and GA.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from ._checks import check_choice, check_float, check_int
from ._threads import single_thread

NORMS = ("batch", "group", "layer")
IN_FEATURES, HIDDEN = 8, 16


def micro_batches(window: int, grad_accum_steps: int, *, smallest: int = 1) -> list[range]:
    """The window's example indices cut into ``grad_accum_steps`` equal, consecutive micro-batches."""
    check_int("window", window, minimum=2, maximum=4096)
    check_int("grad_accum_steps", grad_accum_steps, minimum=1, maximum=window // smallest)
    if window % grad_accum_steps:
        raise ValueError(f"grad_accum_steps must divide window={window} into equal micro-batches, "
                         f"got {grad_accum_steps}")
    size = window // grad_accum_steps
    return [range(k * size, (k + 1) * size) for k in range(grad_accum_steps)]


def flat_gradient(model: nn.Module) -> torch.Tensor:
    """Every parameter's ``.grad`` in one float64 vector (zeros where a parameter got none)."""
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).double()
                      for p in model.parameters()])


def relative_distance(value: torch.Tensor, reference: torch.Tensor) -> float:
    """``|value - reference| / |reference|`` (tensors or plain numbers)."""
    value, reference = torch.as_tensor(value, dtype=torch.float64), torch.as_tensor(reference, dtype=torch.float64)
    return float((value - reference).norm() / reference.norm())


def _gradient_of(model: nn.Module, backward_all) -> torch.Tensor:
    """Zero the gradients, let ``backward_all()`` run every backward of one update, return the summed gradient."""
    model.zero_grad(set_to_none=True)
    with single_thread():
        backward_all()
    return flat_gradient(model)


# ----------------------------------------------------------------------------------------------
# 1. BatchNorm: the statistics of the batch.
# ----------------------------------------------------------------------------------------------


def norm_net(norm: str = "batch", *, seed: int = 0) -> nn.Module:
    """Linear -> BatchNorm1d / GroupNorm(4 groups) / LayerNorm -> ReLU -> Linear; seeded, in train mode."""
    check_choice("norm", norm, NORMS)
    layers = {"batch": lambda: nn.BatchNorm1d(HIDDEN), "group": lambda: nn.GroupNorm(4, HIDDEN),
              "layer": lambda: nn.LayerNorm(HIDDEN)}
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN_FEATURES, HIDDEN), layers[norm](), nn.ReLU(), nn.Linear(HIDDEN, 1))


def norm_case(grad_accum_steps: int = 4, *, norm: str = "batch", window: int = 32, seed: int = 0) -> dict:
    """One update's gradient (mean squared error) over the whole window vs GA micro-batches' mean loss / GA."""
    # BatchNorm cannot normalise one example in training: it needs 2 per micro-batch.
    parts = micro_batches(window, grad_accum_steps, smallest=2 if norm == "batch" else 1)
    model = norm_net(norm, seed=seed)
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(window, IN_FEATURES, generator=generator)
    y = x.sum(1, keepdim=True) + 0.1 * torch.randn(window, 1, generator=generator)
    full = _gradient_of(model, lambda: F.mse_loss(model(x), y).backward())

    def accumulate():
        for part in parts:
            (F.mse_loss(model(x[part]), y[part]) / grad_accum_steps).backward()

    return {"norm": norm, "grad_accum_steps": grad_accum_steps, "distance": relative_distance(
        _gradient_of(model, accumulate), full)}


# ----------------------------------------------------------------------------------------------
# 2. In-batch negatives: InfoNCE, naive accumulation and GradCache.
# ----------------------------------------------------------------------------------------------


def encoder(*, seed: int = 0) -> nn.Module:
    """A small MLP that embeds queries and keys alike (one tower, shared weights)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN_FEATURES, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, IN_FEATURES))


def info_nce(queries: torch.Tensor, keys: torch.Tensor, temperature: float) -> torch.Tensor:
    """Query i's positive is key i; every other key of the batch is a negative. Mean over the queries."""
    logits = F.normalize(queries, dim=-1) @ F.normalize(keys, dim=-1).T / temperature
    return F.cross_entropy(logits, torch.arange(len(queries)))


def in_batch_negatives_case(grad_accum_steps: int = 4, *, window: int = 32, temperature: float = 0.1,
                            seed: int = 0) -> dict:
    """Full window vs naive accumulation vs GradCache: gradient distances to the full window, and losses."""
    parts = micro_batches(window, grad_accum_steps, smallest=2)  # one pair alone has no negative
    check_float("temperature", temperature, minimum=0.0, exclusive_minimum=True, maximum=100.0)
    model = encoder(seed=seed)
    generator = torch.Generator().manual_seed(seed)
    query_x = torch.randn(window, IN_FEATURES, generator=generator)
    key_x = query_x + 0.5 * torch.randn(window, IN_FEATURES, generator=generator)  # a noisy view of the query
    full_losses, naive_losses = [], []

    def whole_window():
        loss = info_nce(model(query_x), model(key_x), temperature)
        loss.backward()
        full_losses.append(float(loss.detach()))

    def naive():
        for part in parts:
            loss = info_nce(model(query_x[part]), model(key_x[part]), temperature)
            (loss / grad_accum_steps).backward()
            naive_losses.append(float(loss.detach()))

    def grad_cache():
        # Step 1: every embedding of the window, no graph kept (this is what saves the memory).
        with torch.no_grad():
            queries, keys = model(query_x), model(key_x)
        queries.requires_grad_(True)
        keys.requires_grad_(True)
        # Step 2: the full window's loss, differentiated with respect to the embeddings only.
        cached_q, cached_k = torch.autograd.grad(info_nce(queries, keys, temperature), (queries, keys))
        # Step 3: each micro-batch again, with a graph, fed its slice of the cached embedding gradients.
        for part in parts:
            torch.autograd.backward((model(query_x[part]), model(key_x[part])), (cached_q[part], cached_k[part]))

    full = _gradient_of(model, whole_window)
    return {"grad_accum_steps": grad_accum_steps, "full_loss": full_losses[0],
            "naive_distance": relative_distance(_gradient_of(model, naive), full),
            "naive_loss": sum(naive_losses) / len(naive_losses),
            "gradcache_distance": relative_distance(_gradient_of(model, grad_cache), full)}


# ----------------------------------------------------------------------------------------------
# 3. Mixture-of-experts load balancing: a product of two batch averages.
# ----------------------------------------------------------------------------------------------


def load_balancing_loss(routed_fraction: torch.Tensor, mean_probability: torch.Tensor) -> torch.Tensor:
    """Switch Transformer's auxiliary loss ``E * sum_e f_e * P_e`` (1 when perfectly balanced)."""
    return len(mean_probability) * (routed_fraction * mean_probability).sum()


def _route(router: nn.Module, tokens: torch.Tensor):
    """Router probabilities (tokens, E) and each expert's token count under top-1 routing (no gradient)."""
    probabilities = router(tokens).softmax(-1)
    counts = F.one_hot(probabilities.argmax(-1), probabilities.shape[-1]).sum(0).double()
    return probabilities, counts


def load_balancing_case(grad_accum_steps: int = 4, *, num_tokens: int = 64, num_experts: int = 4,
                        seed: int = 0) -> dict:
    """The window's loss vs the mean of per-micro-batch losses vs counts gathered over the window, and gradients."""
    parts = micro_batches(num_tokens, grad_accum_steps)
    check_int("num_experts", num_experts, minimum=2, maximum=64)
    torch.manual_seed(seed)
    router = nn.Linear(IN_FEATURES, num_experts)
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randn(num_tokens, IN_FEATURES, generator=generator)
    losses = {}

    def full():
        probabilities, counts = _route(router, tokens)
        losses["full"] = load_balancing_loss(counts / num_tokens, probabilities.mean(0))
        losses["full"].backward()

    def naive():
        losses["naive"] = 0.0
        for part in parts:
            probabilities, counts = _route(router, tokens[part])
            loss = load_balancing_loss(counts / len(part), probabilities.mean(0)) / grad_accum_steps
            loss.backward()
            losses["naive"] += float(loss.detach())

    def window_counts():
        # f_e needs the whole window's routing before the first backward (as token normalisation
        # needs the window's token count): a gradient-free routing pass is cheap, only the router runs.
        with torch.no_grad():
            fraction = sum(_route(router, tokens[part])[1] for part in parts) / num_tokens
        losses["fix"] = 0.0
        for part in parts:
            probabilities, _ = _route(router, tokens[part])
            # This micro-batch's share of P_e: its probabilities summed, over the window's token count.
            loss = load_balancing_loss(fraction, probabilities.sum(0) / num_tokens)
            loss.backward()
            losses["fix"] += float(loss.detach())

    reference = _gradient_of(router, full)
    naive_gradient, fix_gradient = _gradient_of(router, naive), _gradient_of(router, window_counts)
    full_loss = float(losses["full"].detach())
    return {"grad_accum_steps": grad_accum_steps, "full_loss": full_loss, "naive_loss": losses["naive"],
            "fix_loss": losses["fix"], "naive_loss_distance": relative_distance(losses["naive"], full_loss),
            "naive_distance": relative_distance(naive_gradient, reference),
            "fix_loss_distance": relative_distance(losses["fix"], full_loss),
            "fix_distance": relative_distance(fix_gradient, reference)}


def measure_all(grad_accum_steps=(2, 4, 8), *, seed: int = 0) -> list[dict]:
    """Every case at every GA: rows ``{case, grad_accum_steps, naive_distance, fix_distance, ...}``.

    For BatchNorm the "fix" is the same net with GroupNorm (and LayerNorm, as ``layer_distance``).
    """
    rows = []
    for ga in grad_accum_steps:
        batch, group, layer = (norm_case(ga, norm=n, seed=seed)["distance"] for n in NORMS)
        rows.append({"case": "batch_norm", "grad_accum_steps": ga, "naive_distance": batch, "fix_distance": group,
                     "layer_distance": layer})
        contrastive = in_batch_negatives_case(ga, seed=seed)
        rows.append({"case": "in_batch_negatives", **contrastive, "fix_distance": contrastive["gradcache_distance"]})
        rows.append({"case": "load_balancing", **load_balancing_case(ga, seed=seed)})
    return rows


__all__ = [
    "NORMS", "encoder", "flat_gradient", "in_batch_negatives_case", "info_nce", "load_balancing_case",
    "load_balancing_loss", "measure_all", "micro_batches", "norm_case", "norm_net", "relative_distance",
]

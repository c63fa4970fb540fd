"""GRPO-style policy-gradient losses under gradient accumulation: which ones equal their own full batch.

A GRPO step starts from a *generation batch*: G prompts, n completions each, of different
lengths. Each completion gets a reward; its *advantage* is the reward normalised within its
group, ``(r - group mean) / (group std + 1e-4)``. The per-token loss is ``-A * ratio`` with
``ratio = exp(logp - logp.detach())``: on the first (on-policy) step its value is ``-A`` but its
gradient is the policy gradient ``-A * grad logp``. How those per-token losses are added up is
the ``loss_type``, as TRL's GRPOTrainer describes its options:

``grpo``     mean over each sequence's tokens, then mean over the micro-batch's sequences;
``bnpo``     sum over the micro-batch's tokens / the micro-batch's number of completion tokens;
``dr_grpo``  sum over tokens / (sequences in the micro-batch x ``max_completion_length``);
``dapo``     sum over tokens / the completion tokens of the whole generation batch (all
             micro-batches, all processes), times the number of processes.

The first three are divided by GA before ``backward`` (as the Trainer does); dapo is not, because
its normaliser already counts the window, and the ``x P`` undoes DDP's mean over processes.

What is *measured* here (:func:`distance_table`): every loss type against **its own** full batch,
the same aggregation over the whole generation batch in one micro-batch on one process. The
micro-batches are dealt as Accelerate does (rank r gets micro-batches r, r + P, ...; see
:mod:`gaccum_lib.sharding`). Micro-batches that hold the same number of sequences make grpo and
dr_grpo exact (a mean of equal-sized means is the mean) and dapo exact (one global count);
bnpo divides each micro-batch by its own token count and drifts, GA = P = 1 excepted.
Exact is not the same objective: :func:`versus_token_mean` shows how far each full batch is
from the per-token mean that dapo optimises. With ``steps_per_generation`` larger than GA one
generation batch feeds several optimizer updates: :func:`steps_per_generation_table`.

All gradients are taken at the same weights (nothing is stepped), on one CPU thread, seeded.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._checks import check_choice, check_int
from ._threads import single_thread
from .lm import vocabulary
from .real_stack import quiet_transformers, tiny_causal_lm
from .sharding import plan_windows

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
ADVANTAGE_EPS = 1e-4  # TRL's: a group whose rewards are all equal gets advantage 0, not a division by 0
DAPO_COUNTS = ("generation", "window")


@dataclass(frozen=True)
class GenerationBatch:
    """Prompts and completions, already generated: row i is ``prompt + completion``, 0 after the completion."""

    input_ids: torch.Tensor        # (B, prompt_length + max_completion_length)
    completion_mask: torch.Tensor  # (B, max_completion_length), 1 on the completion's tokens
    rewards: torch.Tensor          # (B,)
    advantages: torch.Tensor       # (B,), normalised within each group
    group_size: int
    prompt_length: int

    @property
    def num_sequences(self) -> int:
        return self.input_ids.shape[0]

    @property
    def max_completion_length(self) -> int:
        return self.completion_mask.shape[1]

    def rows(self, indices) -> dict:
        """The model's inputs and the loss's masks for the sequences ``indices``."""
        completion_mask = self.completion_mask[indices]
        prompt_mask = torch.ones(len(indices), self.prompt_length, dtype=completion_mask.dtype)
        return {"input_ids": self.input_ids[indices], "attention_mask": torch.cat([prompt_mask, completion_mask], 1),
                "completion_mask": completion_mask, "advantages": self.advantages[indices]}


def group_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """GRPO's advantages: each reward minus its group's mean, over the group's std (+ 1e-4); groups are consecutive."""
    check_int("group_size", group_size, minimum=2)
    if rewards.ndim != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards must be 1-D with a multiple of group_size={group_size} values, "
                         f"got shape {tuple(rewards.shape)}")
    grouped = rewards.view(-1, group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    return (centred / (grouped.std(dim=1, keepdim=True) + ADVANTAGE_EPS)).reshape(-1)


def generation_batch(num_groups: int = 4, group_size: int = 4, *, prompt_length: int = 4,
                     max_completion_length: int = 8, seed: int = 0) -> GenerationBatch:
    """A fixed generation batch: seeded ids, completion lengths in [1, max_completion_length], rewards in [0, 1)."""
    check_int("num_groups", num_groups, minimum=1, maximum=64)
    check_int("group_size", group_size, minimum=2, maximum=64)
    check_int("prompt_length", prompt_length, minimum=1, maximum=32)
    check_int("max_completion_length", max_completion_length, minimum=1, maximum=64)
    check_int("seed", seed, minimum=0)
    generator = torch.Generator().manual_seed(seed)
    size, vocab = num_groups * group_size, vocabulary().size
    prompts = torch.randint(1, vocab, (num_groups, prompt_length), generator=generator).repeat_interleave(group_size, 0)
    lengths = torch.randint(1, max_completion_length + 1, (size, 1), generator=generator)
    completion_mask = (torch.arange(max_completion_length) < lengths).long()
    completions = torch.randint(1, vocab, (size, max_completion_length), generator=generator) * completion_mask
    rewards = torch.rand(size, generator=generator)
    return GenerationBatch(torch.cat([prompts, completions], 1), completion_mask, rewards,
                           group_advantages(rewards, group_size), group_size, prompt_length)


def check_batch(batch) -> GenerationBatch:
    if not isinstance(batch, GenerationBatch):
        raise TypeError(f"batch must be a GenerationBatch (e.g. generation_batch()), got {type(batch).__name__}")
    return batch


def tiny_policy(seed: int = 0):
    """A one-layer ``LlamaForCausalLM`` built from a config (hidden 16, the shipped text's 49 ids); seeded."""
    quiet_transformers()
    return tiny_causal_lm("llama", seed=seed, hidden_size=16, num_layers=1, num_heads=2)


def per_token_loss(policy, rows: dict, prompt_length: int) -> torch.Tensor:
    """``-A * exp(logp - logp.detach())`` for every completion position (padding included; the mask drops it)."""
    logits = policy(input_ids=rows["input_ids"], attention_mask=rows["attention_mask"]).logits
    # Position t predicts token t + 1: the completion's tokens are predicted from prompt_length - 1 on.
    predicting = logits[:, prompt_length - 1:-1].log_softmax(-1)
    logp = predicting.gather(-1, rows["input_ids"][:, prompt_length:, None]).squeeze(-1)
    return -rows["advantages"][:, None] * torch.exp(logp - logp.detach())


def aggregate(loss_type: str, token_loss: torch.Tensor, completion_mask: torch.Tensor, *,
              max_completion_length: int, num_items_in_batch: int | None = None, num_processes: int = 1):
    """One micro-batch's loss, as TRL's GRPOTrainer ``loss_type`` describes it (before any / GA)."""
    check_choice("loss_type", loss_type, LOSS_TYPES)
    summed = token_loss * completion_mask
    if loss_type == "grpo":
        return (summed.sum(-1) / completion_mask.sum(-1).clamp(min=1)).mean()
    if loss_type == "bnpo":
        return summed.sum() / completion_mask.sum().clamp(min=1)
    if loss_type == "dr_grpo":
        return summed.sum() / (token_loss.shape[0] * max_completion_length)
    if num_items_in_batch is None:
        raise ValueError("num_items_in_batch is needed for loss_type='dapo': the window's completion tokens, "
                         "all micro-batches and all processes")
    return summed.sum() / (num_items_in_batch / num_processes)


def flat_gradient(policy) -> torch.Tensor:
    """Every parameter's ``.grad`` in one float64 vector (zeros where a parameter got none)."""
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).double()
                      for p in policy.parameters()])


def _backward(policy, batch, loss_type, indices, *, grad_accum_steps, num_processes, num_items):
    rows = batch.rows(indices)
    loss = aggregate(loss_type, per_token_loss(policy, rows, batch.prompt_length), rows["completion_mask"],
                     max_completion_length=batch.max_completion_length, num_items_in_batch=num_items,
                     num_processes=num_processes)
    # The Trainer divides by GA; dapo's normaliser already counts the whole window, so it is left alone.
    (loss if loss_type == "dapo" else loss / grad_accum_steps).backward()


def full_batch_gradient(policy, batch: GenerationBatch, loss_type: str, indices=None) -> torch.Tensor:
    """The loss type's own full batch: its aggregation over ``indices`` (default: all) as one micro-batch."""
    check_batch(batch)
    indices = list(range(batch.num_sequences)) if indices is None else list(indices)
    policy.zero_grad(set_to_none=True)
    with single_thread():
        _backward(policy, batch, loss_type, indices, grad_accum_steps=1, num_processes=1,
                  num_items=int(batch.completion_mask[indices].sum()))
    return flat_gradient(policy)


def update_gradients(policy, batch: GenerationBatch, loss_type: str, *, grad_accum_steps: int,
                     num_processes: int = 1, steps_per_generation: int | None = None,
                     dapo_count: str = "generation") -> list[dict]:
    """The gradient of each optimizer update the generation batch feeds, after DDP's mean over processes.

    ``steps_per_generation`` (micro-batches per process per generation, TRL's meaning; default GA)
    must be a multiple of GA: the batch feeds ``steps_per_generation // GA`` updates. dapo counts its
    tokens over the whole generation batch (``dapo_count='generation'``) or over each update's window.
    Returns one ``{"gradient", "indices", "window_tokens"}`` per update, all at the current weights.
    """
    check_batch(batch)
    check_choice("loss_type", loss_type, LOSS_TYPES)
    check_choice("dapo_count", dapo_count, DAPO_COUNTS)
    ga = check_int("grad_accum_steps", grad_accum_steps, minimum=1, maximum=64)
    processes = check_int("num_processes", num_processes, minimum=1, maximum=64)
    steps = ga if steps_per_generation is None else check_int("steps_per_generation", steps_per_generation,
                                                              minimum=ga, maximum=64)
    if steps % ga or batch.num_sequences % (steps * processes):
        raise ValueError(f"steps_per_generation={steps} must be a multiple of grad_accum_steps={ga}, and "
                         f"steps_per_generation x num_processes={steps * processes} must divide the "
                         f"{batch.num_sequences} sequences of the generation batch")
    size = batch.num_sequences // (steps * processes)
    micro_batches = [list(range(k * size, (k + 1) * size)) for k in range(steps * processes)]
    updates = []
    for window in plan_windows(micro_batches, micro_batch_size=size, grad_accum_steps=ga, num_processes=processes):
        indices = [i for rank_mbs in window for mb in rank_mbs for i in mb]
        window_tokens = int(batch.completion_mask[indices].sum())
        num_items = int(batch.completion_mask.sum()) if dapo_count == "generation" else window_tokens
        per_rank = []
        for rank_mbs in window:
            policy.zero_grad(set_to_none=True)  # each rank starts the window from zero gradients
            with single_thread():
                for mb in rank_mbs:
                    _backward(policy, batch, loss_type, mb, grad_accum_steps=ga, num_processes=processes,
                              num_items=num_items)
            per_rank.append(flat_gradient(policy))
        updates.append({"gradient": torch.stack(per_rank).mean(0), "indices": indices, "window_tokens": window_tokens})
    return updates


def relative_distance(gradient: torch.Tensor, reference: torch.Tensor) -> float:
    """``|gradient - reference| / |reference|``."""
    return float((gradient - reference).norm() / reference.norm())


def distance_table(loss_types=LOSS_TYPES, grad_accum_steps=(1, 2, 4, 8), num_processes=(1, 2), *,
                   seed: int = 0) -> list[dict]:
    """Rows ``{loss_type, grad_accum_steps, num_processes, micro_batch_size, distance}``, one update per setting.

    ``distance`` is ``|g - g_full| / |g_full|`` against the loss type's own full batch.
    """
    loss_types = [check_choice(f"loss_types[{i}]", t, LOSS_TYPES) for i, t in enumerate(loss_types)]
    policy, batch = tiny_policy(seed), generation_batch(seed=seed)
    rows = []
    for loss_type in loss_types:
        full = full_batch_gradient(policy, batch, loss_type)
        for ga in grad_accum_steps:
            for processes in num_processes:
                (update,) = update_gradients(policy, batch, loss_type, grad_accum_steps=ga, num_processes=processes)
                rows.append({"loss_type": loss_type, "grad_accum_steps": ga, "num_processes": processes,
                             "micro_batch_size": batch.num_sequences // (ga * processes),
                             "distance": relative_distance(update["gradient"], full)})
    return rows


def versus_token_mean(*, seed: int = 0) -> dict:
    """Each loss type's full-batch gradient against dapo's (the per-token mean): ``{loss_type: {distance, cosine}}``.

    dr_grpo points the same way (cosine 1) with a smaller length (tokens / (B x max length));
    grpo weighs a short completion's tokens more, so it points elsewhere.
    """
    policy, batch = tiny_policy(seed), generation_batch(seed=seed)
    token_mean = full_batch_gradient(policy, batch, "dapo")
    found = {}
    for loss_type in LOSS_TYPES:
        full = full_batch_gradient(policy, batch, loss_type)
        cosine = float(full @ token_mean / (full.norm() * token_mean.norm()))
        found[loss_type] = {"distance": relative_distance(full, token_mean), "cosine": cosine}
    return found


def steps_per_generation_table(*, grad_accum_steps: int = 2, steps_per_generation: int = 4, num_processes: int = 1,
                               seed: int = 0) -> list[dict]:
    """One generation batch, several updates: per loss type (and dapo counted per window) what each update is.

    Row keys: ``loss_type`` (``"dapo (window count)"`` for ``dapo_count='window'``), ``updates``,
    ``distances`` (each update vs its own window's full batch), ``scales`` (|update| / |that full batch|),
    ``window_shares`` (the window's tokens / the generation batch's), and ``sum_distance`` (the updates'
    sum vs the whole generation batch's full batch: exact for dapo, ``updates - 1`` for mean-type losses).
    """
    policy, batch = tiny_policy(seed), generation_batch(seed=seed)
    total = int(batch.completion_mask.sum())
    rows = []
    for loss_type, count in [*((t, "generation") for t in LOSS_TYPES), ("dapo", "window")]:
        updates = update_gradients(policy, batch, loss_type, grad_accum_steps=grad_accum_steps,
                                   num_processes=num_processes, steps_per_generation=steps_per_generation,
                                   dapo_count=count)
        own = [full_batch_gradient(policy, batch, loss_type, u["indices"]) for u in updates]
        summed = torch.stack([u["gradient"] for u in updates]).sum(0)
        rows.append({"loss_type": loss_type if count == "generation" else "dapo (window count)",
                     "updates": len(updates),
                     "distances": [relative_distance(u["gradient"], f) for u, f in zip(updates, own, strict=True)],
                     "scales": [float(u["gradient"].norm() / f.norm()) for u, f in zip(updates, own, strict=True)],
                     "window_shares": [u["window_tokens"] / total for u in updates],
                     "sum_distance": relative_distance(summed, full_batch_gradient(policy, batch, loss_type))})
    return rows


__all__ = [
    "ADVANTAGE_EPS", "DAPO_COUNTS", "LOSS_TYPES", "GenerationBatch", "aggregate", "distance_table", "flat_gradient",
    "full_batch_gradient", "generation_batch", "group_advantages", "per_token_loss", "relative_distance",
    "steps_per_generation_table", "tiny_policy", "update_gradients", "versus_token_mean",
]

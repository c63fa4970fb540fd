"""Which rows each optimizer update trained on, seen from the model's inputs, and what a difference means.

The invariance check compares a run at GA k with its full batch. That means something only if
each update of the two runs trained on the same rows. :class:`FeedRecorder` (installed by
:mod:`.recording` in every run the check starts, nothing added to the user's code) keeps a
fingerprint of every row the model is fed in training, grouped by forward call (a micro-batch)
and by optimizer update. :func:`compare_rows` then tells three cases apart:

* the same rows in every update: the weights can be compared;
* the same rows in the same order, cut into updates elsewhere: the step boundary is off (a
  failure of the training code, named from what fed each update);
* other rows (a shuffle seeded differently, random draws before training, length grouping):
  the comparison means nothing, and the report says so instead of judging the accumulation.

A row's fingerprint is a hash of the model's main input for that row (``input_ids``,
``pixel_values``, ... or the first tensor argument) without its padding: the positions an
``attention_mask`` masks out, or else the leading and trailing positions that hold only ``0``,
``-100`` or the model's ``pad_token_id``. Rows that are all padding carry no data and are left out.
"""

from __future__ import annotations

import hashlib
import itertools
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

import torch

# The main input, by the names models give it; else the first tensor argument.
MAIN_INPUTS = ("input_ids", "pixel_values", "input_values", "input_features", "inputs_embeds")
PAD_VALUES = (0, -100)
SHOWN_BOUNDARIES = 6  # micro-batches per update shown in a diagnosis


def _main_input(args, kwargs):
    named = dict(kwargs)
    if args and isinstance(args[0], Mapping):  # model(batch) with a dict of tensors
        named = {**args[0], **named}
        args = args[1:]
    for name in MAIN_INPUTS:
        if torch.is_tensor(named.get(name)):
            return named[name], named
    return next((v for v in (*args, *named.values()) if torch.is_tensor(v) and v.ndim >= 1), None), named


def _strip(row: torch.Tensor, pad_values) -> torch.Tensor:
    """The row without its leading and trailing positions (along its first axis) that hold padding only."""
    values = [v for v in pad_values if v >= 0 or row.is_floating_point() or row.is_signed()]
    if row.ndim == 0 or row.dtype == torch.bool or not values:
        return row
    padding = torch.isin(row, torch.tensor(values, dtype=row.dtype)).reshape(len(row), -1).all(dim=1)
    where = (~padding).nonzero()
    return row[int(where[0]):int(where[-1]) + 1] if len(where) else row[:0]


def _hash(row: torch.Tensor) -> int:
    row = row.to(torch.float64 if row.is_floating_point() else torch.int64).contiguous()
    # 63 bits: a plain int that every unpickler (torch.load with weights_only) takes
    return int.from_bytes(hashlib.blake2b(row.numpy().tobytes(), digest_size=8).digest(), "little") & (2**63 - 1)


def row_keys(args, kwargs, pad_values=PAD_VALUES) -> list[int] | None:
    """One fingerprint per row of a forward call's main input (padding removed), None if it has none to see.

    An input that requires a gradient is not data (hidden states recomputed by checkpointing).
    """
    data, named = _main_input(args, kwargs)
    if data is None or data.requires_grad or data.ndim == 0:
        return None
    data = data.detach().cpu()
    mask = named.get("attention_mask")
    masked = torch.is_tensor(mask) and mask.ndim == 2 and data.ndim >= 2 and tuple(mask.shape) == tuple(data.shape[:2])
    mask = mask.detach().cpu().bool() if masked else None
    keys = []
    for i in range(data.shape[0]):
        row = data[i]
        row = row[mask[i]] if masked else _strip(row, pad_values)
        if row.ndim == 0 or row.numel() > 0:
            keys.append(_hash(row))
    return keys


class FeedRecorder:
    """Fingerprints of the rows fed to the model in training, per optimizer update of this process.

    Only the outermost module call counts (the model, or DDP around it), and only in training:
    grad mode on, the module in train mode, with trainable parameters (a loss module has none).
    """

    def __init__(self):
        self.feeds: list[list] = []  # per update: [(module tag, row keys), ...] one per forward call
        self._calls: list = []
        self._depth = 0
        self._tags: dict[int, int] = {}
        self._modules: dict[int, tuple] = {}  # id -> (the module, kept alive: see recording's exit; trains; pads)

    def forward_started(self) -> None:
        self._depth += 1

    def forward_ended(self, module, args, kwargs) -> None:
        self._depth = max(self._depth - 1, 0)
        if self._depth or not torch.is_grad_enabled() or not module.training:
            return
        if id(module) not in self._modules:
            config = getattr(getattr(module, "module", module), "config", None)
            pad = getattr(config, "pad_token_id", None)
            extra = (pad,) if isinstance(pad, int) and pad not in PAD_VALUES else ()
            self._modules[id(module)] = (module, any(p.requires_grad for p in module.parameters()),
                                         PAD_VALUES + extra)
        _, trains, pad_values = self._modules[id(module)]
        if not trains:
            return
        keys = row_keys(args, kwargs, pad_values)
        if keys is not None:
            self._calls.append((self._tags.setdefault(id(module), len(self._tags)), keys))

    def update_done(self) -> None:
        self.feeds.append(self._calls)
        self._calls = []

    def result(self) -> dict:
        return {"feeds": self.feeds, "pending": self._calls}


# ----------------------------------------------------------------------------------------------
# What fed each update, over the ranks of a run.
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Feeds:
    """A run's rows per update (all ranks, micro-step by micro-step), micro-batches per update on rank 0."""

    updates: list  # per update: row keys
    micro_batches: list  # per update: rank 0's forward calls
    pending: list  # rows fed after the last update

    @property
    def stream(self) -> list:
        return [key for rows in self.updates for key in rows] + self.pending


def _main_tag(rank: dict):
    tags = Counter(tag for calls in [*rank.get("feeds", ()), rank.get("pending", ())] for tag, _ in calls)
    return tags.most_common(1)[0][0] if tags else None


def feeds_of(ranks: list) -> Feeds | None:
    """What fed each update of a run (its ranks' recordings), None where no row was seen."""
    tags = [_main_tag(r) for r in ranks]
    if tags[0] is None:
        return None

    def rows(calls_per_rank):
        out = []
        for step in itertools.zip_longest(*calls_per_rank, fillvalue=[]):  # micro-step by micro-step
            out += [key for keys in step for key in keys]
        return out

    updates, micro_batches = [], []
    for u in range(len(ranks[0]["feeds"])):
        calls = [[keys for tag, keys in r["feeds"][u] if tag == t] if u < len(r["feeds"]) else []
                 for r, t in zip(ranks, tags, strict=True)]
        updates.append(rows(calls))
        micro_batches.append(len(calls[0]))
    pending = rows([[keys for tag, keys in r.get("pending", ()) if tag == t] for r, t in zip(ranks, tags, strict=True)])
    return Feeds(updates, micro_batches, pending)


@dataclass(frozen=True)
class RowsFinding:
    """What the rows say: ``kind`` is "other rows" (no verdict), or a failure of the training code: "step
    boundary" (cut elsewhere), "rows repeated" (topped up from the start), "rows left out" (a window skipped)."""

    kind: str
    update: int  # 1-based: the first update whose rows differ
    text: str


def _cut_elsewhere(run: Feeds, reference: Feeds) -> bool:
    """The same rows in the same order (order inside an update aside), cut into updates at other places."""
    ours, theirs = run.stream, reference.stream
    end = min(len(ours), len(theirs))
    our_cuts = {c for c in itertools.accumulate(len(r) for r in run.updates) if c < end}
    their_cuts = {c for c in itertools.accumulate(len(r) for r in reference.updates) if c < end}
    if our_cuts == their_cuts:
        return False
    start = 0
    for cut in sorted(our_cuts | their_cuts | {end}):
        if Counter(ours[start:cut]) != Counter(theirs[start:cut]):
            return False
        start = cut
    return True


def _boundary_text(micro_batches: list, k: int) -> str:
    shown = ", ".join(map(str, micro_batches[:SHOWN_BOUNDARIES])) + (", ..." if len(micro_batches) > SHOWN_BOUNDARIES
                                                                      else "")
    if micro_batches[0] < k and all(m == k for m in micro_batches[1:-1]):
        return (f"off-by-one step boundary: update 1 trained on {micro_batches[0]} micro-batch"
                f"{'' if micro_batches[0] == 1 else 'es'} per process, and every later update on the next GA={k}, "
                f"so each window is shifted by {micro_batches[0]} (micro-batches per update: {shown}); the same rows "
                "in the same order as the full batch, cut elsewhere. `if step % GA == 0: optimizer.step()` with step "
                "counted from 0 does this: step when (step + 1) % GA == 0, or use accelerator.accumulate")
    if len(set(micro_batches[:-1])) == 1 and micro_batches[0] != k:
        return (f"step boundary off: every update trained on {micro_batches[0]} micro-batches per process where GA "
                f"is {k}; the same rows in the same order as the full batch, cut into updates elsewhere: does the "
                "script take GA for all processes together (and divide it by their number)? Give it the per-process "
                "GA")
    return (f"step boundary off: the updates trained on {shown} micro-batches per process where GA is {k}; the same "
            "rows in the same order as the full batch, cut into updates elsewhere: step once after every GA-th "
            "micro-batch (and after the last, shorter window of an epoch)")


def _other_rows_text(run: Feeds, reference: Feeds, u: int, where: str) -> str:
    ours, theirs = Counter(run.updates[u]), Counter(reference.updates[u])
    missing = sum((theirs - ours).values())
    head = (f"other rows{where}: update {u + 1} trained on {len(run.updates[u])} rows, {missing} of the full batch's "
            f"{len(reference.updates[u])} rows of update {u + 1} not among them, so the weights cannot be compared "
            "and nothing is said about the accumulation")
    end = min(len(run.stream), len(reference.stream))
    if len(run.updates[u]) != len(reference.updates[u]):
        cause = ("the update does not hold GA x processes x micro-batch rows: does the script divide GA by the "
                 "number of processes, or take a global batch size? Give it the per-process settings")
    elif not Counter(reference.stream) - Counter(run.stream) and Counter(run.stream) - Counter(reference.stream):
        cause = ("the full batch leaves out rows the run trains on: drop_last drops a remainder that depends on the "
                 "batch size; give the check a number of rows that every batch size divides")
    elif Counter(run.stream[:end]) == Counter(reference.stream[:end]):
        cause = ("the same rows reach the updates in another order: a shuffled sampler seeded differently in the "
                 "two runs (on more than one process Accelerate gives the sampler a generator of its own, seeded "
                 "at prepare()), or rows grouped by length per batch (group_by_length, bucketing)")
    else:
        cause = ("other rows altogether: rows drawn at random per batch from a generator in another state, e.g. "
                 "random draws before training whose number depends on the batch size (an evaluation, a random "
                 "split), or a seed that depends on the rank")
    return (f"{head}. Likely cause: {cause}. For the check, make every run see the rows in one order: no shuffle or "
            "a seeded sampler (Accelerate's use_seedable_sampler, the script's own flag), no random draws before "
            "training, no length grouping")


def compare_rows(run_ranks: list, reference_ranks: list, k: int, where: str = "") -> RowsFinding | None:
    """How the rows of each update of a run (GA ``k``) differ from its full batch's; None when they do not
    (or could not be seen). ``where`` is added to the label, e.g. " (2 processes)"."""
    run, reference = feeds_of(run_ranks), feeds_of(reference_ranks)
    if run is None or reference is None:
        return None
    count = min(len(run.updates), len(reference.updates))
    differ = [u for u in range(count) if Counter(run.updates[u]) != Counter(reference.updates[u])]
    if not differ:
        return None
    u = differ[0]
    extra = [Counter(run.updates[d]) - Counter(reference.updates[d]) for d in differ]
    missing = [Counter(reference.updates[d]) - Counter(run.updates[d]) for d in differ]
    stream = Counter(run.stream)
    if not any(missing) and all(stream[key] > 1 for e in extra for key in e):
        # each differing update holds its full batch's rows, and copies of rows the run trains on elsewhere too
        twice = sum(sum(e.values()) for e in extra)
        updates = ", ".join(str(d + 1) for d in differ[:SHOWN_BOUNDARIES])
        return RowsFinding("rows repeated", u + 1, (
            f"rows counted twice{where}: update(s) {updates} trained on every row of the full batch's update and on "
            f"{twice} row(s) more that the run trains on elsewhere as well; uneven data topped up with rows from the "
            "start (Accelerate's even_batches does this to the last micro-batches of an epoch): pad with rows "
            "without targets, or set even_batches=False and step on what each process has"))
    if _cut_elsewhere(run, reference):
        return RowsFinding("step boundary", u + 1, _boundary_text(run.micro_batches, k))
    if _left_out(run, reference):
        return RowsFinding("rows left out", u + 1, (
            f"rows left out{where}: from update {u + 1} on, the run never trains on rows its full batch trains on "
            "(in the same order otherwise): a window, or a remainder, is skipped"))
    return RowsFinding("other rows", u + 1, _other_rows_text(run, reference, u, where))


def _left_out(run: Feeds, reference: Feeds) -> bool:
    """Each update of the run holds a stretch of the full batch's rows, in order, with some of them skipped."""
    theirs, start, skipped = reference.stream, 0, False
    for rows in run.updates:
        wanted, size = Counter(rows), len(rows)
        near = range(start, min(len(theirs) - size, start + 8 * max(size, 1)) + 1)  # a skip is a window or less
        at = next((s for s in near if Counter(theirs[s:s + size]) == wanted), None)
        if at is None or not rows:
            return False
        skipped, start = skipped or at > start, at + size
    return skipped


def rows_seen(ranks: list) -> bool:
    return feeds_of(ranks) is not None

"""Check real training code by invariance: GA k on P processes must train as its own full batch.

:func:`check_accumulation` checks a loop rewritten for it. The functions here check the code
you actually run, as you run it: a training function, a script under ``torchrun``, or
``Trainer.train()``. Each is run in real processes (Accelerate's, gloo on CPU, one GPU a
process where there are enough) at GA k on P processes, and once more as its **full batch**:
GA 1, one process, one micro-batch holding the same ``k x P x micro_batch_size`` rows. When the
accumulation is right, the two train alike: every update's weights agree (relative to how far
the full batch has moved), and so do the logged losses. Nothing in your code changes:
:mod:`.recording` sees every ``optimizer.step()`` through torch's global optimizer hooks.

What must hold for the comparison to mean anything (the report says when it does not):

* rows reach the updates in the same order whatever the batch size: a seeded sampler, no
  grouping by length per batch. Each update then holds the same rows in both runs;
* the same initial weights (the model built from a seed inside the function or script);
* no randomness in training (dropout 0 or eval mode). When a comparison fails, the full batch
  is run a second time; if the two full batches differ, the report says so instead of blaming
  the accumulation.

The report gives, per process count, the largest and the mean relative distance over the
updates (a one-sided shift, such as a dropped GA factor, moves the mean as much as the
largest), the first update's gradient ratio and cosine to the full batch's, the first
update that differs, and a diagnosis where the pattern is a known one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .ranks import processes_text


class InvarianceCheckError(RuntimeError):
    """A run could not be made or recorded (the training code failed, or never stepped)."""


@dataclass(frozen=True, eq=False)
class Run:
    """What one run did: each rank's weights before/after every update and the gradient it used."""

    num_processes: int
    grad_accum_steps: int
    micro_batch_size: int
    ranks: list  # per rank: {"before", "after", "gradients"} tensors of shape (updates, weights)
    losses: list | None  # what the code logged, one per update, or None
    seconds: float
    loss_resolution: float = 0.0  # what a logged loss is known to (1e-4 when printed as 2.3456)

    @property
    def updates(self) -> int:
        return len(self.ranks[0]["after"])

    def describe(self) -> str:
        return (f"{processes_text(self.num_processes)}, GA {self.grad_accum_steps}, {self.micro_batch_size} row"
                f"{'' if self.micro_batch_size == 1 else 's'} per micro-batch")


@dataclass(frozen=True)
class Comparison:
    """One run at GA k on P processes against the full batch."""

    num_processes: int
    grad_accum_steps: int
    passed: bool
    updates: int
    reference_updates: int
    largest_weight_distance: float
    mean_weight_distance: float
    largest_loss_distance: float | None
    mean_loss_distance: float | None
    gradient_ratio: float  # first update: the run's gradient projected on the full batch's, over its squared norm
    cosine: float
    first_different_update: int | None  # 1-based; None when every compared update agrees
    rank_spread: float
    diagnosis: tuple[str, ...]

    def summary(self) -> str:
        losses = "" if self.largest_loss_distance is None else (
            f", logged losses by {self.largest_loss_distance:.1e} (mean {self.mean_loss_distance:.1e})")
        where = "" if self.first_different_update is None else \
            f", first differs at update {self.first_different_update}"
        return (f"{processes_text(self.num_processes)} (GA={self.grad_accum_steps}): "
                f"{'passed' if self.passed else 'FAILED'}  {self.updates} updates "
                f"(full batch {self.reference_updates}); "
                f"weights off by {self.largest_weight_distance:.1e} at most (mean {self.mean_weight_distance:.1e}, "
                f"relative){losses}; first gradient ratio {self.gradient_ratio:.4g}, cosine {self.cosine:.6f}{where}")


@dataclass(frozen=True, eq=False)
class InvarianceReport:
    """What an invariance check found. Truthy only when every process count passed and the check was valid."""

    passed: bool
    tol: float
    comparisons: dict
    diagnosis: tuple[str, ...]
    notes: tuple[str, ...] = ()
    runs: tuple = ()

    def __bool__(self) -> bool:
        return self.passed

    @property
    def labels(self) -> tuple[str, ...]:
        """Each diagnosis' short label (before its first colon), once."""
        return tuple(dict.fromkeys(d.split(":", 1)[0] for d in self.diagnosis))

    def __str__(self) -> str:
        lines = [f"invariance check {'passed' if self.passed else 'FAILED'} (relative tol {self.tol:g}): GA k on P "
                 "processes against the full batch (1 process, GA 1, the same rows in one micro-batch)"]
        lines += [f"  {c.summary()}" for c in self.comparisons.values()]
        if self.diagnosis:
            lines += ["diagnosis:"] + [f"  - {d}" for d in self.diagnosis]
        if self.notes:
            lines += ["notes:"] + [f"  - {n}" for n in self.notes]
        return "\n".join(lines)

    def __repr__(self) -> str:
        head = "passed" if self.passed else "FAILED" + (": " + "; ".join(self.labels) if self.diagnosis else "")
        parts = [f"{processes_text(c.num_processes)} GA={c.grad_accum_steps}: weights {c.largest_weight_distance:.1e}"
                 for c in self.comparisons.values()]
        return "InvarianceReport(" + " | ".join([head, *parts, f"tol {self.tol:g}"]) + ")"


# ----------------------------------------------------------------------------------------------
# Judging: two runs' recorded updates, compared.
# ----------------------------------------------------------------------------------------------


def _relative(a: torch.Tensor, b: torch.Tensor, scale: float) -> float:
    return float((a - b).norm()) / scale if scale > 0 else (0.0 if torch.equal(a, b) else math.inf)


def _near(value: float, target: float, tol: float) -> bool:
    return abs(value - target) <= tol * max(1.0, abs(target))


def _loss_distances(losses, reference_losses, resolution):
    if losses is None or reference_losses is None or not losses or not reference_losses:
        return None, None, []
    count = min(len(losses), len(reference_losses))
    losses, reference_losses = losses[:count], reference_losses[:count]
    distances = [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, reference_losses, strict=True)]
    # A logged loss printed with d decimals is known to +-0.5e-d: two of them may differ by 1e-d.
    allowed = [resolution / max(abs(b), 1e-12) for b in reference_losses]
    return max(distances), sum(distances) / count, [d - a for d, a in zip(distances, allowed, strict=True)]


def compare_runs(run: Run, reference: Run, tol: float) -> Comparison:
    """Compare ``run`` (GA k on P processes) with ``reference`` (its full batch), update by update."""
    k, p = run.grad_accum_steps, run.num_processes
    ours, ref = run.ranks[0], reference.ranks[0]
    count = min(run.updates, reference.updates)
    start = ref["before"][0]
    moved = [float((ref["after"][u] - start).norm()) for u in range(count)]
    weight = [_relative(ours["after"][u], ref["after"][u], moved[u]) for u in range(count)]
    g, g_ref = ours["gradients"][0], ref["gradients"][0]
    ref_norm2 = float(g_ref @ g_ref)
    ratio = float(g @ g_ref) / ref_norm2 if ref_norm2 > 0 else math.nan
    norms = float(g.norm()) * math.sqrt(ref_norm2)
    cosine = float(g @ g_ref) / norms if norms > 0 else math.nan
    gradient_distance = _relative(g, g_ref, math.sqrt(ref_norm2))
    # The first update whose own step (from where each run stood) differs from the full batch's.
    first_different = next((u + 1 for u in range(count) if _relative(
        ours["after"][u] - ours["before"][u], ref["after"][u] - ref["before"][u],
        float((ref["after"][u] - ref["before"][u]).norm())) > tol), None)
    final = run.ranks[0]["after"][-1] if run.updates else None
    spread = max((_relative(r["after"][-1], final, max(moved[-1], 1e-300)) for r in run.ranks[1:] if run.updates),
                 default=0.0)
    resolution = max(run.loss_resolution, reference.loss_resolution)
    largest_loss, mean_loss, loss_excess = _loss_distances(run.losses, reference.losses, resolution)

    diagnosis = []
    if spread > tol:
        diagnosis.append(f"ranks diverged: the processes ended {spread:.2e} (relative) apart; their gradients were "
                         "not averaged before a step (no_sync on the last micro-batch?), or each rank changed its "
                         "weights on its own")
    if run.updates != reference.updates:
        diagnosis.append(_update_count_text(run.updates, reference.updates, k, p))
    elif gradient_distance > tol:
        diagnosis.append(_first_gradient_text(ratio, cosine, k, p))
    elif first_different == 1:
        diagnosis.append(f"right gradient, wrong update: the first update used the full batch's gradient (ratio "
                         f"{ratio:.6f}) but stepped differently: the learning rate or another optimizer setting is "
                         "not the full batch's (a "
                         "scheduler sized in micro-batches, or warm-up counted per micro-batch?)")
    elif first_different is not None:
        diagnosis.append(_later_update_text(run, reference, first_different, count, tol))
    if not diagnosis and loss_excess and max(loss_excess) > tol:
        diagnosis.append(f"logged loss differs: the weights agree but the logged loss is {largest_loss:.2e} (relative) "
                         "off the full batch's: it is logged per micro-batch or per process, or averaged over "
                         "micro-batches, not over every target of the update")
    passed = not diagnosis and max(weight, default=0.0) <= tol and run.updates == reference.updates
    return Comparison(
        num_processes=p, grad_accum_steps=k, passed=passed, updates=run.updates, reference_updates=reference.updates,
        largest_weight_distance=max(weight, default=math.nan), mean_weight_distance=sum(weight) / max(count, 1),
        largest_loss_distance=largest_loss, mean_loss_distance=mean_loss, gradient_ratio=ratio, cosine=cosine,
        first_different_update=first_different, rank_spread=spread, diagnosis=tuple(diagnosis))


def _update_count_text(updates: int, reference_updates: int, k: int, p: int) -> str:
    if updates >= k * reference_updates - k and k > 1:
        return (f"optimizer stepped on every micro-batch: {updates} updates where the full batch made "
                f"{reference_updates}; it must step once per window of GA={k} micro-batches (an optimizer stepped "
                "outside accelerator.accumulate, or not prepared by Accelerate)")
    if updates < reference_updates:
        return (f"updates dropped: {updates} updates where the full batch made {reference_updates}; a window "
                f"that holds fewer than GA={k} micro-batches (the end of an epoch whose micro-batches GA does not "
                "divide) was never stepped, or its gradient carried into the next epoch's first update")
    return (f"extra updates: {updates} updates where the full batch made {reference_updates}; a step boundary is "
            "off (stepping when i % GA == 0 instead of (i + 1) % GA == 0?)")


AMBIGUOUS_HALF = "loss divided by GA twice, or missing x num_processes"
MISSING_PROCESSES_TEXT = ("missing x num_processes: the gradient is 1/{p} of the full batch's; a loss divided by the "
                          "window's total target count must be multiplied by num_processes, because DDP averages "
                          "over processes")


def _first_gradient_text(ratio: float, cosine: float, k: int, p: int) -> str:
    same_way = cosine > 1 - 1e-4
    if same_way and k > 1 and k == p and _near(ratio, 1 / k, 1e-3):  # judge() tells them apart with 1 process
        return (f"{AMBIGUOUS_HALF}: the first update's gradient is 1/{k} = {ratio:.4g} of the full batch's, and "
                f"here GA = processes = {k}; check 1 process too to tell them apart")
    if same_way and k > 1 and _near(ratio, 1 / k, 1e-3):
        return (f"loss divided by GA twice: the first update's gradient is 1/GA = {ratio:.4g} of the full batch's; "
                "accelerator.backward already divides by gradient_accumulation_steps")
    if same_way and k > 1 and _near(ratio, k, 1e-3):
        return (f"loss not divided by GA: the first update's gradient is GA = {ratio:.4g} times the full batch's; "
                "the micro-batches' losses are added up, not averaged over the window")
    if same_way and p > 1 and _near(ratio, 1 / p, 1e-3):
        return MISSING_PROCESSES_TEXT.format(p=p)
    if same_way and p > 1 and _near(ratio, p, 1e-3):
        return (f"x num_processes twice: the gradient is {p} times the full batch's; the loss was scaled by "
                "num_processes where nothing averages it away")
    if same_way:
        return (f"wrong update size: the first update's gradient points the full batch's way but is {ratio:.4g} "
                "times its size, a ratio no plain factor (GA, processes) explains; check what each micro-batch's loss "
                "is divided by: its own target count (mean of micro-batch means; on a model this small the "
                "direction hardly changes) or a count that includes padding")
    return (f"micro-batches weighted unequally: the first update's gradient points another way than the full batch's "
            f"(cosine {cosine:.6f}, ratio {ratio:.4g}); each micro-batch (or each process) is normalised by its own "
            "target count, e.g. the mean loss of every micro-batch (mean of micro-batch means), instead of dividing "
            "every summed loss by the update's total target count")


def _later_update_text(run: Run, reference: Run, update: int, count: int, tol: float) -> str:
    ours, ref = run.ranks[0], reference.ranks[0]
    u = update - 1
    same_start = _relative(ours["before"][u], ref["before"][u],
                           float((ref["before"][u] - ref["before"][0]).norm()) or 1.0) <= tol
    gradient_right = same_start and _relative(ours["gradients"][u], ref["gradients"][u],
                                              float(ref["gradients"][u].norm())) <= tol
    if gradient_right:
        return (f"learning rate differs from update {update} on: the gradient is the full batch's but the step is "
                "not; a scheduler stepped per micro-batch, or sized in micro-batches instead of updates (lesson 09)")
    if update == count:
        return (f"last update differs: updates 1-{update - 1} match, the last does not; the final window is shorter "
                "than GA micro-batches and its loss is still divided by GA (or by a count of full windows)")
    return (f"state carried over between updates: updates 1-{update - 1} match, update {update} does not; "
            "optimizer.zero_grad() missing, or a window's count or loss leaks into the next")


def judge(runs: dict, references: dict, tol: float, *, rerun=None) -> InvarianceReport:
    """The report: each run (keyed by process count) against its full batch (``references``, same keys).

    When something differs and ``rerun(p)`` is given, the full batch of ``p`` is run again: if
    the two full batches differ, training is not deterministic and the verdict is withheld.
    """
    comparisons = {p: compare_runs(run, references[p], tol) for p, run in runs.items()}
    found: dict[str, list[int]] = {}  # label -> process counts it holds for
    texts: dict[str, str] = {}
    for p, c in comparisons.items():
        for text in c.diagnosis:
            label = text.split(":", 1)[0]
            found.setdefault(label, []).append(p)
            texts.setdefault(label, text)
    notes, valid = [], True
    concerns = sorted({c for run in [*runs.values(), *references.values()] for r in run.ranks
                       for c in r.get("concerns", ())})
    randomness = [c.split(": ", 1)[1] for c in concerns if c.startswith("randomness")]
    batch_statistics = [c.split(": ", 1)[1] for c in concerns if c.startswith("batch statistics")]
    if batch_statistics:  # it explains every difference: what the weights' pattern suggests would mislead
        label = "batch-dependent layer"
        found.clear()
        found[label], texts[label] = list(comparisons), (
            f"batch-dependent layer: {', '.join(batch_statistics)} in training normalises with the statistics of the "
            "batch it sees, so a micro-batch of 1/GA of the rows cannot give the full batch's update, however the "
            "loss is scaled; use GroupNorm or LayerNorm, freeze the statistics (eval mode on those layers), or "
            "compute them over the whole window")
    if randomness:
        valid = False
        notes.append(f"not a valid comparison: {', '.join(randomness)} is active in training; its masks depend on the "
                     "batch's shape, so GA k and the full batch drop different units even from one seed. Set "
                     "dropout to 0 (or the model to eval mode) for the check")
    if any(float((run.ranks[0]["before"][0] - references[p].ranks[0]["before"][0]).norm()) > 0
           for p, run in runs.items()):
        valid = False
        notes.append("not a valid comparison: the runs start from different weights (build the model from the same "
                     "seed whatever the settings)")
    if valid and found and rerun is not None:
        p = next(p for p, c in comparisons.items() if c.diagnosis)
        reference, again = references[p], rerun(p)
        start, end = reference.ranks[0]["before"][0], reference.ranks[0]["after"][-1]
        distance = _relative(again.ranks[0]["after"][-1], end, float((end - start).norm()))
        if again.updates != reference.updates or distance > tol:
            valid = False
            notes.append(f"not a valid comparison: two runs of the same full batch differ ({distance:.2e} relative): "
                         "training is not deterministic (dropout in train mode, an unseeded shuffle, or "
                         "nondeterministic kernels); make it deterministic before judging the accumulation")
    if AMBIGUOUS_HALF in found and 1 in comparisons and comparisons[1].passed:
        # 1 process is right, so GA is not the factor: the processes are.
        counts = found.pop(AMBIGUOUS_HALF)
        label = MISSING_PROCESSES_TEXT.split(":", 1)[0]
        found[label], texts[label] = counts, MISSING_PROCESSES_TEXT.format(p=max(counts))
    elif AMBIGUOUS_HALF in found and "loss divided by GA twice" in found:  # 1 process halves it too: GA is the factor
        found["loss divided by GA twice"] += found.pop(AMBIGUOUS_HALF)
    diagnosis = []
    for label, counts in found.items():
        text = texts[label]
        if len(comparisons) > 1 and sorted(counts) != sorted(comparisons):
            head, _, rest = text.partition(":")
            where = ", ".join(str(c) for c in counts)
            text = f"{head} (only with {where} process{'' if counts == [1] else 'es'}):{rest}"
            if label in ("micro-batches weighted unequally", "wrong update size") and 1 not in counts:
                text += ("; one process is right, so it is the processes that are weighted unequally: each "
                         "normalises by its own target count (gather the count over the processes)")
        diagnosis.append(text)
    if all(c.grad_accum_steps == 1 for c in comparisons.values()):
        notes.append("GA 1 for every run: nothing was accumulated; pass grad_accum_steps of 2 or more")
    if max(comparisons) == 1:
        notes.append("only 1 process checked: the count gathered over processes and DDP's averaging are not exercised")
    runs_made = tuple(dict.fromkeys([*references.values(), *runs.values()]))
    passed = valid and not batch_statistics and all(c.passed for c in comparisons.values())
    return InvarianceReport(passed=passed, tol=tol,
                            comparisons=comparisons, diagnosis=tuple(diagnosis), notes=tuple(notes), runs=runs_made)

"""Check real training code by invariance: GA k on P processes must train as its own full batch.

:func:`check_accumulation` checks a loop rewritten for it. The functions here check the code
you actually run, as you run it: a training function, a script under ``torchrun``, or
``Trainer.train()``. Each is run in real processes (Accelerate's, gloo on CPU, one GPU a
process where there are enough) at GA k on P processes, and once more as its **full batch**:
GA 1, one process, one micro-batch holding the same ``k x P x micro_batch_size`` rows. When the
accumulation is right, the two train alike: every update's weights agree (relative to how far
the full batch has moved), and so do the logged losses. Nothing in your code changes:
:mod:`.recording` sees every ``optimizer.step()`` through torch's global optimizer hooks, and
which rows fed each update through global module hooks (:mod:`.rows`).

What must hold for the comparison to mean anything, checked before anything is judged:

* each update holds the same rows in both runs (seen from the model's inputs). Where it does
  not (a shuffle seeded differently, random draws before training, length grouping), the
  verdict is *inconclusive* and the report says which update and why, never an accumulation
  bug. The same rows in the same order cut into updates elsewhere is a *failure*: a step
  boundary that is off;
* the same initial weights (the model built from a seed inside the function or script);
* no randomness in training (dropout 0 or eval mode). When a comparison fails, the full batch
  is run a second time; if the two full batches differ, the verdict is inconclusive.

Three verdicts: *passed*, *failed* (a valid comparison that differs, with its diagnosis) and
*inconclusive* (not comparable, not deterministic, a run that could not be made, no update).
The report is truthy only when it passed.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from .invariance_texts import (
    AMBIGUOUS_HALF,
    MISSING_PROCESSES_TEXT,
    first_gradient_text,
    later_update_text,
    relative,
    update_count_text,
)
from .ranks import processes_text
from .rows import compare_rows, rows_seen

HEADLINE = {"passed": "passed", "failed": "FAILED", "inconclusive": "INCONCLUSIVE"}


class InvarianceCheckError(RuntimeError):
    """A run could not be made or recorded (the training code failed, or never stepped)."""


@dataclass(frozen=True, eq=False)
class Run:
    """What one run did: each rank's weights before/after every update, the gradient it used, the rows it fed."""

    num_processes: int
    grad_accum_steps: int
    micro_batch_size: int
    ranks: list  # per rank: {"before", "after", "gradients"} tensors of shape (updates, weights), "feeds", "pending"
    losses: list | None  # what the code logged, one per update, or None
    seconds: float
    loss_resolution: float = 0.0  # what a logged loss is known to (1e-4 when printed as 2.3456)
    losses_from: str | None = "what the training function returned"  # None: losses not asked for

    @property
    def updates(self) -> int:
        return len(self.ranks[0]["after"])

    def describe(self) -> str:
        return describe(self.num_processes, self.grad_accum_steps, self.micro_batch_size)


def describe(p: int, k: int, mbs: int) -> str:
    return f"{processes_text(p)}, GA {k}, {mbs} row{'' if mbs == 1 else 's'} per micro-batch"


@dataclass(frozen=True)
class Comparison:
    """One run at GA k on P processes against the full batch."""

    num_processes: int
    grad_accum_steps: int
    verdict: str  # "passed", "failed" or "inconclusive"
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
    other_rows_from: int | None = None  # 1-based: the first update that trained on other rows than the full batch's
    cannot_judge: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()

    @property
    def passed(self) -> bool:
        return self.verdict == "passed"

    def summary(self) -> str:
        head = f"{processes_text(self.num_processes)} (GA={self.grad_accum_steps}): {HEADLINE[self.verdict]}  " \
               f"{self.updates} updates (full batch {self.reference_updates})"
        if self.other_rows_from is not None:
            return f"{head}; other rows than the full batch's from update {self.other_rows_from}: not compared"
        losses = "" if self.largest_loss_distance is None else (
            f", logged losses by {self.largest_loss_distance:.1e} (mean {self.mean_loss_distance:.1e})")
        where = "" if self.first_different_update is None else \
            f", first differs at update {self.first_different_update}"
        return (f"{head}; weights off by {self.largest_weight_distance:.1e} at most (mean "
                f"{self.mean_weight_distance:.1e}, relative){losses}; first gradient ratio {self.gradient_ratio:.4g}, "
                f"cosine {self.cosine:.6f}{where}")


@dataclass(frozen=True, eq=False)
class InvarianceReport:
    """What an invariance check found: ``verdict`` is "passed", "failed" or "inconclusive".

    Truthy only when it passed. ``diagnosis`` says what is wrong (failed); ``cannot_judge`` why
    there is no verdict, or none for some process count (other rows, a run that failed, ...).
    """

    verdict: str
    tol: float
    comparisons: dict
    diagnosis: tuple[str, ...]
    notes: tuple[str, ...] = ()
    runs: tuple = ()
    cannot_judge: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return self.verdict == "passed"

    @property
    def passed(self) -> bool:
        return self.verdict == "passed"

    @property
    def labels(self) -> tuple[str, ...]:
        """The short label (before the first colon) of what decided the verdict: the diagnosis when it failed,
        what kept it from judging when inconclusive; each once."""
        said = self.cannot_judge if self.verdict == "inconclusive" else self.diagnosis
        return tuple(dict.fromkeys(d.split(":", 1)[0] for d in said))

    def __str__(self) -> str:
        lines = [f"invariance check {HEADLINE[self.verdict]} (relative tol {self.tol:g}): GA k on P processes against "
                 "the full batch (1 process, GA 1, the same rows in one micro-batch)"]
        blocks = [("cannot judge:", self.cannot_judge), ("diagnosis:", self.diagnosis)]
        for title, items in blocks if self.verdict == "inconclusive" else blocks[::-1]:
            if items:  # what decided the verdict comes first
                lines += [title] + [f"  - {d}" for d in items]
        lines += [f"  {c.summary()}" for c in self.comparisons.values()]
        if self.notes:
            lines += ["notes:"] + [f"  - {n}" for n in self.notes]
        return "\n".join(lines)

    def __repr__(self) -> str:
        head = HEADLINE[self.verdict] + (": " + "; ".join(self.labels) if self.labels else "")
        parts = [f"{processes_text(c.num_processes)} GA={c.grad_accum_steps}: weights {c.largest_weight_distance:.1e}"
                 for c in self.comparisons.values()]
        return "InvarianceReport(" + " | ".join([head, *parts, f"tol {self.tol:g}"]) + ")"


# ----------------------------------------------------------------------------------------------
# Judging: two runs' recorded updates, compared.
# ----------------------------------------------------------------------------------------------


def _loss_distances(run: Run, reference: Run):
    """(largest, mean, [excess over what printing allows]) over the updates, and a note when not compared."""
    losses, reference_losses = run.losses, reference.losses
    if run.losses_from is None or reference.losses_from is None:
        return None, None, [], None
    if not losses or not reference_losses:
        which = "" if not losses and not reference_losses else \
            f" of the {'run' if not losses else 'full batch'} ({(run if not losses else reference).describe()})"
        return None, None, [], f"no logged loss found in {run.losses_from}{which}: the logged losses were not compared"
    if len(losses) != run.updates or len(reference_losses) != reference.updates:
        return None, None, [], (
            f"the logged losses were not compared: {len(losses)} values for {run.updates} updates ({run.describe()}), "
            f"{len(reference_losses)} for {reference.updates} (full batch) in {run.losses_from}; one value per "
            "update is needed (a loss pattern that matches the update lines only)")
    count = min(len(losses), len(reference_losses))
    distances = []
    for a, b in zip(losses[:count], reference_losses[:count], strict=True):
        same = a == b or (math.isnan(a) and math.isnan(b))
        distances.append(0.0 if same else abs(a - b) / max(abs(b), 1e-12) if math.isfinite(a - b) else math.inf)
    # A logged loss printed with d decimals is known to +-0.5e-d: two of them may differ by 1e-d.
    resolution = max(run.loss_resolution, reference.loss_resolution)
    allowed = [resolution / max(abs(b), 1e-12) if math.isfinite(b) else 0.0 for b in reference_losses[:count]]
    return (max(distances), sum(distances) / count, [d - a for d, a in zip(distances, allowed, strict=True)], None)


def _weights_diagnosis(run: Run, reference: Run, tol: float, ratio, cosine, gradient_distance, first_different,
                       count) -> list[str]:
    k, p = run.grad_accum_steps, run.num_processes
    if run.updates != reference.updates:
        return [update_count_text(run.updates, reference.updates, k, p)]
    if gradient_distance > tol:
        return [first_gradient_text(ratio, cosine, k, p)]
    if first_different == 1:
        return [f"right gradient, wrong update: the first update used the full batch's gradient (ratio {ratio:.6f}) "
                "but stepped differently: the learning rate or another optimizer setting is not the full batch's (a "
                "scheduler sized in micro-batches, or warm-up counted per micro-batch?)"]
    if first_different is not None:
        return [later_update_text(run, reference, first_different, count, tol)]
    return []


def compare_runs(run: Run, reference: Run, tol: float) -> Comparison:
    """Compare ``run`` (GA k on P processes) with ``reference`` (its full batch): rows first, then each update."""
    k, p = run.grad_accum_steps, run.num_processes
    ours, ref = run.ranks[0], reference.ranks[0]
    count = min(run.updates, reference.updates)
    start = ref["before"][0]
    moved = [float((ref["after"][u] - start).norm()) for u in range(count)]
    weight = [relative(ours["after"][u], ref["after"][u], moved[u]) for u in range(count)]
    g, g_ref = ours["gradients"][0], ref["gradients"][0]
    ref_norm2 = float(g_ref @ g_ref)
    ratio = float(g @ g_ref) / ref_norm2 if ref_norm2 > 0 else math.nan
    norms = float(g.norm()) * math.sqrt(ref_norm2)
    cosine = float(g @ g_ref) / norms if norms > 0 else math.nan
    gradient_distance = relative(g, g_ref, math.sqrt(ref_norm2))
    # The first update whose own step (from where each run stood) differs from the full batch's.
    first_different = next((u + 1 for u in range(count) if relative(
        ours["after"][u] - ours["before"][u], ref["after"][u] - ref["before"][u],
        float((ref["after"][u] - ref["before"][u]).norm())) > tol), None)
    final = ours["after"][-1]
    spread = max((relative(r["after"][-1], final, max(moved[-1], 1e-300)) for r in run.ranks[1:]), default=0.0)
    largest_loss, mean_loss, loss_excess, loss_note = _loss_distances(run, reference)
    common = dict(num_processes=p, grad_accum_steps=k, updates=run.updates, reference_updates=reference.updates,
                  largest_weight_distance=max(weight, default=math.nan),
                  mean_weight_distance=sum(weight) / max(count, 1), gradient_ratio=ratio, cosine=cosine,
                  first_different_update=first_different, rank_spread=spread,
                  notes=() if loss_note is None else (loss_note,))

    rows = compare_rows(run.ranks, reference.ranks, k, f" ({processes_text(p)})")
    if rows is not None and rows.kind == "other rows":  # nothing can be said about the accumulation
        return Comparison(verdict="inconclusive", largest_loss_distance=None, mean_loss_distance=None, diagnosis=(),
                          other_rows_from=rows.update, cannot_judge=(rows.text,), **common)
    diagnosis = []
    if spread > tol:
        diagnosis.append(f"ranks diverged: the processes ended {spread:.2e} (relative) apart; their gradients were "
                         "not averaged before a step (no_sync on the last micro-batch?), or each rank changed its "
                         "weights on its own")
    if rows is not None and rows.kind == "step boundary":
        off_by_one = rows.text.startswith("off-by-one")
        diagnosis.append(rows.text if off_by_one or run.updates == reference.updates else
                         update_count_text(run.updates, reference.updates, k, p))
    elif rows is not None and rows.kind == "rows left out":
        diagnosis.append(rows.text if run.updates == reference.updates else
                         update_count_text(run.updates, reference.updates, k, p))
    elif rows is not None:  # rows repeated: named first; the weights' pattern then says where, not why
        diagnosis.append(rows.text)
        diagnosis += [f"{text.split(';')[0]}; there the run trained on rows counted twice" for text in
                      _weights_diagnosis(run, reference, tol, ratio, cosine, gradient_distance, first_different, count)]
    else:
        diagnosis += _weights_diagnosis(run, reference, tol, ratio, cosine, gradient_distance, first_different, count)
    if not diagnosis and loss_excess and max(loss_excess) > tol:
        diagnosis.append(f"logged loss differs: the weights agree but the logged loss is {largest_loss:.2e} (relative) "
                         "off the full batch's: it is logged per micro-batch or per process, or averaged over "
                         "micro-batches, not over every target of the update")
    passed = not diagnosis and max(weight, default=0.0) <= tol and run.updates == reference.updates
    return Comparison(verdict="passed" if passed else "failed", largest_loss_distance=largest_loss,
                      mean_loss_distance=mean_loss, diagnosis=tuple(diagnosis), **common)


def _validity(runs: dict, references: dict) -> tuple[list, list]:
    """(what keeps every comparison from meaning anything, batch-statistics layers seen)."""
    concerns = sorted({c for run in [*runs.values(), *references.values()] for r in run.ranks
                       for c in r.get("concerns", ())})
    randomness = [c.split(": ", 1)[1] for c in concerns if c.startswith("randomness")]
    batch_statistics = [c.split(": ", 1)[1] for c in concerns if c.startswith("batch statistics")]
    problems = []
    if randomness:
        problems.append(f"randomness in training: {', '.join(randomness)} is active; its masks depend on the batch's "
                        "shape, so GA k and the full batch drop different units even from one seed. Set dropout to 0 "
                        "(or the model to eval mode) for the check")
    if any(float((run.ranks[0]["before"][0] - references[p].ranks[0]["before"][0]).norm()) > 0
           for p, run in runs.items()):
        problems.append("different initial weights: the runs start from different weights (build the model from the "
                        "same seed whatever the settings)")
    return problems, batch_statistics


def _determinism(runs, references, comparisons, tol, rerun) -> str | None:
    """Run the first failing count's full batch again: a text when the two full batches differ."""
    p = next(p for p, c in comparisons.items() if c.verdict == "failed")
    reference, again = references[p], rerun(p)
    start, end = reference.ranks[0]["before"][0], reference.ranks[0]["after"][-1]
    distance = relative(again.ranks[0]["after"][-1], end, float((end - start).norm())) if again.updates else math.inf
    rows = compare_rows(again.ranks, reference.ranks, 1)
    if rows is not None:
        return ("not deterministic: two runs of the same full batch trained on other rows (from update "
                f"{rows.update}): an unseeded shuffle or random draws; seed them before judging the accumulation")
    if again.updates != reference.updates or distance > tol:
        return (f"not deterministic: two runs of the same full batch differ ({distance:.2e} relative): dropout in "
                "train mode, an unseeded shuffle, or nondeterministic kernels; make it deterministic before judging "
                "the accumulation")
    return None


def _merged_diagnosis(comparisons: dict) -> list[str]:
    found: dict[str, list[int]] = {}  # label -> process counts it holds for
    texts: dict[str, str] = {}
    for p, c in comparisons.items():
        for text in c.diagnosis:
            label = text.split(":", 1)[0]
            found.setdefault(label, []).append(p)
            texts.setdefault(label, text)
    if AMBIGUOUS_HALF in found and 1 in comparisons and comparisons[1].passed:
        # 1 process is right, so GA is not the factor: the processes are.
        counts = found.pop(AMBIGUOUS_HALF)
        label = MISSING_PROCESSES_TEXT.split(":", 1)[0]
        found[label], texts[label] = counts, MISSING_PROCESSES_TEXT.format(p=max(counts))
    elif AMBIGUOUS_HALF in found and "loss divided by GA twice" in found:  # 1 process halves it too: GA is the factor
        found["loss divided by GA twice"] += found.pop(AMBIGUOUS_HALF)
    judged = [p for p, c in comparisons.items() if c.verdict != "inconclusive"]
    diagnosis = []
    for label, counts in found.items():
        text = texts[label]
        if len(judged) > 1 and sorted(counts) != sorted(judged) and not label.endswith(")"):
            head, _, rest = text.partition(":")
            where = ", ".join(str(c) for c in counts)
            text = f"{head} (only with {where} process{'' if counts == [1] else 'es'}):{rest}"
            if label in ("micro-batches weighted unequally", "wrong update size") and 1 not in counts:
                text += ("; one process is right, so it is the processes that are weighted unequally: each "
                         "normalises by its own target count (gather the count over the processes)")
        diagnosis.append(text)
    return diagnosis


def judge(runs: dict, references: dict, tol: float, *, rerun=None, failed_runs=None) -> InvarianceReport:
    """The report: each run (keyed by process count) against its full batch (``references``, same keys).

    ``failed_runs`` maps a process count whose run (or full batch) could not be made to what went
    wrong. When a valid comparison fails and ``rerun(p)`` is given, the full batch of ``p`` is run
    again: if the two full batches differ, training is not deterministic and there is no verdict.
    """
    comparisons = {p: compare_runs(run, references[p], tol) for p, run in runs.items()}
    problems, batch_statistics = _validity(runs, references)
    from_rows = ("off-by-one step boundary", "step boundary off", "rows counted twice", "rows left out")
    weights_failed = any(c.verdict == "failed" and not any(d.startswith(from_rows) for d in c.diagnosis)
                         for c in comparisons.values())
    notes = list(dict.fromkeys(n for c in comparisons.values() for n in c.notes))
    if not problems and not batch_statistics and weights_failed and rerun is not None:
        try:
            problem = _determinism(runs, references, comparisons, tol, rerun)
        except InvarianceCheckError as exc:
            problem = None
            notes.append(f"the full batch could not be run a second time to check that training is deterministic: "
                         f"{str(exc).splitlines()[0]}")
        problems += [problem] if problem else []
    cannot_judge = [*problems, *(failed_runs or {}).values(),
                    *(text for c in comparisons.values() for text in c.cannot_judge)]
    if batch_statistics:  # it explains every difference: what the weights' pattern suggests would mislead
        diagnosis = [f"batch-dependent layer: {', '.join(batch_statistics)} in training normalises with the statistics "
                     "of the batch it sees, so a micro-batch of 1/GA of the rows cannot give the full batch's update, "
                     "however the loss is scaled; use GroupNorm or LayerNorm, freeze the statistics (eval mode on "
                     "those layers), or compute them over the whole window"]
    else:
        diagnosis = _merged_diagnosis(comparisons)
    if problems:  # no comparison means anything: no diagnosis either
        comparisons = {p: dataclasses.replace(c, verdict="inconclusive") for p, c in comparisons.items()}
        diagnosis = []
        verdict = "inconclusive"
    elif batch_statistics or any(c.verdict == "failed" for c in comparisons.values()):
        verdict = "failed"
    elif cannot_judge or not comparisons:
        verdict = "inconclusive"
    else:
        verdict = "passed"
    if not all(rows_seen(run.ranks) for run in [*runs.values(), *references.values()]):
        notes.append("the rows that fed each update could not be seen in every run (no tensor input to the model in "
                     "training): the comparison assumes the same rows")
    if comparisons and all(c.grad_accum_steps == 1 for c in comparisons.values()):
        notes.append("GA 1 for every run: nothing was accumulated; pass grad_accum_steps of 2 or more")
    if comparisons and max(comparisons) == 1 and not failed_runs:
        notes.append("only 1 process checked: the count gathered over processes and DDP's averaging are not exercised")
    runs_made = tuple(dict.fromkeys([*references.values(), *runs.values()]))
    return InvarianceReport(verdict=verdict, tol=tol, comparisons=comparisons, diagnosis=tuple(diagnosis),
                            notes=tuple(notes), runs=runs_made, cannot_judge=tuple(dict.fromkeys(cannot_judge)))

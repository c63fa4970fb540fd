"""The invariance check's three entries: a training function, a script, ``Trainer.train()``.

Each runs the user's code as they run it, at GA k on every process count asked for and as its
full batch (:mod:`.invariance` says what is compared and how it is judged). A function and the
Trainer run in processes forked by :func:`gaccum_launch.launch`; a script runs as its own
``python`` process, or under ``torchrun`` for several; all of them are recorded by
:mod:`.recording` without a line of them changed.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil  # Accelerate depends on it
import torch

from gaccum_launch import LaunchError, gpu_count, launch
from gaccum_lib._checks import check_float, check_int

from .invariance import InvarianceCheckError, InvarianceReport, Run, describe, judge
from .ranks import processes_text
from .recording import record_call

#: Placeholders a script's arguments must hold: the check fills in each run's settings.
PLACEHOLDERS = ("{grad_accum_steps}", "{micro_batch_size}")
#: The first number after the word "loss" on a line of the script's output (e.g. "update 3: loss 2.3456"), or nan
#: or inf; one per line at most, never past the line's end. It needs a decimal point: "loss at step 3" is no loss.
DEFAULT_LOSS_PATTERN = r"\b[Ll]oss\b[^\d\n]*?((?i:\bnan\b|[-+]?\binf\b)|[-+]?\d+\.\d+(?:[eE][-+]?\d+)?)"
# Variables a launcher sets; a one-process run clears them, so that it really is one plain process.
_LAUNCH_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                     "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")
TRACEBACK_LINES = 30  # of a failed rank's own exception, in the report


def _check_settings(grad_accum_steps, micro_batch_size, num_processes, tol) -> tuple:
    check_int("grad_accum_steps", grad_accum_steps, minimum=1, maximum=1024)
    check_int("micro_batch_size", micro_batch_size, minimum=1)
    counts = num_processes if isinstance(num_processes, tuple | list) else (num_processes,)
    if not counts:
        raise ValueError("num_processes must be a positive int or a non-empty tuple of them, got an empty tuple")
    counts = tuple(check_int("num_processes", p, minimum=1, maximum=64) for p in counts)
    if len(set(counts)) != len(counts):
        raise ValueError(f"num_processes must not repeat a process count, got {counts}")
    tol = check_float("tol", tol, minimum=0.0, exclusive_minimum=True, maximum=0.01)
    return counts, tol


def _say(progress, text):
    if progress:
        print(text, file=sys.stderr, flush=True)


def _function_run(train, k, mbs, p, timeout) -> Run:
    began = time.perf_counter()
    results = launch(record_call, (train, k, mbs), num_processes=p, timeout=timeout)
    ranks = [{key: r[key] for key in ("before", "after", "gradients", "concerns", "feeds", "pending")} for r in results]
    if len(ranks[0]["after"]) == 0:
        raise InvarianceCheckError(f"no update recorded: train({k}, {mbs}) on {processes_text(p)} never called "
                                   "optimizer.step()")
    losses = results[0]["result"]
    losses = None if losses is None else [float(x) for x in losses]
    return Run(p, k, mbs, ranks, losses, time.perf_counter() - began)


def check_invariance(train, *, grad_accum_steps: int = 4, micro_batch_size: int = 2, num_processes=(1, 2),
                     tol: float = 1e-4, timeout: float = 300.0, progress: bool = True) -> InvarianceReport:
    """Run ``train(grad_accum_steps, micro_batch_size)`` at GA k on each process count, and as its full batch.

    ``train`` is your own training function, as you would hand it to ``notebook_launcher``
    but taking the two settings: it creates its ``Accelerator`` (with
    ``gradient_accumulation_steps`` if it uses ``accumulate``), its model from a seed, its
    data and optimizer, trains, and returns the loss it logged per update (a list of floats) or
    ``None``. The full batch is ``train(1, grad_accum_steps * P * micro_batch_size)`` on one
    process, for the largest P checked; each P is compared with the full batch of its own rows.
    """
    if not callable(train):
        raise TypeError("train must be a callable train(grad_accum_steps, micro_batch_size), got "
                        f"{type(train).__name__}")
    counts, tol = _check_settings(grad_accum_steps, micro_batch_size, num_processes, tol)
    return _check(lambda k, mbs, p: _function_run(train, k, mbs, p, timeout), grad_accum_steps, micro_batch_size,
                  counts, tol, progress)


def _indented(text: str) -> str:
    return "\n    ".join(text.rstrip().splitlines())


def _check(run_at, k, mbs, counts, tol, progress) -> InvarianceReport:
    """Every process count at GA k, each against the full batch of its own rows (one run per distinct window).

    A run that cannot be made (the code raised, ran too long, never stepped) leaves its process count
    without a comparison, said in the report; the others are still compared. Every run prints a line.
    """

    def attempt(what, k_, mbs_, p_):
        began = time.perf_counter()
        try:
            run = run_at(k_, mbs_, p_)
        except (InvarianceCheckError, LaunchError) as exc:
            _say(progress, f"{what} ({describe(p_, k_, mbs_)}): could not be made, {time.perf_counter() - began:.1f} s")
            return str(exc)
        _say(progress, f"{what} ({run.describe()}): {run.updates} updates, {run.seconds:.1f} s")
        return run

    by_window: dict = {}
    references, runs, failed = {}, {}, {}
    for p in counts:
        window = k * p * mbs
        if window not in by_window:
            by_window[window] = attempt("full batch", 1, window, 1)
        if isinstance(by_window[window], str):
            failed[p] = f"run failed ({processes_text(p)}): its full batch could not be made: " \
                        f"{_indented(by_window[window])}"
            continue
        ran = attempt("run", k, mbs, p)
        if isinstance(ran, str):
            failed[p] = f"run failed ({processes_text(p)}): {_indented(ran)}"
            continue
        references[p], runs[p] = by_window[window], ran

    def rerun(p):
        again = attempt("full batch again, to check that training is deterministic", 1, k * p * mbs, 1)
        if isinstance(again, str):
            raise InvarianceCheckError(again)
        return again

    return judge(runs, references, tol, rerun=rerun, failed_runs=failed)


def _script_parts(command) -> tuple[str, list[str]]:
    """(script path, its arguments) of ``python script.py args`` or ``script.py args`` (a string or a list)."""
    parts = shlex.split(command) if isinstance(command, str) else list(command)
    if parts and Path(parts[0]).name.startswith("python") and not parts[0].endswith(".py"):
        parts = parts[1:]
    if not parts or not parts[0].endswith(".py"):
        raise ValueError(f"command must run a Python script, e.g. 'python train.py --grad_accum_steps "
                         f"{{grad_accum_steps}} --micro_batch_size {{micro_batch_size}}', got {command!r}")
    missing = [h for h in PLACEHOLDERS if not any(h in a for a in parts[1:])]
    if missing:
        raise ValueError(f"command must hold the placeholder(s) {', '.join(missing)} where the script takes its "
                         f"settings, e.g. '--grad_accum_steps {{grad_accum_steps}}'; got {command!r}")
    if not Path(parts[0]).is_file():
        raise ValueError(f"command's script {parts[0]!r} is not a file (relative paths start from {os.getcwd()})")
    return parts[0], parts[1:]


def _script_run(script, arguments, k, mbs, p, loss_pattern, timeout) -> Run:
    filled = [a.replace("{grad_accum_steps}", str(k)).replace("{micro_batch_size}", str(mbs)) for a in arguments]
    env = {key: value for key, value in os.environ.items() if key not in _LAUNCH_VARIABLES}
    env.setdefault("OMP_NUM_THREADS", "1")  # every run alike, and no oversubscribed cores
    env["PYTHONUNBUFFERED"] = "1"  # stdout and stderr in one pipe, in the order the script wrote them
    if gpu_count() < p:
        env["ACCELERATE_USE_CPU"] = "1"  # without it, torchrun's CPU processes would each train alone
    recorder = ["-m", "gaccum_check.recording"]
    began = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gaccum-invariance-") as folder:
        if p == 1:
            command = [sys.executable, *recorder, folder, script, *filled]
        else:  # torchrun; only rank 0's output, whose losses are read (each rank's exception is in its file)
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={p}",
                       "--local-ranks-filter=0", *recorder, folder, script, *filled]
        done = _run_stopping_all(command, env, timeout)
        files = {r: Path(folder) / f"rank{r}.pt" for r in range(p)}
        saved = {r: torch.load(path) for r, path in files.items() if path.is_file()}
        if done.returncode != 0 or any(s.get("error") for s in saved.values()):
            raise InvarianceCheckError(_failure_text(done, saved, p, k, mbs))
    if len(saved) < p:
        raise InvarianceCheckError(f"ranks {sorted(set(range(p)) - set(saved))} of {p} recorded nothing")
    ranks = [saved[r] for r in range(p)]
    if len(ranks[0]["after"]) == 0:
        raise InvarianceCheckError(f"no update recorded: the script never called optimizer.step() on "
                                   f"{processes_text(p)} at GA {k}")
    printed = logged_losses(done.stdout, loss_pattern) if loss_pattern else []
    return Run(p, k, mbs, ranks, [float(x) for x in printed] or None, time.perf_counter() - began,
               loss_resolution=printed_resolution(printed),
               losses_from=None if loss_pattern is None else "the script's output (stdout and stderr)")


def _run_stopping_all(command, env, timeout) -> subprocess.CompletedProcess:
    """Run ``command``; past ``timeout`` (or on Ctrl-C), stop it and every process it started.

    torchrun starts its ranks in sessions of their own, so they are found as its descendants and
    stopped one by one; a rank left behind would also hold the output pipe open.
    """
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        _stop_with_descendants(process.pid)
        output, _ = process.communicate()
        tail = "\n".join(output.splitlines()[-10:])
        raise InvarianceCheckError(f"ran past {timeout:.0f} s and was stopped, with the processes it started "
                                   f"(a hang, e.g. in a collective one rank never reached):\n{tail}") from exc
    except BaseException:
        _stop_with_descendants(process.pid)
        raise
    return subprocess.CompletedProcess(command, process.returncode, output, "")


def _stop_with_descendants(pid: int) -> None:
    try:
        root = psutil.Process(pid)
        tree = [root, *root.children(recursive=True)]  # found before any is stopped: orphans are not found
    except psutil.NoSuchProcess:
        return
    for member in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            member.kill()
    psutil.wait_procs(tree, timeout=10)


def _failure_text(done, saved: dict, p: int, k: int, mbs: int) -> str:
    """The script's own exception, from the rank that raised first; else the end of what it printed."""
    errors = sorted((s["error"]["time"], r, s["error"]["text"]) for r, s in saved.items() if s.get("error"))
    where = f"on {processes_text(p)} at GA {k}, micro-batch {mbs}"
    if errors:
        _, rank, text = errors[0]
        lines = text.rstrip().splitlines()
        shown = "\n".join((["..."] if len(lines) > TRACEBACK_LINES else []) + lines[-TRACEBACK_LINES:])
        others = [r for _, r, _ in errors[1:]]
        also = f" (then rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))} too)" if others else ""
        on_rank = f" on rank {rank}{also}" if p > 1 else ""
        return f"the script raised{on_rank} {where}:\n{shown}"
    tail = "\n".join(done.stdout.splitlines()[-25:])
    return f"the script failed (exit status {done.returncode}) {where}:\n{tail}"


def logged_losses(output: str, pattern: str) -> list[str]:
    """The loss each line of ``output`` logs: the pattern's group at its first match on the line (none past it)."""
    found = (re.search(pattern, line) for line in output.splitlines())
    return [m.group(1) for m in found if m is not None]


def printed_resolution(printed: list[str]) -> float:
    """What printed numbers are known to: two printings of one value with d decimals may differ by 1e-d."""
    numbers = [x for x in printed if re.fullmatch(r"[-+]?\d+\.?\d*(?:[eE][-+]?\d+)?", x)]
    decimals = [len(re.split("[eE]", x)[0].partition(".")[2]) for x in numbers]
    exponents = [int(re.split("[eE]", x)[1]) if re.search("[eE]", x) else 0 for x in numbers]
    return max((10.0 ** (e - d) for d, e in zip(decimals, exponents, strict=True)), default=0.0)


def check_script_invariance(command, *, grad_accum_steps: int = 4, micro_batch_size: int = 2, num_processes=(1, 2),
                            tol: float = 1e-4, loss_pattern: str | None = DEFAULT_LOSS_PATTERN, timeout: float = 600.0,
                            progress: bool = True) -> InvarianceReport:
    """Run a training script at GA k on each process count (``torchrun``) and as its full batch; compare.

    ``command`` is how you run it on one process, with the placeholders ``{grad_accum_steps}``
    and ``{micro_batch_size}`` where it takes those settings, e.g.
    ``"python train.py --grad_accum_steps {grad_accum_steps} --micro_batch_size {micro_batch_size}"``.
    Several processes are started with ``torchrun --nproc_per_node P`` (one GPU each where there
    are enough, else CPU processes over gloo). Logged losses are read from what rank 0 prints,
    stdout and stderr: on each line, the first match of ``loss_pattern`` (a regular expression
    with one group; by default the first number after the word "loss"), never past the line's
    end; they are compared when there is one per update. ``None`` compares weights only. A run
    that fails is reported with the script's own exception, from the rank that raised first.
    """
    script, arguments = _script_parts(command)
    counts, tol = _check_settings(grad_accum_steps, micro_batch_size, num_processes, tol)
    if loss_pattern is not None and (not isinstance(loss_pattern, str) or re.compile(loss_pattern).groups != 1):
        raise ValueError(f"loss_pattern must be a regular expression with exactly one group, got {loss_pattern!r}")
    timeout = check_float("timeout", timeout, minimum=0.0, exclusive_minimum=True)
    return _check(lambda k, mbs, p: _script_run(script, arguments, k, mbs, p, loss_pattern, timeout),
                  grad_accum_steps, micro_batch_size, counts, tol, progress)


# Trainer.train(): the same comparison, plus the one thing invariance cannot see. The Trainer's
# full batch uses the Trainer's own count too, so a count that is wrong the same way at GA 1 and
# at GA k passes the comparison; the first full-batch update is therefore also compared with the
# model's own mean loss over that micro-batch's targets.


def _trainer_entry(make_trainer, k, mbs, capture_first_batch):
    trainer = make_trainer(k, mbs)
    args = trainer.args
    if (args.gradient_accumulation_steps, args.per_device_train_batch_size) != (k, mbs):
        raise ValueError(f"make_trainer({k}, {mbs}) built a Trainer with gradient_accumulation_steps="
                         f"{args.gradient_accumulation_steps} and per_device_train_batch_size="
                         f"{args.per_device_train_batch_size}: it must use the two settings it is given")
    first = {}

    def keep_first_batch(module, positional, kwargs):
        if not first:
            first.update({key: v.detach().cpu().clone() for key, v in kwargs.items() if torch.is_tensor(v)})

    handle = trainer.model.register_forward_pre_hook(keep_first_batch, with_kwargs=True) if capture_first_batch \
        else None
    trainer.train()
    if handle is not None:
        handle.remove()
    history = trainer.state.log_history
    return {"losses": [h["loss"] for h in history if "loss" in h],
            "grad_norms": [h["grad_norm"] for h in history if "grad_norm" in h], "first_batch": first}


def _mean_loss_gradient(make_trainer, window, batch) -> torch.Tensor:
    """The gradient of the model's own mean loss over ``batch``'s targets, from the initial weights.

    Flattened in the order of the Trainer's optimizer, as the recorded gradients are (its
    parameter groups, with and without weight decay, are not the model's order).
    """
    trainer = make_trainer(1, window)
    model = trainer.model.to("cpu")
    model.train()
    params = [p for group in trainer.create_optimizer().param_groups for p in group["params"]]
    inputs = {key: v for key, v in batch.items() if key != "num_items_in_batch"}
    model.zero_grad()
    model(**inputs).loss.backward()  # a causal LM's loss without num_items_in_batch: the mean over its targets
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).double() for p in params])


def _count_text(reference: Run, extra: dict, g_mean: torch.Tensor, tol: float) -> str | None:
    g = reference.ranks[0]["gradients"][0]
    norm = float(g.norm())
    logged = extra["grad_norms"][0] if extra["grad_norms"] else None
    if logged is not None and norm < logged * (1 - 1e-6):
        g = g * (logged / norm)  # clipped before the step: the logged norm is the one before clipping
    ratio = float(g @ g_mean) / float(g_mean @ g_mean)
    if abs(ratio - 1) <= tol:
        return None
    labels = extra["first_batch"].get("labels")
    if labels is not None:
        counted, targets = int(labels.ne(-100).sum()), int(labels[..., 1:].ne(-100).sum())
        if abs(ratio - targets / counted) <= tol:
            return (f"targets counted before the shift: the Trainer's update is {ratio:.4f} of the mean loss's, "
                    f"= {targets} targets / {counted} labels of the first update; it counts every label, one per row "
                    "more than a causal LM's loss averages over (GPT-2 has no loss_type: set "
                    "model.loss_type = 'ForCausalLM' before building the Trainer)")
    return (f"the full batch is not the mean loss: the Trainer's first update is {ratio:.4g} times the gradient of "
            "the model's own mean loss over the same rows; its count (num_items_in_batch) is not the number of "
            "targets the loss averages over")


def check_trainer_invariance(make_trainer, *, grad_accum_steps: int = 4, per_device_train_batch_size: int = 2,
                             num_processes=(1, 2), tol: float = 1e-4, timeout: float = 600.0,
                             progress: bool = True) -> InvarianceReport:
    """Run ``make_trainer(grad_accum_steps, per_device_train_batch_size).train()`` at GA k and as its full batch.

    ``make_trainer`` builds your ``Trainer`` from scratch with those two ``TrainingArguments``
    (the model from a seed, ``logging_steps=1`` so every update's loss is compared, a fresh
    ``output_dir``). Besides the invariance, the full batch's first update is compared with the
    gradient of the model's own mean loss over its targets: that catches a count that is wrong
    at GA 1 too (the Trainer's count before the shift, on GPT-2).
    """
    if not callable(make_trainer):
        raise TypeError("make_trainer must be a callable make_trainer(grad_accum_steps, per_device_train_batch_size) "
                        f"returning a transformers Trainer, got {type(make_trainer).__name__}")
    counts, tol = _check_settings(grad_accum_steps, per_device_train_batch_size, num_processes, tol)
    extras: dict = {}

    def run_at(k, mbs, p):
        began = time.perf_counter()
        results = launch(record_call, (_trainer_entry, make_trainer, k, mbs, p == 1 and k == 1),
                         num_processes=p, timeout=timeout)
        ranks = [{key: r[key] for key in ("before", "after", "gradients", "concerns", "feeds", "pending")}
                 for r in results]
        if len(ranks[0]["after"]) == 0:
            raise InvarianceCheckError(f"no update recorded: Trainer.train() made no update on {processes_text(p)} "
                                       f"at GA {k}")
        run = Run(p, k, mbs, ranks, results[0]["result"]["losses"] or None, time.perf_counter() - began,
                  losses_from="the Trainer's log history")
        extras[id(run)] = results[0]["result"]
        return run

    report = _check(run_at, grad_accum_steps, per_device_train_batch_size, counts, tol, progress)
    found = []
    for reference in report.runs:
        extra = extras.get(id(reference))
        if reference.grad_accum_steps == 1 and extra and extra["first_batch"]:
            g_mean = _mean_loss_gradient(make_trainer, reference.micro_batch_size, extra["first_batch"])
            text = _count_text(reference, extra, g_mean, tol)
            if text is not None and text not in found:
                found.append(text)
    if not found:
        return report
    return InvarianceReport(verdict="failed", tol=tol, comparisons=report.comparisons,
                            diagnosis=(*report.diagnosis, *found), notes=report.notes, runs=report.runs,
                            cannot_judge=report.cannot_judge)

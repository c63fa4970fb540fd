"""Token-normalised gradient accumulation for a causal language model, with Accelerate.

Copy this file into an empty folder and run it; it needs torch, accelerate and transformers.

    python train_causal_lm.py                                     # one process: a GPU if there is one, else the CPU
    torchrun --nproc_per_node 4 train_causal_lm.py                # one process per GPU
    accelerate launch --multi_gpu --num_processes 4 train_causal_lm.py
    ACCELERATE_USE_CPU=1 torchrun --nproc_per_node 2 train_causal_lm.py      # two CPU processes (gloo)
    python train_causal_lm.py --mixed_precision bf16              # bf16 autocast; fp16 needs a GPU

The device is Accelerate's choice: a GPU where there is one, the CPU (gloo between
processes) where there is none; `--cpu` forces the CPU. Without arguments it trains a tiny
Llama, built from a config, on rows of very different lengths, then checks itself: rank 0
reruns this same file as the full batch (one process, GA 1, one micro-batch of every
update's rows) and compares the weights after every update and the logged losses.
`--no_check` skips that; `--model PATH_OR_NAME` and `--text FILE` train your own model
on your own lines.

What the recipe (`train_causal_lm`) gets right, and lesson 05 of gaccum explains:
- every window of GA micro-batches is read before its first backward, so the number of
  targets N of the whole update (after the causal shift, gathered over the processes) is
  known; each micro-batch's summed loss is scaled by GA x processes / N (`backward` divides
  by GA, DDP averages over processes);
- `no_sync` on every micro-batch but the window's last, forward included: one all-reduce
  per update; the gradient is clipped after it, as the full batch's would be;
- the loss it logs is the loss per target of the whole update, gathered once per update;
  no value is read back to the host per micro-batch;
- data that does not divide evenly among the processes is filled with rows that have no
  targets (`--uneven pad`), so no row counts twice; Accelerate's own answer, `even_batches`,
  repeats rows from the start of the data (`--uneven repeat`) and is then not the full batch.

What it is written for: one device (CPU, a GPU, Apple's MPS), DDP on CPUs and GPUs, bf16/fp16
autocast. What has run it: the CPU, as one process and as 2 processes over gloo, in float32 and
bf16 (gaccum's tests); a GPU, fp16 and MPS not yet. Under DeepSpeed, FSDP or any other backend
it stops and says why (`check_backend`).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.utils import DistributedType

IGNORE_INDEX = -100  # the label of a position that is not a target (padding), as in Hugging Face models
UNEVEN_CHOICES = ("pad", "repeat")
OPTIMIZERS = {"sgd": torch.optim.SGD, "adamw": torch.optim.AdamW}
# What "equal to the float32 full batch" means. float32 rounding: the default run differs by about 1e-7.
# Mixed precision is compared with the float32 full batch: bf16 autocast on CPU, the default 8 updates on
# 2 processes, measured 3e-4 to 9e-4 (seeds 0 and 1); it grows as training goes on. fp16 is not measured
# yet (it needs a GPU): it keeps more mantissa bits than bf16, but its loss scaler skips an update whenever
# a gradient overflows, and a skipped update puts the run a whole update off its full batch.
TOLERANCES = {"no": 1e-6, "bf16": 5e-3, "fp16": 5e-3}
# Variables a launcher sets; the full-batch check clears them to rerun this file as one plain process.
LAUNCH_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                    "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
                    "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE",
                    "TORCHELASTIC_ERROR_FILE", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE",
                    "MV2_COMM_WORLD_SIZE")


# ----------------------------------------------------------------------------------------------
# The recipe: what you copy into your own training script.
# ----------------------------------------------------------------------------------------------


def collate_rows(rows):
    """Right-pad rows of token ids: input_ids (pad id 0) and labels (-100 wherever there is no target)."""
    length = max(1 if row is None else len(row) for row in rows)
    input_ids = torch.zeros(len(rows), length, dtype=torch.long)
    labels = torch.full((len(rows), length), IGNORE_INDEX, dtype=torch.long)
    for i, row in enumerate(rows):
        if row is not None:  # None is a row without targets (pad_with_target_free_rows)
            input_ids[i, : len(row)] = torch.as_tensor(row)
            labels[i, : len(row)] = torch.as_tensor(row)
    return {"input_ids": input_ids, "labels": labels}


def pad_with_target_free_rows(rows, multiple):
    """Append rows without targets (None) until every process gets the same number of full micro-batches.

    Accelerate's default (`even_batches`) fills the last micro-batches with rows from the start
    of the data instead, and those rows then count twice in the last update.
    """
    return list(rows) + [None] * (-len(rows) % multiple)


def summed_next_token_loss(model, batch):
    """Cross-entropy summed over the targets: position t predicts token t + 1 (the causal shift)."""
    output = model(input_ids=batch["input_ids"])
    logits = getattr(output, "logits", output)  # a Hugging Face model's output, or a module that returns logits
    logits, targets = logits[:, :-1], batch["labels"][:, 1:]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE_INDEX,
                           reduction="sum")


def check_backend(accelerator):
    """Stop, saying why, where this loop would train wrongly."""
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        raise RuntimeError(
            "DeepSpeed is not supported by this loop: under DeepSpeed `accelerator.backward` steps the engine whenever "
            "`accelerator.sync_gradients` is True, and this loop never sets it False (it uses no_sync): under ZeRO 2 "
            "and 3 the engine would step after every micro-batch, and under ZeRO 0 and 1 no_sync is the engine's own, "
            "which refuses that step. DeepSpeed accumulates itself (its own gradient_accumulation_steps) "
            "and needs a loop written for its engine; this one is not.")
    if accelerator.distributed_type not in (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU):
        raise RuntimeError(
            f"{accelerator.distributed_type.value} is not supported by this loop, which is written for one device and "
            "for DDP. " + ("FSDP shards the gradients, and under no_sync keeps a whole unsharded copy until the "
                           "window's last micro-batch; check it against a DDP run of the same data before trusting "
                           "it." if accelerator.distributed_type == DistributedType.FSDP else ""))
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched != accelerator.num_processes:
        raise RuntimeError(
            f"the launcher started {launched} processes but Accelerate sees {accelerator.num_processes}: each "
            "process would train alone. On a machine without GPUs set ACCELERATE_USE_CPU=1 (or pass --cpu).")


def check_settings(rows, *, grad_accum_steps, micro_batch_size, epochs, optimizer, uneven):
    """A clear error for settings that would otherwise fail deep inside, or train wrongly."""
    for name, value in (("grad_accum_steps", grad_accum_steps), ("micro_batch_size", micro_batch_size),
                        ("epochs", epochs)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer of at least 1, got {value!r}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {sorted(OPTIMIZERS)}, got {optimizer!r}")
    if uneven not in UNEVEN_CHOICES:
        raise ValueError(f"uneven must be one of {list(UNEVEN_CHOICES)}, got {uneven!r}")
    if len(rows) == 0 or any(row is not None and len(row) < 2 for row in rows):
        raise ValueError("rows must hold at least one row, each of at least 2 tokens (a row of L tokens has L - 1 "
                         "targets)")


def train_causal_lm(model, rows, *, grad_accum_steps, micro_batch_size, lr, optimizer, epochs=1, max_grad_norm=1.0,
                    final_lr_fraction=0.1, uneven="pad", cpu=False, mixed_precision="no", on_update=None):
    """Train `model` on `rows` (lists of token ids); return the logged loss per target of every update.

    `on_update(update, accelerator, model, stats)` is called before the first update (update 0,
    stats None) and after every update: measurement goes there, not into the loop.
    """
    check_settings(rows, grad_accum_steps=grad_accum_steps, micro_batch_size=micro_batch_size, epochs=epochs,
                   optimizer=optimizer, uneven=uneven)
    accelerator = Accelerator(cpu=cpu, mixed_precision=mixed_precision, gradient_accumulation_steps=grad_accum_steps,
                              dataloader_config=DataLoaderConfiguration(even_batches=True))
    check_backend(accelerator)
    if uneven == "pad" and accelerator.num_processes > 1:
        rows = pad_with_target_free_rows(rows, micro_batch_size * accelerator.num_processes)
    loader = torch.utils.data.DataLoader(rows, batch_size=micro_batch_size, collate_fn=collate_rows)
    optimizer = OPTIMIZERS[optimizer](model.parameters(), lr=lr)
    # A prepared scheduler steps num_processes times per update (lesson 09): size it in those steps.
    steps = epochs * math.ceil(math.ceil(len(loader) / accelerator.num_processes) / grad_accum_steps)
    steps *= accelerator.num_processes
    decay = lambda step: 1 - (1 - final_lr_fraction) * min(step / steps, 1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, decay)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    scale = grad_accum_steps * accelerator.num_processes  # undoes backward's / GA and DDP's mean over processes
    losses = []
    if on_update is not None:
        on_update(0, accelerator, model, None)
    for _epoch in range(epochs):
        batches = iter(loader)
        while window := list(itertools.islice(batches, grad_accum_steps)):  # GA micro-batches, fewer at the end
            # N: the update's targets, after the shift, on every process, known before any backward.
            local_targets = sum(batch["labels"][:, 1:].ne(IGNORE_INDEX).sum() for batch in window)
            targets = accelerator.gather(local_targets.reshape(1)).sum()
            local_loss = 0
            for i, batch in enumerate(window):
                last = i == len(window) - 1
                with contextlib.nullcontext() if last else accelerator.no_sync(model):  # the forward inside too
                    loss_sum = summed_next_token_loss(model, batch)
                    accelerator.backward(loss_sum * scale / targets)
                local_loss = local_loss + loss_sum.detach()
            # The last backward all-reduced the whole update's gradient: clip that, never a partial sum.
            grad_norm = accelerator.clip_grad_norm_(model.parameters(), max_grad_norm) if max_grad_norm else None
            update_lr = scheduler.get_last_lr()[0]
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            losses.append(accelerator.gather(local_loss.reshape(1)).sum() / targets)  # the loss per target
            if on_update is not None:
                stats = {"loss": losses[-1], "targets": targets, "local_targets": local_targets,
                         "grad_norm": grad_norm, "lr": update_lr}
                on_update(len(losses), accelerator, model, stats)
    return torch.stack(losses).tolist()


# ----------------------------------------------------------------------------------------------
# The demonstration around it: data, a model, progress, and the check against the full batch.
# ----------------------------------------------------------------------------------------------


def demo_rows(num_rows, *, vocab_size, min_length=2, max_length=40, seed=0):
    """Rows of very different lengths, each a run of tokens with its own start and stride (learnable)."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(num_rows):
        length = int(torch.randint(min_length, max_length + 1, (), generator=generator))
        start, stride = (int(v) for v in torch.randint(1, vocab_size, (2,), generator=generator))
        rows.append([1 + (start + t * stride) % (vocab_size - 1) for t in range(length)])
    return rows


def tiny_llama(vocab_size, *, seed=0, hidden_size=32, num_layers=2):
    """A freshly initialised Llama from a config: the same weights in every process for the same seed."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                         num_hidden_layers=num_layers, num_attention_heads=2, num_key_value_heads=2,
                         max_position_embeddings=256, pad_token_id=0)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def text_rows(path, encode, num_rows):
    """The first `num_rows` non-empty lines of a text file, encoded; a line of fewer than 2 tokens has no target."""
    lines = [line for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
    rows = [list(encode(line)) for line in lines[:num_rows]]
    kept = [row for row in rows if len(row) >= 2]
    if not kept:
        raise SystemExit(f"--text {path}: no line gives 2 tokens or more, so there is nothing to predict")
    if len(kept) < len(rows) and int(os.environ.get("RANK", "0")) == 0:
        print(f"--text: left out {len(rows) - len(kept)} line(s) of fewer than 2 tokens (no target)", file=sys.stderr)
    return kept


def model_and_rows(args):
    """The model, and the rows of token ids it trains on."""
    if args.model is None and args.text is None:
        return tiny_llama(args.vocab_size, seed=args.seed), demo_rows(args.num_rows, vocab_size=args.vocab_size,
                                                                      seed=args.seed)
    if args.model is None:  # your text with the tiny model: bytes as tokens (1-256; 0 stays padding)
        rows = text_rows(args.text, lambda line: [1 + b for b in line.encode("utf-8")], args.num_rows)
        return tiny_llama(257, seed=args.seed), rows
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_pretrained(args.model)
    if args.text is None:
        return model, demo_rows(args.num_rows, vocab_size=model.config.vocab_size, seed=args.seed)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    return model, text_rows(args.text, lambda line: tokenizer(line)["input_ids"], args.num_rows)


class Progress:
    """The on_update callback of this demonstration: prints the loss, keeps what the check compares."""

    def __init__(self, keep_weights):
        self.keep_weights = keep_weights
        self.weights, self.losses, self.grad_norms, self.lrs, self.targets = [], [], [], [], []
        self.accelerator = None

    def __call__(self, update, accelerator, model, stats):
        self.accelerator = accelerator
        if self.keep_weights:  # a host copy of every weight: fine for this demo, costly for a large model
            unwrapped = accelerator.unwrap_model(model)
            self.weights.append(torch.nn.utils.parameters_to_vector(unwrapped.parameters()).detach().float().cpu())
        if stats is not None:
            loss = stats["loss"].item()  # one read back to the host per update, for the log
            self.losses.append(loss)
            self.lrs.append(stats["lr"])
            self.targets.append(int(stats["targets"]))
            self.grad_norms.append(None if stats["grad_norm"] is None else float(stats["grad_norm"]))
            norm = "" if stats["grad_norm"] is None else f", gradient norm {float(stats['grad_norm']):.3f}"
            accelerator.print(f"update {update}: loss per target {loss:.4f} over {int(stats['targets'])} targets, "
                              f"lr {stats['lr']:.3g}{norm}")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--grad_accum_steps", type=int, default=4, help="micro-batches per optimizer update (GA)")
    add("--micro_batch_size", type=int, default=2, help="rows per micro-batch, per process")
    add("--epochs", type=int, default=2)
    add("--lr", type=float, default=None, help="peak learning rate (default 1.0 for SGD, 0.01 for AdamW)")
    add("--optimizer", choices=tuple(OPTIMIZERS), default="sgd",
        help="sgd (default) or adamw. AdamW divides each weight's step by its own gradient size, so float32 rounding "
             "in gradients near zero shows more: measured 3e-6 from the full batch where SGD is 1e-7")
    add("--max_grad_norm", type=float, default=1.0, help="clip the update's gradient to this norm; 0 turns it off")
    add("--final_lr_fraction", type=float, default=0.1, help="the learning rate falls linearly to this fraction")
    add("--uneven", choices=UNEVEN_CHOICES, default="pad",
        help="data that does not divide among the processes: pad with rows without targets, or let Accelerate "
             "repeat rows from the start (even_batches)")
    add("--mixed_precision", choices=("no", "bf16", "fp16"), default="no")
    add("--cpu", action="store_true", help="train on the CPU even where there is a GPU")
    add("--num_rows", type=int, default=50, help="rows of data (the default 50 does not divide evenly)")
    add("--vocab_size", type=int, default=64, help="vocabulary of the tiny model on the demo rows (257 with --text)")
    add("--seed", type=int, default=0)
    add("--model", default=None, help="a Hugging Face causal LM (name or local folder) instead of the tiny Llama")
    add("--text", default=None, help="a text file, one training row per non-empty line")
    add("--no_check", action="store_true", help="skip the comparison with the full batch")
    add("--tolerance", type=float, default=None,
        help="largest weight difference that counts as equal (default 1e-6; 5e-3 under mixed precision)")
    add("--report", default=None, help="write what rank 0 measured to this JSON file")
    add("--save_trajectory", default=None, help=argparse.SUPPRESS)  # the full-batch rerun's weights, for the check
    args = parser.parse_args(argv)
    for name in ("grad_accum_steps", "micro_batch_size", "epochs", "num_rows"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if not 0 <= args.final_lr_fraction <= 1:
        parser.error(f"--final_lr_fraction must be in [0, 1], got {args.final_lr_fraction}")
    if args.lr is None:
        args.lr = 1.0 if args.optimizer == "sgd" else 0.01
    if args.tolerance is None:
        args.tolerance = TOLERANCES[args.mixed_precision]
    if args.vocab_size < 3:
        parser.error(f"--vocab_size must be at least 3, got {args.vocab_size}")
    return args


def full_batch_rerun(args, num_processes, out):
    """This file again as one plain process, GA 1, one micro-batch holding each update's rows."""
    rows_per_update = args.micro_batch_size * args.grad_accum_steps * num_processes
    command = [sys.executable, os.path.abspath(__file__), "--grad_accum_steps", "1", "--micro_batch_size",
               str(rows_per_update), "--no_check", "--save_trajectory", str(out)]
    # No --mixed_precision: the reference is always float32, so a bf16/fp16 run reports its distance to it.
    for name in ("epochs", "lr", "optimizer", "max_grad_norm", "final_lr_fraction", "num_rows", "vocab_size", "seed",
                 "model", "text"):
        if getattr(args, name) is not None:
            command += [f"--{name}", str(getattr(args, name))]
    if args.cpu:
        command.append("--cpu")
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES}
    subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL)
    return torch.load(out)


def compare(weights, losses, reference, tolerance):
    """Largest and mean weight difference over every update (a one-sided shift shows in the mean too)."""
    difference = (torch.stack(weights) - reference["weights"]).abs()
    loss_difference = max(abs(a - b) for a, b in zip(losses, reference["losses"], strict=True))
    return {"updates": len(losses), "largest_weight_difference": float(difference.max()),
            "mean_weight_difference": float(difference.mean()), "largest_loss_difference": loss_difference,
            "tolerance": tolerance, "equal": bool(difference.max() <= tolerance)}


def main(argv=None):
    args = parse_args(argv)
    model, rows = model_and_rows(args)
    checking = not args.no_check or args.save_trajectory is not None
    progress = Progress(keep_weights=checking)
    train_causal_lm(model, rows, grad_accum_steps=args.grad_accum_steps, micro_batch_size=args.micro_batch_size,
                    lr=args.lr, epochs=args.epochs, optimizer=args.optimizer, max_grad_norm=args.max_grad_norm,
                    final_lr_fraction=args.final_lr_fraction, uneven=args.uneven, cpu=args.cpu,
                    mixed_precision=args.mixed_precision, on_update=progress)
    accelerator = progress.accelerator
    if args.save_trajectory is not None:
        torch.save({"weights": torch.stack(progress.weights), "losses": progress.losses}, args.save_trajectory)
    report = {"num_processes": accelerator.num_processes, "distributed_type": accelerator.distributed_type.value,
              "device": str(accelerator.device), "mixed_precision": args.mixed_precision, "uneven": args.uneven,
              "losses": progress.losses, "lrs": progress.lrs, "grad_norms": progress.grad_norms,
              "update_targets": progress.targets, "final_weights": progress.weights[-1].tolist() if checking else None}
    is_full_batch = args.grad_accum_steps == 1 and accelerator.num_processes == 1
    status = 0
    if not args.no_check and not is_full_batch and accelerator.is_main_process:
        with tempfile.TemporaryDirectory() as folder:
            reference = full_batch_rerun(args, accelerator.num_processes, Path(folder) / "full_batch.pt")
        report["check"] = result = compare(progress.weights, progress.losses, reference, args.tolerance)
        verdict = "equals" if result["equal"] else "does NOT equal"
        precision = "" if args.mixed_precision == "no" else f" in {args.mixed_precision}"
        print(f"GA {args.grad_accum_steps} on {accelerator.num_processes} process(es){precision} {verdict} "
              f"its float32 full batch: over "
              f"{result['updates']} updates the weights differ by at most {result['largest_weight_difference']:.1e} "
              f"(mean {result['mean_weight_difference']:.1e}, tolerance {args.tolerance:.0e}), the logged losses "
              f"by {result['largest_loss_difference']:.1e}", flush=True)
        if not result["equal"] and args.optimizer == "adamw":
            print("AdamW divides each weight's step by its own gradient size, which magnifies float32 rounding where "
                  "a gradient is near zero: compare the mean difference, or allow it with --tolerance 1e-5", flush=True)
        status = 0 if result["equal"] else 1
    if args.report is not None and accelerator.is_main_process:
        Path(args.report).write_text(json.dumps(report))
    accelerator.wait_for_everyone()  # the other ranks wait for the check, then all leave together
    accelerator.end_training()
    return status


if __name__ == "__main__":
    sys.exit(main())

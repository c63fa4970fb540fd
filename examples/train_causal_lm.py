r"""Token-normalised gradient accumulation for a causal language model, with Accelerate.

The recipe is `train_causal_lm`, right below; the rest trains a tiny Llama with it on 50 rows of very
different lengths (they do not divide evenly: every epoch ends on a short window). Copy this file into an
empty folder and run it; it needs torch, accelerate and transformers:

    python train_causal_lm.py                                     # one process: a GPU if there is one, else the CPU
    torchrun --nproc_per_node 4 train_causal_lm.py                # one process per GPU
    accelerate launch --multi_gpu --num_processes 4 train_causal_lm.py
    ACCELERATE_USE_CPU=1 torchrun --nproc_per_node 2 train_causal_lm.py      # two CPU processes (gloo)
    python train_causal_lm.py --mixed_precision bf16              # bf16 autocast; fp16 needs a GPU

gaccum's verifier checks it from outside: it runs this file at GA 4 on 1 and on 2 processes and as its full
batch (one process, GA 1, each update's rows in one micro-batch), then compares the weights after every
update and the printed losses (gaccum's docs/check_accumulation.md):

    gaccum-check invariance -- python train_causal_lm.py --cpu \
        --grad_accum_steps {grad_accum_steps} --micro_batch_size {micro_batch_size}

Lesson 05 of gaccum shows `train_causal_lm` and sums up each line's reason; the comments here give them too.
It is written for one device and for DDP, in float32 or bf16/fp16 autocast; under DeepSpeed, FSDP or another
backend it stops and says why (`check_backend`).
"""

import argparse
import contextlib
import itertools
import math
import os

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import DistributedType
from transformers import LlamaConfig, LlamaForCausalLM

IGNORE_INDEX = -100  # the label of a position that is not a target (padding), as in Hugging Face models


def train_causal_lm(model, loader, optimizer, accelerator, *, epochs=1, max_grad_norm=1.0, final_lr_fraction=0.1,
                    on_update=None):
    """Train on `loader`'s micro-batches, GA (the accelerator's gradient_accumulation_steps) per update.

    The learning rate falls linearly towards `final_lr_fraction` of the optimizer's. Returns the logged loss
    per target of every update. `on_update(update, accelerator, model, stats)`, for measurement, is called
    before the first update (update 0, stats None) and after each."""
    grad_accum_steps = accelerator.gradient_accumulation_steps
    check_settings(grad_accum_steps, epochs, max_grad_norm, final_lr_fraction)
    check_backend(accelerator)
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
                on_update(len(losses), accelerator, model, {"loss": losses[-1], "targets": targets,
                          "local_targets": local_targets, "grad_norm": grad_norm, "lr": update_lr})
    return torch.stack(losses).tolist()


def summed_next_token_loss(model, batch):
    """Cross-entropy summed over the targets: position t predicts token t + 1 (the causal shift)."""
    output = model(input_ids=batch["input_ids"])
    logits = getattr(output, "logits", output)  # a Hugging Face model's output, or a module that returns logits
    logits, targets = logits[:, :-1], batch["labels"][:, 1:]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE_INDEX,
                           reduction="sum")


def collate_rows(rows):
    """Right-pad rows of token ids: input_ids (pad id 0) and labels (-100 wherever there is no target)."""
    length = max(1 if row is None else len(row) for row in rows)
    input_ids = torch.zeros(len(rows), length, dtype=torch.long)
    labels = torch.full((len(rows), length), IGNORE_INDEX, dtype=torch.long)
    for i, row in enumerate(rows):
        if row is not None:  # None is a row without targets (padded_loader)
            input_ids[i, : len(row)] = torch.as_tensor(row)
            labels[i, : len(row)] = torch.as_tensor(row)
    return {"input_ids": input_ids, "labels": labels}


def padded_loader(rows, micro_batch_size, num_processes):
    """Micro-batches of `rows`, topped up with rows without targets (None) so that every process gets as many.

    Accelerate's `even_batches` would top them up with rows from the start of the data: counted twice."""
    if isinstance(micro_batch_size, bool) or not isinstance(micro_batch_size, int) or micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be an integer of at least 1, got {micro_batch_size!r}")
    if len(rows) == 0 or any(len(row) < 2 for row in rows):
        raise ValueError("rows must hold at least one row, each of at least 2 tokens (L tokens give L - 1 targets)")
    rows = list(rows) + [None] * (-len(rows) % (micro_batch_size * num_processes))
    return torch.utils.data.DataLoader(rows, batch_size=micro_batch_size, collate_fn=collate_rows)


def check_settings(grad_accum_steps, epochs, max_grad_norm, final_lr_fraction):
    """A clear error for settings that would otherwise fail deep inside, or train wrongly."""
    for name, value in (("grad_accum_steps", grad_accum_steps), ("epochs", epochs)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer of at least 1, got {value!r}")
    if max_grad_norm is not None and not max_grad_norm >= 0:
        raise ValueError(f"max_grad_norm must be at least 0 (0 or None: no clipping), got {max_grad_norm!r}")
    if not 0 <= final_lr_fraction <= 1:
        raise ValueError(f"final_lr_fraction must be in [0, 1], got {final_lr_fraction!r}")


def check_backend(accelerator):
    """Stop, saying why, where this loop would train wrongly."""
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        raise RuntimeError(
            "DeepSpeed is not supported by this loop: under DeepSpeed `accelerator.backward` steps the engine whenever "
            "`accelerator.sync_gradients` is True, which this loop (never accumulate()) keeps: at ZeRO 0 and 1 that "
            "step falls inside the engine's no_sync, which forbids it; at ZeRO 2 and 3 (the engine's no_sync refuses "
            "them) Accelerate's no_sync does nothing: a step every micro-batch. DeepSpeed accumulates itself.")
    if accelerator.distributed_type not in (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU):
        raise RuntimeError(
            f"{accelerator.distributed_type.value} is not supported by this loop, which is written for one device and "
            "for DDP. " + ("FSDP shards the gradients and under no_sync keeps a whole unsharded copy; check it "
                           "against a DDP run first." if accelerator.distributed_type == DistributedType.FSDP else ""))
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched != accelerator.num_processes:
        raise RuntimeError(
            f"the launcher started {launched} processes but Accelerate sees {accelerator.num_processes}: each "
            "process would train alone. On a machine without GPUs set ACCELERATE_USE_CPU=1 (or pass --cpu).")


def demo_rows(num_rows, *, vocab_size, min_length=2, max_length=40, seed=0):
    """The demonstration's rows: very different lengths, each a run of tokens with its own start and stride."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(num_rows):
        length = int(torch.randint(min_length, max_length + 1, (), generator=generator))
        start, stride = (int(v) for v in torch.randint(1, vocab_size, (2,), generator=generator))
        rows.append([1 + (start + t * stride) % (vocab_size - 1) for t in range(length)])
    return rows


def tiny_llama(vocab_size, seed=0):
    """A freshly initialised Llama from a config: the same weights in every process for the same seed."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0)
    return LlamaForCausalLM(config)


def print_update(update, accelerator, model, stats):
    """The demonstration's on_update: one line per update, the only value read back to the host."""
    if stats is not None:
        norm = "" if stats["grad_norm"] is None else f", gradient norm {float(stats['grad_norm']):.3f}"
        accelerator.print(f"update {update}: loss per target {stats['loss'].item():.4f} over "
                          f"{int(stats['targets'])} targets, lr {stats['lr']:.3g}{norm}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grad_accum_steps", type=int, default=4, help="micro-batches per optimizer update (GA)")
    parser.add_argument("--micro_batch_size", type=int, default=2, help="rows per micro-batch, per process")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1.0, help="peak learning rate of plain SGD")
    parser.add_argument("--max_grad_norm", type=float, default=1.0, help="clip each update's gradient; 0: no clip")
    parser.add_argument("--num_rows", type=int, default=50, help="rows of data (the default 50 does not divide)")
    parser.add_argument("--mixed_precision", choices=("no", "bf16", "fp16"), default="no")
    parser.add_argument("--cpu", action="store_true", help="train on the CPU even where there is a GPU")
    args = parser.parse_args(argv)
    accelerator = Accelerator(cpu=args.cpu, mixed_precision=args.mixed_precision,
                              gradient_accumulation_steps=args.grad_accum_steps)
    accelerator.print(f"training on {accelerator.device}, {accelerator.num_processes} process(es)")
    model = tiny_llama(64)
    loader = padded_loader(demo_rows(args.num_rows, vocab_size=64), args.micro_batch_size, accelerator.num_processes)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    train_causal_lm(model, loader, optimizer, accelerator, epochs=args.epochs, max_grad_norm=args.max_grad_norm,
                    on_update=print_update)
    accelerator.end_training()


if __name__ == "__main__":
    main()

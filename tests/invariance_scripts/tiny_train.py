"""A tiny training script for the invariance check's own tests: torch only, a few updates, DDP under torchrun.

A regression of 32 rows on 4 features; GA micro-batches of --micro_batch_size rows per update and
process, the mean loss of each micro-batch divided by GA (every micro-batch has as many rows, so
that is the mean over the update). Each flag breaks one thing the check must tell apart:

    --boundary_from_zero   step when step % GA == 0 (step counted from 0): an off-by-one boundary
    --shuffle_seed S       shuffle the rows with a generator seeded S + rank (other rows on 2 processes)
    --raise_on_rank R      raise a ValueError on rank R before training
    --hang_on_rank R       rank R sleeps before training, the others wait for it in their first all-reduce
    --log_to_stderr        print the losses on stderr
    --divide_twice         divide the loss by GA twice
"""

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--grad_accum_steps", type=int, required=True)
    parser.add_argument("--micro_batch_size", type=int, required=True)
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--boundary_from_zero", action="store_true")
    parser.add_argument("--shuffle_seed", type=int, default=None)
    parser.add_argument("--raise_on_rank", type=int, default=None)
    parser.add_argument("--hang_on_rank", type=int, default=None)
    parser.add_argument("--log_to_stderr", action="store_true")
    parser.add_argument("--divide_twice", action="store_true")
    args = parser.parse_args()
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    if world > 1:
        dist.init_process_group("gloo")
    if args.raise_on_rank == rank:
        raise ValueError(f"rank {rank} cannot read its shard")
    if world > 1 and args.hang_on_rank == rank:
        time.sleep(3600)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(args.rows, 4, generator=generator)
    y = x @ torch.tensor([1.0, -2.0, 0.5, 3.0]) + 0.1 * torch.randn(args.rows, generator=generator)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    order = torch.arange(args.rows)
    if args.shuffle_seed is not None:
        order = torch.randperm(args.rows, generator=torch.Generator().manual_seed(args.shuffle_seed + rank))
    per_step = args.micro_batch_size * world  # rows of one micro-step over every process, rank r's at r, r + world, ..
    steps = args.rows // per_step
    k = args.grad_accum_steps
    logged = 0.0
    for step in range(steps):
        rows = order[step * per_step:(step + 1) * per_step][rank::world]
        loss = torch.nn.functional.mse_loss(model(x[rows]).squeeze(-1), y[rows]) / k
        if args.divide_twice:
            loss = loss / k
        loss.backward()
        logged += loss.item()
        at_boundary = step % k == 0 if args.boundary_from_zero else (step + 1) % k == 0
        if at_boundary:
            optimizer.step()
            optimizer.zero_grad()
            if world > 1:
                total = torch.tensor([logged])
                dist.all_reduce(total)
                logged = float(total) / world
            if rank == 0:
                out = sys.stderr if args.log_to_stderr else sys.stdout
                print(f"update {step // k + 1}: loss {logged:.6f}", file=out)
            logged = 0.0
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""The lesson-04 experiment as a script, for several GPUs or machines.

Token-normalised (or naive) accumulation on the seed's variable-length toy, through
Accelerate, in however many processes the launcher starts. Every rank prints one JSON line
with its target count and final weights; rank 0 then compares with the simulator.

    # two CPU processes (gloo); ACCELERATE_USE_CPU=1 is required, or each process trains alone
    ACCELERATE_USE_CPU=1 torchrun --nproc_per_node 2 examples/train_accumulation.py
    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 examples/train_accumulation.py

    # GPUs: one process per GPU
    torchrun --nproc_per_node 4 examples/train_accumulation.py
    accelerate launch --multi_gpu --num_processes 4 examples/train_accumulation.py

    # several machines: the usual torchrun --nnodes/--node_rank/--rdzv_endpoint flags
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
from accelerate import PartialState

from gaccum_lib import accelerate_train, seed_sequences, simulate
from gaccum_lib.compare import fmt_weights


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", default="token_normalised", choices=["token_normalised", "mean_of_means"])
    parser.add_argument("--grad-accum-steps", type=int, default=2)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--lr", type=float, default=0.08)
    args = parser.parse_args(argv)

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    # The seed sizes the data as micro-batch x GA x processes: one optimizer update.
    problem = seed_sequences(args.micro_batch_size * args.grad_accum_steps * world_size)
    record = accelerate_train(problem.spec, args.strategy, grad_accum_steps=args.grad_accum_steps,
                              micro_batch_size=args.micro_batch_size, lr=args.lr)
    if record["num_processes"] != world_size:
        print(f"rank {record['rank']}: the launcher started {world_size} processes but Accelerate sees "
              f"{record['num_processes']}: on a machine without GPUs set ACCELERATE_USE_CPU=1", file=sys.stderr)
        return 2
    line = json.dumps({"rank": record["rank"], "num_processes": record["num_processes"],
                       "distributed_type": record["distributed_type"], "local_targets": record["local_counts"].tolist(),
                       "total_targets": record["window_counts"].tolist(),
                       "final_weights": record["weights"][-1].tolist()})
    # One write per line: print() writes the text and the newline separately, and two ranks interleave.
    sys.stdout.write(line + "\n")
    sys.stdout.flush()
    if record["rank"] == 0:
        simulated = simulate(problem, args.strategy, grad_accum_steps=args.grad_accum_steps,
                             micro_batch_size=args.micro_batch_size, num_processes=world_size, lr=args.lr)
        difference = float(np.abs(simulated.final_weights - record["weights"][-1]).max())
        sys.stdout.write(f"rank 0: final weights {fmt_weights(record['weights'][-1])}, simulator "
                         f"{fmt_weights(simulated.final_weights)}, largest difference {difference:.1e}\n")
        sys.stdout.flush()
    # Leave together and close the process group.
    state = PartialState()
    state.wait_for_everyone()
    state.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Leave without Python's shutdown: a gloo worker thread can still be freeing a finished all-gather,
    # which needs the GIL, and during shutdown that aborts the process ("terminate called without an
    # active exception"; gdb: ~AsyncAllgatherWork in ProcessGroupGloo::runLoop, as in pytorch/pytorch#179291).
    # Seen here in 1 of about 20 runs with the naive strategy on a busy machine.
    os._exit(code)

"""Answers to the exercises that have a check cell; tests/test_solutions.py runs each through its checker.

Keys are "<lesson>.<exercise>" as in the notebooks' `check("03.2", my_order)` cells.
The reasoning behind each answer, and the answers to the discussion exercises, are in README.md here.
"""



def my_accumulation_step(model, optimizer, micro_batches, loss_fn, ctx):
    """05.2: one update over this rank's micro-batches, as in train_causal_lm (ctx stands in for the Accelerator)."""
    local = sum(int(batch["labels"][:, 1:].ne(-100).sum()) for batch in micro_batches)  # after the shift
    total = ctx.all_reduce_sum(local)  # accelerator.gather(...).sum(): the whole update's N, before any backward
    for batch in micro_batches:
        loss_sum, _ = loss_fn(model, batch)
        ctx.backward(loss_sum * ctx.grad_accum_steps * ctx.num_processes / total)
    optimizer.step()
    optimizer.zero_grad()


def my_collate(rows):
    """08.2: collate's batch plus shift_labels, which the Trainer counts and the loss uses: position t holds
    labels[t + 1], the last position -100 (nothing to predict)."""
    import torch

    from gaccum_lib.real_stack import collate

    batch = collate(rows)
    batch["shift_labels"] = torch.nn.functional.pad(batch["labels"][:, 1:], (0, 1), value=-100)
    return batch


ANSWERS = {
    "00.2": 4,                          # GA: the gradients of 4 micro-batch means add up
    "01.1": 2.3156,                     # sizes 3, 3, 2: the 2-point mean weighs as much as a 3-point one
    "01.2": 4.0392,                     # no zero_grad: the 2nd update adds its gradient to the 1st one's
    "02.2": 4 / 3,                      # GA / micro-batches in the short window: 3 means averaged over 3
    "03.1": 0.0230,                     # GA 4: micro-batches of 3, 7, 11, 15 targets, between GA 2 and 8
    "03.2": [1, 8, 2, 7, 3, 6, 4, 5],   # each pair of items holds 9 targets
    "04.1": 116,                        # items 4-7 (5+6+7+8) and 20-23 (21+22+23+24)
    "05.1": 1803,                       # 1835 characters in 32 rows, one target fewer per row
    "05.2": my_accumulation_step,       # summed loss x GA x processes / N, N after the shift and gathered
    "06.2": "state carried over between windows",  # a missing zero_grad shows in the second window
    "07.2": 22.1,                       # (257.0 - 102.3) ms / (GA - 1 = 7), from gaccum_course/saved/benchmarks.json
    "07.3": ("smaller", "larger"),      # cheaper all-reduces shrink the ratio, dearer ones grow it
    "08.1": 0.96,                       # 192 targets / 200 labels over both processes' 8 rows (gathered)
    "08.2": my_collate,                 # shift_labels: the Trainer counts them, the loss uses them
    "09.1": 252,                        # 2 epochs x 3 processes x ceil(ceil(1000 / 3) / 8) = 2 x 3 x 42
    "09.2": 84,                         # split_batches: 2 epochs x ceil(ceil(1000 / 3) / 8), one step an update
    "10.1": (14.9, 1.86),               # 8e9 x 2 bytes / 2^30 unsharded, and that / 8 GPUs as a shard
    "10.2": 1 / 32,                     # / GA twice (the loop's and the engine's), and no x 2 for DDP's mean
    "11.1": 2.0,                        # bnpo: 1/2 token / GA 2 = 1/4, against 1/8 in the full batch
    "11.2": (31, 255),                  # 32 pairs a micro-batch at GA 8; GradCache scores the whole window
    "12.1": 4.0,                        # 1/16 against the shortest row's 14 of the update's 897 targets
    "12.2": (408, 324),                 # rows 16-21, plus rows 0 and 1 again from the plain DataLoader
}

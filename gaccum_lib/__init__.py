"""gaccum_lib: gradient accumulation, right and wrong; the modules follow the lessons.

* :mod:`~gaccum_lib.data` -- the toy problems (regression, variable-length sequences, corpora)
* :mod:`~gaccum_lib.strategies` -- how each strategy scales a micro-batch's loss
* :mod:`~gaccum_lib.sharding` -- which micro-batches each process gets (as Accelerate decides)
* :mod:`~gaccum_lib.simulate` -- train with any strategy on N simulated processes
* :mod:`~gaccum_lib.accelerate_runs` -- the same with real Accelerate in real processes
* :mod:`~gaccum_lib.schedule`, :mod:`~gaccum_lib.memory` -- schedulers and memory under accumulation
* :mod:`~gaccum_lib.lm`, :mod:`~gaccum_lib.real_stack` -- a character transformer; tiny GPT-2 / Llama
* :mod:`~gaccum_lib.rl_losses`, :mod:`~gaccum_lib.unaccumulable` -- RL losses; losses it cannot reproduce

Apart from it: :mod:`gaccum_launch` starts real processes, :mod:`gaccum_check` checks *your*
loop against the full batch, :mod:`gaccum_course` runs the classroom.
"""

from gaccum_launch import LaunchError, launch, reset_accelerate_state  # re-exported: the lessons' launcher

from .accelerate_runs import SYNC_MODES, accelerate_train, fresh_accelerator, real_run
from .compare import cmp, fmt_weights, max_diff
from .data import (
    IGNORE_INDEX,
    Problem,
    count_target_tokens,
    make_problem,
    pad_and_stack,
    seed_sequences,
    sequence_corpus,
    sequences_from_lengths,
    toy_regression,
)
from .lm import LMProblem, count_targets_before_shift, error_vs_ga, tiny_lm
from .sharding import plan_windows, shard_batches
from .simulate import Trajectory, compare_strategies, simulate
from .strategies import LABELS, STRATEGIES, accelerate_backward_loss, plain_backward_loss

__version__ = "0.1.0"

__all__ = [
    "IGNORE_INDEX", "LABELS", "LMProblem", "LaunchError", "Problem", "STRATEGIES", "SYNC_MODES", "Trajectory",
    "accelerate_backward_loss", "accelerate_train", "cmp", "compare_strategies", "count_target_tokens",
    "count_targets_before_shift", "error_vs_ga", "fmt_weights", "fresh_accelerator", "launch", "make_problem",
    "max_diff", "pad_and_stack", "plain_backward_loss", "plan_windows", "real_run", "reset_accelerate_state",
    "seed_sequences", "sequence_corpus", "sequences_from_lengths", "shard_batches", "simulate", "tiny_lm",
    "toy_regression",
]

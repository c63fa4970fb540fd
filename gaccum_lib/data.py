"""The training problems the lessons use: data, collate, model and loss, in one object.

A :class:`Problem` bundles everything a training loop needs, so that the pure-PyTorch
strategies, the N-process simulator and the real Accelerate runs all train exactly the
same thing. Each problem can be rebuilt from a small dict (:attr:`Problem.spec`), which is
how a launched process or a ``torchrun`` script gets the same problem as the notebook.

Problems shipped:

* :func:`toy_regression` -- x = 1..8, y = 2x, one weight, MSE. Every micro-batch has the
  same number of loss terms, so plain accumulation is exact here.
* :func:`seed_sequences` -- the variable-length toy: item i is ``arange(1, i + 2)``,
  labels are ``ids % 2``, padded with -100, a ``Linear(1, 2, bias=False)`` token classifier.
* :func:`sequence_corpus` -- the same kind of items with lengths drawn at random around a
  mean, with a controllable spread (0 = all equal, as packed blocks would be).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch
from torch import nn

from ._checks import check_float, check_int

IGNORE_INDEX = -100  # PyTorch's cross_entropy ignores this label: padding never counts.


def _seeded_init(seed: int, build):
    """Build a module under a private RNG so the global random state is left alone."""
    with torch.random.fork_rng(devices=[]):
        # The CPU generator only, the one fork_rng restores and the weights are drawn from: torch.manual_seed
        # would also reseed every GPU's generator (at once, or when CUDA starts), and nothing would restore it.
        torch.default_generator.manual_seed(seed)
        return build()


@dataclass(frozen=True)
class Problem(ABC):
    """A dataset plus how to batch it, the model to start from and the per-term loss."""

    name: str
    examples: tuple
    spec: dict = field(default_factory=dict)
    model_seed: int = 0

    def __post_init__(self):
        if len(self.examples) == 0:
            raise ValueError(f"{self.name}: the dataset is empty (examples has 0 items); it needs at least 1")

    # --- to be provided by each kind of problem ------------------------------------------------
    @abstractmethod
    def collate(self, examples):
        """Turn a list of examples into one batch."""

    @abstractmethod
    def make_model(self) -> nn.Module:
        """A fresh model at the problem's deterministic initial weights."""

    @abstractmethod
    def loss_sum_and_count(self, model: nn.Module, batch) -> tuple[torch.Tensor, int]:
        """Return (sum of the per-term losses, number of terms) for one batch."""

    @abstractmethod
    def count_targets(self, batch) -> int:
        """Number of loss terms (target tokens) in a batch."""

    # --- shared --------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index):
        # A Problem is also a map-style dataset, so torch's DataLoader can batch it directly.
        return self.examples[index]

    def batch_of(self, indices) -> object:
        """Collate the examples at ``indices`` into one batch."""
        return self.collate([self.examples[i] for i in indices])

    def micro_batch_indices(self, micro_batch_size: int) -> list[list[int]]:
        """Example indices of each micro-batch, in order, as ``DataLoader(shuffle=False)`` makes them."""
        check_int("micro_batch_size", micro_batch_size, minimum=1, maximum=len(self.examples))
        n = len(self.examples)
        return [list(range(s, min(s + micro_batch_size, n))) for s in range(0, n, micro_batch_size)]

    def full_loss(self, model: nn.Module) -> float:
        """Mean loss per term over the whole dataset (what contour plots show)."""
        with torch.no_grad():
            total, count = self.loss_sum_and_count(model, self.collate(list(self.examples)))
        return float(total) / count


# ----------------------------------------------------------------------------------------------
# Toy regression: y = 2x, one weight.
# ----------------------------------------------------------------------------------------------


class ScalarLinear(nn.Module):
    """y = x @ w with a single weight, initialised to ``initial_weight``."""

    def __init__(self, initial_weight: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.full((1, 1), float(initial_weight)))

    def forward(self, inputs):
        return inputs @ self.weight


@dataclass(frozen=True)
class RegressionProblem(Problem):
    initial_weight: float = 0.0

    def collate(self, examples):
        x = torch.tensor([e[0] for e in examples], dtype=torch.float32).view(-1, 1)
        y = torch.tensor([e[1] for e in examples], dtype=torch.float32).view(-1, 1)
        return x, y

    def make_model(self) -> nn.Module:
        return ScalarLinear(self.initial_weight)

    def loss_sum_and_count(self, model, batch):
        x, y = batch
        squared_errors = (model(x) - y) ** 2
        return squared_errors.sum(), squared_errors.numel()

    def count_targets(self, batch) -> int:
        return batch[1].numel()


def toy_regression(num_points: int = 8, slope: float = 2.0, initial_weight: float = 0.0) -> RegressionProblem:
    """x = 1..num_points, y = slope * x: the seed's regression toy (defaults reproduce it)."""
    check_int("num_points", num_points, minimum=1, maximum=10_000)
    check_float("slope", slope)
    check_float("initial_weight", initial_weight)
    examples = tuple((float(x), slope * float(x)) for x in range(1, num_points + 1))
    spec = {"kind": "toy_regression", "num_points": num_points, "slope": slope, "initial_weight": initial_weight}
    return RegressionProblem(name="toy regression", examples=examples, spec=spec, initial_weight=initial_weight)


# ----------------------------------------------------------------------------------------------
# Variable-length sequences, padded with -100, classified token by token.
# ----------------------------------------------------------------------------------------------


def sequence_item(length: int) -> dict:
    """One item of length ``length``: ids 1..length as floats, label = id % 2."""
    input_ids = torch.arange(1, length + 1, dtype=torch.float32)
    return {"input_ids": input_ids, "labels": torch.remainder(input_ids, 2).long()}


def pad_and_stack(examples) -> dict:
    """Collate variable-length items: pad to the longest with -100 (so padding is never a target)."""
    if len(examples) == 0:
        raise ValueError("examples must hold at least one item to collate, got 0")
    pad = nn.utils.rnn.pad_sequence
    input_ids = pad([e["input_ids"] for e in examples], batch_first=True, padding_value=IGNORE_INDEX)
    labels = pad([e["labels"] for e in examples], batch_first=True, padding_value=IGNORE_INDEX)
    if input_ids.shape != labels.shape:
        raise ValueError(f"input_ids and labels must have the same shape, got {tuple(input_ids.shape)} "
                         f"and {tuple(labels.shape)}")
    # Trailing feature axis: the token classifier is Linear(1, 2).
    return {"input_ids": input_ids[..., None], "labels": labels}


def count_target_tokens(labels: torch.Tensor) -> int:
    """Number of labels that contribute to the loss (everything but the -100 padding)."""
    if not isinstance(labels, torch.Tensor):
        # A common slip is passing the whole batch: say which part of it is wanted.
        raise TypeError(f"labels must be a torch.Tensor of label ids (e.g. batch['labels']), "
                        f"got {type(labels).__name__}")
    return int(labels.ne(IGNORE_INDEX).sum())


@dataclass(frozen=True)
class SequenceProblem(Problem):
    """Token classification over variable-length items; loss = summed cross-entropy per token."""

    def collate(self, examples):
        return pad_and_stack(examples)

    def make_model(self) -> nn.Module:
        return _seeded_init(self.model_seed, lambda: nn.Linear(1, 2, bias=False))

    def loss_sum_and_count(self, model, batch):
        logits = model(batch["input_ids"])
        labels = batch["labels"]
        if logits.shape[:-1] != labels.shape:
            raise ValueError(f"logits {tuple(logits.shape)} do not match labels {tuple(labels.shape)}")
        loss_sum = nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="sum", ignore_index=IGNORE_INDEX
        )
        return loss_sum, count_target_tokens(labels)

    def count_targets(self, batch) -> int:
        return count_target_tokens(batch["labels"])

    @property
    def lengths(self) -> list[int]:
        return [len(e["input_ids"]) for e in self.examples]


def sequences_from_lengths(lengths, *, name: str = "sequences", model_seed: int = 0, spec=None) -> SequenceProblem:
    """A :class:`SequenceProblem` whose items have the given lengths (each at least 1)."""
    lengths = [check_int(f"lengths[{i}]", n, minimum=1, maximum=100_000) for i, n in enumerate(lengths)]
    if not lengths:
        raise ValueError("lengths must hold at least one length, got an empty list")
    spec = spec or {"kind": "sequences_from_lengths", "lengths": list(lengths), "model_seed": model_seed}
    return SequenceProblem(name=name, examples=tuple(sequence_item(n) for n in lengths), spec=spec,
                           model_seed=model_seed)


def seed_sequences(num_items: int = 8, model_seed: int = 0) -> SequenceProblem:
    """The seed's variable-length toy: item i has length i + 1 (so lengths 1..num_items).

    With ``model_seed=0`` the classifier starts at [-0.0075, 0.5364], as in the seed.
    The seed sizes the data as ``micro_batch_size * GA * num_processes``: 8 items for one
    process (36 target tokens), 16 for two (136 tokens).
    """
    check_int("num_items", num_items, minimum=1, maximum=10_000)
    spec = {"kind": "seed_sequences", "num_items": num_items, "model_seed": model_seed}
    return sequences_from_lengths(range(1, num_items + 1), name="seed sequences", model_seed=model_seed, spec=spec)


def corpus_lengths(num_sequences: int, mean_length: float, spread: float, seed: int = 0) -> list[int]:
    """Lengths drawn uniformly in ``mean_length * [1 - spread, 1 + spread]`` (at least 1).

    ``spread=0`` makes every sequence the same length (what packing does); ``spread=1``
    ranges from 1 to twice the mean.
    """
    check_int("num_sequences", num_sequences, minimum=1, maximum=100_000)
    check_float("mean_length", mean_length, minimum=1.0, maximum=10_000.0)
    check_float("spread", spread, minimum=0.0, maximum=1.0)
    generator = torch.Generator().manual_seed(check_int("seed", seed, minimum=0))
    u = torch.rand(num_sequences, generator=generator, dtype=torch.float64)
    raw = mean_length * (1.0 + spread * (2.0 * u - 1.0))
    return [max(1, int(math.floor(v + 0.5))) for v in raw.tolist()]


def sequence_corpus(
    num_sequences: int = 64, mean_length: float = 8.0, spread: float = 0.75, seed: int = 0, model_seed: int = 0
) -> SequenceProblem:
    """A variable-length corpus with a controllable spread of lengths (see :func:`corpus_lengths`)."""
    lengths = corpus_lengths(num_sequences, mean_length, spread, seed)
    spec = {"kind": "sequence_corpus", "num_sequences": num_sequences, "mean_length": mean_length,
            "spread": spread, "seed": seed, "model_seed": model_seed}
    return sequences_from_lengths(lengths, name="sequence corpus", model_seed=model_seed, spec=spec)


_BUILDERS = {
    "toy_regression": toy_regression,
    "seed_sequences": seed_sequences,
    "sequence_corpus": sequence_corpus,
    "sequences_from_lengths": lambda lengths, model_seed=0: sequences_from_lengths(lengths, model_seed=model_seed),
}


def register_problem(kind: str, builder) -> None:
    """Make ``make_problem({'kind': kind, ...})`` call ``builder(**rest)`` (used by later modules)."""
    _BUILDERS[kind] = builder


def make_problem(spec: dict) -> Problem:
    """Rebuild a problem from its :attr:`Problem.spec` (how launched processes get the same data)."""
    if not isinstance(spec, dict) or "kind" not in spec:
        raise TypeError(f"spec must be a dict with a 'kind' key, got {spec!r}")
    params = dict(spec)
    kind = params.pop("kind")
    if kind not in _BUILDERS:
        raise ValueError(f"spec['kind'] must be one of {', '.join(sorted(_BUILDERS))}; got {kind!r}")
    return _BUILDERS[kind](**params)

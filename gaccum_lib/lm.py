"""The capstone's problem: a tiny character-level causal language model on a text that ships here.

The text is ``assets/tide_clock.txt``, a short story written for this project (128 lines,
about 8 KB, ASCII). Each line, with its newline, is one training sample, so samples have
very different lengths (15 to 100 characters) -- the situation in which averaging
micro-batch means goes wrong.

* :func:`tiny_lm` builds an :class:`LMProblem`: the first ``num_samples`` lines, or the same
  text *packed* into equal-length blocks (``packed=True``), plus a one-block transformer
  (:class:`TinyCausalLM`) whose initial weights depend only on ``model_seed``. It is
  registered as ``"tiny_lm"``, so ``make_problem(problem.spec)`` rebuilds it inside launched
  processes and :func:`~gaccum_lib.real_run` trains it on real processes.
* The model predicts the *next* character: the loss compares the logits at positions
  ``0..T-2`` with the labels at positions ``1..T-1`` (the causal shift). A row of ``L``
  characters therefore has ``L - 1`` targets; :meth:`LMProblem.count_targets` counts after
  the shift, :func:`count_targets_before_shift` shows the classic mistake (one extra
  target per row).
* :func:`error_vs_ga` measures (and :func:`gaccum_course.plots.plot_error_vs_ga` draws) how far naive and
  token-normalised accumulation end from the full-batch run as GA grows at a fixed
  effective batch.
* The checkers of the lesson's exercises ``"05.1"`` and ``"05.2"`` build on it
  (:func:`gaccum_course.exercises.check`).

Everything runs on the CPU in the calling process (nothing here touches CUDA).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ._checks import check_choice, check_int
from .data import IGNORE_INDEX, Problem, _seeded_init, register_problem

CORPUS = "tide_clock.txt"
PAD = "\x00"  # id 0; never a target (its labels are -100) and, with causal attention, never attended to
DTYPES = {"float32": torch.float32, "float64": torch.float64}


# ----------------------------------------------------------------------------------------------
# The text and its character vocabulary.
# ----------------------------------------------------------------------------------------------


@lru_cache(maxsize=1)
def corpus_text() -> str:
    """The whole shipped text, as it is on disk."""
    return resources.files("gaccum_lib").joinpath("assets", CORPUS).read_text(encoding="utf-8")


def corpus_lines() -> list[str]:
    """Every non-empty line of the text, each with its trailing newline (the samples)."""
    return [line + "\n" for line in corpus_text().splitlines() if line.strip()]


@dataclass(frozen=True)
class CharVocab:
    """Characters <-> ids. Id 0 is padding; the others are the text's characters in sorted order."""

    chars: tuple

    @property
    def size(self) -> int:
        return len(self.chars)

    @property
    def pad_id(self) -> int:
        return 0

    def encode(self, text: str, *, name: str = "text") -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"{name} must be a str, got {type(text).__name__}")
        index = {c: i for i, c in enumerate(self.chars)}
        unknown = sorted({c for c in text if c not in index or c == PAD})
        if unknown:
            raise ValueError(f"{name} has characters the vocabulary does not know: {unknown!r}; "
                             f"use characters of the shipped text ({self.size - 1} of them)")
        return [index[c] for c in text]

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i)] for i in ids if int(i) != self.pad_id)


@lru_cache(maxsize=1)
def vocabulary() -> CharVocab:
    """The character vocabulary of the whole shipped text (the same whatever ``num_samples``)."""
    return CharVocab(chars=(PAD, *sorted(set(corpus_text()) - {"\r"})))


def pack(texts, block_size: int) -> list[str]:
    """Concatenate ``texts`` and cut the result into blocks of exactly ``block_size`` characters.

    The remainder shorter than a block is dropped. This is what "packing" does before
    pre-training: every row has the same length, so every row has the same number of targets.
    """
    check_int("block_size", block_size, minimum=2)
    joined = "".join(texts)
    return [joined[s:s + block_size] for s in range(0, len(joined) - block_size + 1, block_size)]


# ----------------------------------------------------------------------------------------------
# The model: token + position embeddings, causal transformer block(s), a linear head.
# ----------------------------------------------------------------------------------------------


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention in which position t only sees positions 0..t."""

    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out = nn.Linear(d_model, d_model)

    def forward(self, x):
        batch, length, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=-1)
        # (batch, heads, length, head width)
        q, k, v = (t.view(batch, length, self.n_heads, -1).transpose(1, 2) for t in (q, k, v))
        # softmax(q k^T / sqrt(head width), each row masked above the diagonal) @ v, in one fused kernel:
        # the same numbers as writing it out (to about 1e-15 in float64), and about a third faster here
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(attended.transpose(1, 2).reshape(batch, length, width))


class Block(nn.Module):
    """Pre-norm transformer block: x + attention(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, d_model: int, n_heads: int, d_ff: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(d_model)
        self.attention = CausalSelfAttention(d_model, n_heads)
        self.norm2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, d_ff), nn.ReLU(), nn.Linear(d_ff, d_model))

    def forward(self, x):
        x = x + self.attention(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyCausalLM(nn.Module):
    """input ids (batch, length) -> next-character logits (batch, length, vocab).

    Right padding is harmless: with the causal mask, a real position never attends to the
    padding after it, so a row's logits do not depend on how much padding its batch has.
    """

    def __init__(self, vocab_size: int, max_length: int, d_model: int = 32, n_layers: int = 1, n_heads: int = 2):
        super().__init__()
        self.max_length = max_length
        self.token = nn.Embedding(vocab_size, d_model)
        self.position = nn.Embedding(max_length, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads, 2 * d_model) for _ in range(n_layers))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size)
        for module in self.modules():  # small weights, as language models usually start
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.1)
            if isinstance(module, nn.Linear):
                nn.init.zeros_(module.bias)

    def forward(self, input_ids):
        length = input_ids.shape[1]
        if length > self.max_length:
            raise ValueError(f"input_ids has length {length}; this model handles at most {self.max_length}")
        x = self.token(input_ids) + self.position(torch.arange(length, device=input_ids.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


# ----------------------------------------------------------------------------------------------
# The problem: padding collate, shifted loss, targets counted after the shift.
# ----------------------------------------------------------------------------------------------


def shift_for_next_token(logits, labels):
    """Pair the prediction at position t with the character at t + 1: drop the last logit, the first label."""
    return logits[:, :-1], labels[:, 1:]


def targets_after_shift(batch) -> int:
    """What a causal LM's loss averages over: the labels after the shift (``labels[:, 1:]``) that are not -100."""
    return int(batch["labels"][:, 1:].ne(IGNORE_INDEX).sum())


def count_targets_before_shift(batch) -> int:
    """The mistake: count every non-padding label, forgetting that the shift removes one per row."""
    return int(batch["labels"].ne(IGNORE_INDEX).sum())


@dataclass(frozen=True)
class LMProblem(Problem):
    """Next-character prediction on rows of characters; loss = summed cross-entropy over targets."""

    vocab_size: int = 0
    max_length: int = 0
    d_model: int = 32
    n_layers: int = 1
    n_heads: int = 2
    dtype: str = "float64"
    texts: tuple = field(default=(), repr=False)

    def collate(self, examples):
        if len(examples) == 0:
            raise ValueError("examples must hold at least one row to collate, got 0")
        rows = [e["input_ids"] for e in examples]
        input_ids = nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=0)
        labels = nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=IGNORE_INDEX)
        return {"input_ids": input_ids, "labels": labels}

    def make_model(self) -> nn.Module:
        build = lambda: TinyCausalLM(self.vocab_size, self.max_length, self.d_model, self.n_layers, self.n_heads)
        return _seeded_init(self.model_seed, build).to(DTYPES[self.dtype])

    def loss_sum_and_count(self, model, batch):
        logits, targets = shift_for_next_token(model(batch["input_ids"]), batch["labels"])
        loss_sum = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                               reduction="sum", ignore_index=IGNORE_INDEX)
        return loss_sum, int(targets.ne(IGNORE_INDEX).sum())

    def count_targets(self, batch) -> int:
        """Targets after the causal shift: each row of L characters contributes L - 1."""
        return targets_after_shift(batch)

    @property
    def lengths(self) -> list[int]:
        return [len(e["input_ids"]) for e in self.examples]

    @property
    def num_targets(self) -> int:
        return sum(n - 1 for n in self.lengths)


def tiny_lm(
    num_samples: int = 64,
    *,
    packed: bool = False,
    block_size: int | None = None,
    model_seed: int = 0,
    dtype: str = "float64",
    d_model: int = 32,
    n_layers: int = 1,
    n_heads: int = 2,
) -> LMProblem:
    """The capstone problem: the first ``num_samples`` lines of the shipped text, one line per row.

    ``packed=True`` takes the same lines, concatenates them and cuts them into
    ``num_samples`` equal blocks (``block_size`` defaults to the mean line length, rounded
    down, so both versions have the same number of rows and almost the same characters).
    ``dtype`` is the model's dtype ('float64' makes rounding ~1e-16, far below every effect
    the lesson measures; 'float32' puts it near 1e-7).
    """
    lines = corpus_lines()
    check_int("num_samples", num_samples, minimum=1, maximum=len(lines))
    if not isinstance(packed, bool):
        raise TypeError(f"packed must be a bool, got {type(packed).__name__}")
    check_int("model_seed", model_seed, minimum=0)
    check_choice("dtype", dtype, tuple(DTYPES))
    check_int("d_model", d_model, minimum=2, maximum=1024)
    check_int("n_layers", n_layers, minimum=1, maximum=12)
    check_int("n_heads", n_heads, minimum=1, maximum=d_model)
    if d_model % n_heads:
        raise ValueError(f"d_model must be a multiple of n_heads={n_heads}, got {d_model}")
    texts = lines[:num_samples]
    if packed:
        most = sum(map(len, texts)) // num_samples
        if block_size is None:
            block_size = most
        check_int("block_size", block_size, minimum=2, maximum=most)
        texts = pack(texts, block_size)[:num_samples]
    elif block_size is not None:
        raise ValueError(f"block_size only applies when packed=True; got block_size={block_size} with packed=False")
    vocab = vocabulary()
    examples = tuple({"input_ids": torch.tensor(vocab.encode(t, name="sample"), dtype=torch.long)} for t in texts)
    spec = {"kind": "tiny_lm", "num_samples": num_samples, "packed": packed, "block_size": block_size,
            "model_seed": model_seed, "dtype": dtype, "d_model": d_model, "n_layers": n_layers, "n_heads": n_heads}
    return LMProblem(name=f"tiny LM ({'packed' if packed else 'one line per row'})", examples=examples, spec=spec,
                     model_seed=model_seed, vocab_size=vocab.size, max_length=max(len(t) for t in lines),
                     d_model=d_model, n_layers=n_layers, n_heads=n_heads, dtype=dtype, texts=tuple(texts))


register_problem("tiny_lm", tiny_lm)


# ----------------------------------------------------------------------------------------------
# Error against the full batch as GA grows, at a fixed effective batch; its plot.
# ----------------------------------------------------------------------------------------------


def error_vs_ga(problem: Problem, ga_values=(1, 2, 4, 8, 16), *, effective_batch: int = 16, lr: float = 0.5,
                num_processes: int = 1, epochs: int = 1,
                strategies=("mean_of_means", "token_normalised")) -> dict:
    """Largest weight distance from the full-batch run, per strategy, for each GA.

    The effective batch (rows per update, all processes together) stays ``effective_batch``:
    GA = g uses micro-batches of ``effective_batch // (g * num_processes)`` rows, so every
    run makes the same updates on the same rows and only the accumulation differs.
    """
    from .simulate import simulate

    if not isinstance(problem, Problem):
        raise TypeError(f"problem must be a gaccum_lib Problem (e.g. tiny_lm()), got {type(problem).__name__}")
    check_int("effective_batch", effective_batch, minimum=1, maximum=len(problem))
    check_int("num_processes", num_processes, minimum=1, maximum=1024)
    ga_values = [check_int(f"ga_values[{i}]", g, minimum=1, maximum=4096) for i, g in enumerate(ga_values)]
    if not ga_values:
        raise ValueError("ga_values must hold at least one GA, got an empty list")
    for g in ga_values:
        if effective_batch % (g * num_processes):
            raise ValueError(f"ga_values: GA={g} times num_processes={num_processes} must divide "
                             f"effective_batch={effective_batch}")
    errors = {s: [] for s in strategies}
    full = None
    for g in ga_values:
        kwargs = dict(grad_accum_steps=g, micro_batch_size=effective_batch // (g * num_processes),
                      num_processes=num_processes, lr=lr, epochs=epochs)
        # On one process the full batch is one forward over the same rows whatever GA: bit for bit the
        # same run, made once. On several, each GA averages the ranks' shares differently (1e-16 apart).
        if full is None or num_processes > 1:
            full = simulate(problem, "full_batch", **kwargs)
        for s in strategies:
            errors[s].append(float(simulate(problem, s, **kwargs).distance_from(full).max()))
    return {"ga": ga_values, "effective_batch": effective_batch, "num_processes": num_processes,
            **{s: np.asarray(e) for s, e in errors.items()}}


__all__ = [
    "CharVocab", "LMProblem", "TinyCausalLM", "corpus_lines", "corpus_text", "count_targets_before_shift",
    "error_vs_ga", "pack", "shift_for_next_token", "targets_after_shift", "tiny_lm",
    "vocabulary",
]

"""Lesson 08's plumbing: tiny Hugging Face transformers models, variable-length rows, a collator.

The lesson's loops, ``TrainingArguments`` and ``Trainer`` are written out in the notebook; this
module only builds what they train on, so nothing here is what a learner came to copy.

* :func:`tiny_causal_lm` builds a GPT-2 or a Llama **from a config** (a few tens of thousands of
  weights, float32, seeded): nothing is downloaded, at run time or ever. The vocabulary is the
  shipped story's characters (:func:`gaccum_lib.lm.vocabulary`), id 0 is padding.
* :func:`variable_length_rows` cuts the story's lines to lengths drawn between ``min_length``
  and ``max_length`` (seeded); :func:`fixed_length_rows` cuts the text into rows of one length.
* :func:`collate` pads a list of rows into ``input_ids`` / ``attention_mask`` / ``labels``
  (-100 on padding), the batch a causal LM's ``forward`` takes.
* :func:`targets_after_shift` (lesson 05's, from :mod:`gaccum_lib.lm`) counts what a causal LM's
  loss averages over: one target fewer than labels per row, because position t predicts t + 1.

transformers is imported on first use (a few seconds); :func:`quiet_transformers` silences its
advice-level logging and its progress bars so the lesson's output stays readable.
"""

from __future__ import annotations

import logging
import warnings

import torch
from torch import nn

from ._checks import check_choice, check_int
from .data import IGNORE_INDEX
from .lm import corpus_lines, corpus_text, targets_after_shift, vocabulary

MODEL_KINDS = ("gpt2", "llama")


def quiet_transformers() -> None:
    """Keep transformers to errors: its notices (e.g. GPT-2 having no ``loss_type``) and its progress bars
    (``save_pretrained`` / ``from_pretrained`` draw one per call) would bury the lesson."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    logging.getLogger("accelerate").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=".*OMP_NUM_THREADS.*")


def tiny_causal_lm(kind: str = "llama", *, seed: int = 0, hidden_size: int = 32, num_layers: int = 2,
                   num_heads: int = 2):
    """A freshly initialised ``GPT2LMHeadModel`` or ``LlamaForCausalLM``; the same weights for the same seed.

    Dropout is 0 (Llama has none; GPT-2's is switched off) so two runs that should agree can be
    compared to rounding, as in lesson 05.
    """
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    check_choice("kind", kind, MODEL_KINDS)
    check_int("seed", seed, minimum=0)
    check_int("hidden_size", hidden_size, minimum=2, maximum=1024)
    check_int("num_layers", num_layers, minimum=1, maximum=12)
    check_int("num_heads", num_heads, minimum=1, maximum=hidden_size)
    if hidden_size % num_heads:
        raise ValueError(f"hidden_size must be a multiple of num_heads={num_heads}, got {hidden_size}")
    vocab, positions = vocabulary(), 128
    if kind == "gpt2":
        config = GPT2Config(vocab_size=vocab.size, n_positions=positions, n_embd=hidden_size, n_layer=num_layers,
                            n_head=num_heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, pad_token_id=0)
        build = GPT2LMHeadModel
    else:
        config = LlamaConfig(vocab_size=vocab.size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                             num_hidden_layers=num_layers, num_attention_heads=num_heads,
                             num_key_value_heads=num_heads, max_position_embeddings=positions, pad_token_id=0)
        build = LlamaForCausalLM
    torch.manual_seed(seed)  # the weights are drawn in __init__: the seed fixes them
    return build(config)


def variable_length_rows(num_rows: int = 64, *, min_length: int = 2, max_length: int = 40, seed: int = 0) -> list:
    """The story's first ``num_rows`` lines, each cut to a length drawn uniformly in [min_length, max_length].

    Each row is ``{"input_ids": [ids...]}`` (a line shorter than its draw stays whole).
    """
    lines = corpus_lines()
    check_int("num_rows", num_rows, minimum=1, maximum=len(lines))
    check_int("min_length", min_length, minimum=2, maximum=100)
    check_int("max_length", max_length, minimum=min_length, maximum=100)
    check_int("seed", seed, minimum=0)
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_length, max_length + 1, (num_rows,), generator=generator).tolist()
    vocab = vocabulary()
    cut = zip(lines[:num_rows], lengths, strict=True)
    return [{"input_ids": vocab.encode(line[:n], name="line")} for line, n in cut]


def fixed_length_rows(num_rows: int, length: int) -> list:
    """``num_rows`` consecutive pieces of the story of exactly ``length`` characters (a packed dataset)."""
    check_int("length", length, minimum=2, maximum=128)
    text = corpus_text().replace("\r", "")
    check_int("num_rows", num_rows, minimum=1, maximum=len(text) // length)
    vocab = vocabulary()
    return [{"input_ids": vocab.encode(text[i * length:(i + 1) * length], name="text")} for i in range(num_rows)]


def collate(rows) -> dict:
    """Pad rows on the right: ``input_ids`` with 0, ``attention_mask`` 1 on real tokens, ``labels`` -100 on padding."""
    if len(rows) == 0:
        raise ValueError("rows must hold at least one row to collate, got 0")
    ids = [torch.as_tensor(row["input_ids"], dtype=torch.long) for row in rows]
    pad = nn.utils.rnn.pad_sequence
    return {"input_ids": pad(ids, batch_first=True, padding_value=0),
            "attention_mask": pad([torch.ones_like(i) for i in ids], batch_first=True, padding_value=0),
            "labels": pad(ids, batch_first=True, padding_value=IGNORE_INDEX)}


def flat_weights(model) -> torch.Tensor:
    """Every weight of ``model`` in one float64 vector (a copy), to compare two runs."""
    return torch.cat([p.detach().reshape(-1).double() for p in model.parameters()])


def relative_distance(weights, reference, start) -> float:
    """How far ``weights`` ended from ``reference``, as a fraction of how far ``reference`` moved from ``start``."""
    moved = float((reference - start).norm())
    if moved == 0.0:
        raise ValueError("reference equals start: the reference run did not move, there is nothing to compare to")
    return float((weights - reference).norm()) / moved


__all__ = [
    "MODEL_KINDS", "collate", "fixed_length_rows", "flat_weights", "quiet_transformers", "relative_distance",
    "targets_after_shift", "tiny_causal_lm", "variable_length_rows",
]

"""Lesson 08's claims about transformers, the Trainer, AdamW and bf16, measured again (issue 13).

Each test re-measures a figure the lesson prints and asserts, with its own small loop, so the
lesson and these tests cannot drift into agreeing with each other by sharing a bug.
"""

import itertools
import tempfile

import pytest
import torch
from torch.utils.data import DataLoader

from gaccum_check import check_accumulation
from gaccum_launch import launch, reset_accelerate_state
from gaccum_lib.real_stack import (
    collate,
    fixed_length_rows,
    flat_weights,
    quiet_transformers,
    relative_distance,
    targets_after_shift,
    tiny_causal_lm,
    variable_length_rows,
)

transformers = pytest.importorskip("transformers")
quiet_transformers()
ROWS = variable_length_rows(32)


def train(kind, how, *, ga=8, micro=2, updates=2, make_optimizer=None, clip=None, model=None):
    """SGD (lr 0.5) or the given optimizer over consecutive windows of ROWS; returns the model."""
    model = model or tiny_causal_lm(kind)
    optimizer = (make_optimizer or (lambda p: torch.optim.SGD(p, lr=0.5)))(model.parameters())
    batches = iter(DataLoader(ROWS, batch_size=micro, collate_fn=collate))
    for _ in range(updates):
        window = list(itertools.islice(batches, ga))
        n = sum(targets_after_shift(b) for b in window)
        for batch in window:
            if how == "num_items_in_batch":
                model(**batch, num_items_in_batch=n).loss.backward()
            elif how == "naive":
                (model(**batch).loss / ga).backward()
            else:  # "no / GA"
                model(**batch).loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad()
    return model


def trainer_for(model, *, batch_size=2, ga=8, updates=2, use_cpu=True):
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=tempfile.mkdtemp(prefix="gaccum-test-"), per_device_train_batch_size=batch_size,
                             gradient_accumulation_steps=ga, max_steps=updates, learning_rate=0.5, optim="sgd",
                             lr_scheduler_type="constant", max_grad_norm=0.0, train_sampling_strategy="sequential",
                             use_cpu=use_cpu, ddp_find_unused_parameters=False, report_to="none",
                             save_strategy="no", disable_tqdm=True)
    return Trainer(model=model, args=args, train_dataset=ROWS, data_collator=collate)


@pytest.fixture(autouse=True)
def _no_accelerator_left_behind():
    yield
    reset_accelerate_state(quiet=True)  # the Trainer makes an Accelerator; later launches need none


# ----------------------------------------------------------------------------------------------
# The library: models from configs, rows, collation, counting.
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind, cls", [("gpt2", "GPT2LMHeadModel"), ("llama", "LlamaForCausalLM")])
def test_tiny_models_are_the_real_classes_seeded_and_without_dropout(kind, cls):
    a, b = tiny_causal_lm(kind), tiny_causal_lm(kind)
    assert type(a).__name__ == cls
    assert torch.equal(flat_weights(a), flat_weights(b))
    assert not torch.equal(flat_weights(a), flat_weights(tiny_causal_lm(kind, seed=1)))
    batch = collate(ROWS[:4])
    a.train()
    assert torch.equal(a(**batch).logits, a(**batch).logits)  # train mode, yet deterministic: no dropout


def test_rows_collate_and_count():
    lengths = [len(r["input_ids"]) for r in ROWS]
    assert min(lengths) >= 2 and max(lengths) <= 40 and len(set(lengths)) > 10
    assert variable_length_rows(32) == ROWS  # seeded
    batch = collate(ROWS[:3])
    assert batch["input_ids"].shape == batch["labels"].shape == batch["attention_mask"].shape
    assert int(batch["attention_mask"].sum()) == int(batch["labels"].ne(-100).sum()) == sum(lengths[:3])
    assert targets_after_shift(batch) == sum(lengths[:3]) - 3
    assert all(len(r["input_ids"]) == 16 for r in fixed_length_rows(5, 16))


def test_quiet_transformers_turns_off_notices_and_progress_bars():
    from transformers.utils import logging as hf_logging

    quiet_transformers()
    assert hf_logging.get_verbosity() == hf_logging.ERROR
    assert not hf_logging.is_progress_bar_enabled()  # save_pretrained / from_pretrained draw none


@pytest.mark.parametrize("call, message", [
    (lambda: tiny_causal_lm("bert"), "kind must be one of"),
    (lambda: tiny_causal_lm(hidden_size=30, num_heads=4), "hidden_size must be a multiple of num_heads=4"),
    (lambda: variable_length_rows(0), "num_rows"),
    (lambda: variable_length_rows(4, min_length=10, max_length=5), "max_length"),
    (lambda: fixed_length_rows(4, 1), "length"),
    (lambda: collate([]), "rows must hold at least one row"),
    (lambda: relative_distance(torch.ones(2), torch.ones(2), torch.ones(2)), "reference equals start"),
])
def test_bad_input_is_named(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# ----------------------------------------------------------------------------------------------
# The naive loop against num_items_in_batch.
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_num_items_in_batch_equals_the_full_batch_and_naive_does_not(kind):
    start = flat_weights(tiny_causal_lm(kind))
    full = flat_weights(train(kind, "num_items_in_batch", ga=1, micro=16))
    assert relative_distance(flat_weights(train(kind, "num_items_in_batch")), full, start) < 1e-5
    assert relative_distance(flat_weights(train(kind, "naive")), full, start) > 0.05


# ----------------------------------------------------------------------------------------------
# The Trainer: its GA against its full batch, and what it counts.
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind, counted_before_shift", [("gpt2", True), ("llama", False)])
def test_trainer_counts_and_equals_its_own_full_batch(kind, counted_before_shift):
    start = flat_weights(tiny_causal_lm(kind))
    accumulated, full = trainer_for(tiny_causal_lm(kind)), trainer_for(tiny_causal_lm(kind), batch_size=16, ga=1)
    accumulated.train()
    full.train()
    assert relative_distance(flat_weights(accumulated.model), flat_weights(full.model), start) < 1e-5
    window = [collate(ROWS[i:i + 2]) for i in range(0, 16, 2)]
    _, count = accumulated.get_batch_samples(iter(window), len(window), "cpu")
    labels = sum(int(b["labels"].ne(-100).sum()) for b in window)
    targets = sum(targets_after_shift(b) for b in window)
    assert (labels, targets) == (294, 278)
    assert int(count) == (labels if counted_before_shift else targets)
    per_token = flat_weights(train(kind, "num_items_in_batch", ga=1, micro=16))
    off = relative_distance(flat_weights(accumulated.model), per_token, start)
    assert (off > 0.01) if counted_before_shift else (off < 1e-5)


def test_gpt2_update_is_targets_over_labels_and_loss_type_fixes_it():
    start = flat_weights(tiny_causal_lm("gpt2"))
    default = trainer_for(tiny_causal_lm("gpt2"), updates=1)
    fixed_model = tiny_causal_lm("gpt2")
    fixed_model.loss_type = "ForCausalLM"
    fixed = trainer_for(fixed_model, updates=1)
    default.train()
    fixed.train()
    update, true_update = flat_weights(default.model) - start, flat_weights(fixed.model) - start
    assert float(update @ true_update / (true_update @ true_update)) == pytest.approx(278 / 294, abs=1e-5)
    per_token = flat_weights(train("gpt2", "num_items_in_batch", ga=1, micro=16, updates=1))
    assert relative_distance(flat_weights(fixed.model), per_token, start) < 1e-5


@pytest.mark.parametrize("length", [4, 16, 128])
def test_gpt2_count_error_is_one_over_the_row_length(length):
    trainer = trainer_for(tiny_causal_lm("gpt2"))
    window = [collate(fixed_length_rows(16, length)[i:i + 2]) for i in range(0, 16, 2)]
    _, count = trainer.get_batch_samples(iter(window), len(window), "cpu")
    assert sum(targets_after_shift(b) for b in window) / int(count) == pytest.approx(1 - 1 / length, abs=1e-12)


def _trainer_on_ranks(batch_size, ga):
    from accelerate import PartialState

    trainer = trainer_for(tiny_causal_lm("llama"), batch_size=batch_size, ga=ga,
                          use_cpu=torch.cuda.device_count() < PartialState().num_processes)
    trainer.train()
    return flat_weights(trainer.accelerator.unwrap_model(trainer.model)), trainer.accelerator.num_processes


def test_trainer_ga_on_two_real_processes_equals_its_one_process_full_batch():
    start = flat_weights(tiny_causal_lm("llama"))
    one_process = trainer_for(tiny_causal_lm("llama"), batch_size=16, ga=1)
    one_process.train()
    reference = flat_weights(one_process.model)
    reset_accelerate_state(quiet=True)
    for batch_size, ga in ((2, 4), (8, 1)):
        ranks = launch(_trainer_on_ranks, (batch_size, ga), num_processes=2, quiet=True)
        for weights, processes in ranks:
            assert processes == 2
            assert relative_distance(weights, reference, start) < 1e-5


# ----------------------------------------------------------------------------------------------
# AdamW hides a constant gradient scale (except through eps and clipping), not a mean of means.
# ----------------------------------------------------------------------------------------------


def test_adamw_hides_a_forgotten_ga_but_not_a_mean_of_means():
    def adam(eps=1e-8):
        return lambda p: torch.optim.AdamW(p, lr=0.01, eps=eps)

    def run(how, **options):
        return flat_weights(train("llama", how, updates=4, **options))

    start = flat_weights(tiny_causal_lm("llama"))
    full = run("num_items_in_batch", ga=1, micro=16, make_optimizer=adam())
    naive = run("naive", make_optimizer=adam())
    assert relative_distance(run("num_items_in_batch", make_optimizer=adam()), full, start) < 1e-5
    assert relative_distance(naive, full, start) > 0.1
    hidden = relative_distance(run("no / GA", make_optimizer=adam()), naive, start)
    assert hidden < 0.01
    for options in ({"make_optimizer": adam(1e-4)}, {"make_optimizer": adam(), "clip": 4.0}):
        assert relative_distance(run("no / GA", **options), run("naive", **options), start) > 10 * hidden
    # Under SGD the same forgotten / GA is GA times the step: nothing hides it.
    sgd_naive, sgd_no_ga = flat_weights(train("llama", "naive", updates=1)), flat_weights(
        train("llama", "no / GA", updates=1))
    assert float((sgd_no_ga - start).norm() / (sgd_naive - start).norm()) == pytest.approx(8, rel=1e-4)


# ----------------------------------------------------------------------------------------------
# bf16: gradients added up in bf16 lose precision as GA grows; mixed precision keeps float32.
# ----------------------------------------------------------------------------------------------


def _gradient(model):
    return torch.cat([p.grad.reshape(-1).double() for p in model.parameters()])


def test_bf16_gradient_buffer_error_grows_with_ga_and_mixed_precision_keeps_float32():
    reference_model = tiny_causal_lm("llama").double()
    everything = collate(ROWS)
    reference_model(**everything, num_items_in_batch=targets_after_shift(everything)).loss.backward()
    reference = _gradient(reference_model)

    def error(ga, buffer_dtype):
        """The same bf16-autocast micro-batch gradients, added up in a buffer of ``buffer_dtype``."""
        model = tiny_causal_lm("llama")
        buffer = [torch.zeros_like(p, dtype=buffer_dtype) for p in model.parameters()]
        batches = list(DataLoader(ROWS, batch_size=len(ROWS) // ga, collate_fn=collate))
        n = sum(targets_after_shift(b) for b in batches)
        for batch in batches:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                model(**batch, num_items_in_batch=n).loss.backward()
            for total, p in zip(buffer, model.parameters(), strict=True):
                total += p.grad.to(buffer_dtype)
                p.grad = None
        gradient = torch.cat([g.reshape(-1).double() for g in buffer])
        return float((gradient - reference).norm() / reference.norm())

    float32 = [error(ga, torch.float32) for ga in (1, 32)]
    bf16 = [error(ga, torch.bfloat16) for ga in (1, 32)]
    assert 1e-3 < float32[0] < 1e-2 and float32[1] < 1.2 * float32[0]  # the bf16 forward's error, flat in GA
    assert bf16[1] > 1.5 * bf16[0] and bf16[1] > 1.5 * float32[1]  # added up in bf16: grows with GA

    bf16_model = tiny_causal_lm("llama").to(torch.bfloat16)  # e.g. from_pretrained(..., dtype=torch.bfloat16)
    bf16_model(**collate(ROWS[:4])).loss.backward()
    assert all(p.grad.dtype == torch.bfloat16 for p in bf16_model.parameters())  # its .grad is a bf16 buffer

    from accelerate import Accelerator

    reset_accelerate_state(quiet=True)
    model = Accelerator(cpu=True, mixed_precision="bf16").prepare(tiny_causal_lm("llama"))
    model(**collate(ROWS[:4])).loss.backward()
    assert all(p.dtype == p.grad.dtype == torch.float32 for p in model.parameters())


def test_mixed_precision_casts_no_weight_and_a_bf16_checkpoint_loads_in_bf16(tmp_path):
    from accelerate import Accelerator
    from transformers import LlamaForCausalLM

    reset_accelerate_state(quiet=True)
    accelerator = Accelerator(cpu=True, mixed_precision="bf16")
    model = tiny_causal_lm("llama")
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=0.01))
    seen = set()
    model.model.layers[0].self_attn.q_proj.register_forward_hook(lambda m, a, out: seen.add(out.dtype))
    model(**collate(ROWS[:4])).loss.backward()
    optimizer.step()
    assert seen == {torch.bfloat16}  # autocast: the products in bf16
    assert {t.dtype for s in optimizer.state.values() for t in s.values()} == {torch.float32}
    tiny_causal_lm("llama").to(torch.bfloat16).save_pretrained(tmp_path)
    assert accelerator.prepare(LlamaForCausalLM.from_pretrained(tmp_path)).dtype == torch.bfloat16
    assert LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).dtype == torch.float32


# ----------------------------------------------------------------------------------------------
# check_accumulation on a transformers model and on the Trainer's training_step.
# ----------------------------------------------------------------------------------------------

WINDOW = [collate(ROWS[i:i + 2]) for i in range(0, 16, 2)]


def summed_loss(model, batch):
    return model(**batch, num_items_in_batch=1).loss, targets_after_shift(batch)


def trainer_step(model, optimizer, micro_batches, loss_fn, ctx):
    trainer = trainer_for(model, ga=len(micro_batches))
    _, num_items = trainer.get_batch_samples(iter(micro_batches), len(micro_batches), "cpu")
    for batch in micro_batches:
        trainer.training_step(model, batch, num_items)
    optimizer.step()
    optimizer.zero_grad()


@pytest.mark.parametrize("kind, labels", [("llama", ()), ("gpt2", ("targets counted before the shift",))])
def test_check_accumulation_judges_the_trainers_step(kind, labels):
    report = check_accumulation(trainer_step, lambda: tiny_causal_lm(kind), WINDOW, summed_loss, num_processes=1)
    assert bool(report) == (not labels)
    assert report.labels == labels


def test_check_accumulation_names_the_naive_loop_on_a_transformers_model():
    def naive_step(model, optimizer, micro_batches, loss_fn, ctx):
        for batch in micro_batches:
            ctx.backward(model(**batch).loss)
        optimizer.step()
        optimizer.zero_grad()

    report = check_accumulation(naive_step, lambda: tiny_causal_lm("gpt2"), WINDOW, summed_loss)
    assert report.labels == ("mean of micro-batch means",)


def test_the_documented_transformers_example_runs(capsys):
    import re
    from pathlib import Path

    page = (Path(__file__).resolve().parents[1] / "docs" / "check_accumulation.md").read_text()
    section = page.split("## A transformers model, and the Trainer's own step", 1)[1]
    example, printed = re.findall(r"```(?:python|text)\n(.*?)```", section, re.S)[:2]
    exec(compile(example, "check_accumulation.md", "exec"), {"__name__": "docs_example"})
    assert capsys.readouterr().out == printed

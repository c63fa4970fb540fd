"""examples/train_causal_lm.py as a learner runs it: copied alone into an empty folder, under the launchers.

Each real run starts the script's own check: rank 0 reruns the same file as one plain process at
GA 1 with one micro-batch per update (its full batch) and compares the weights after every update.
The default data (50 rows, micro-batches of 2, GA 4) does not divide evenly: on 2 processes each
rank has 13 micro-batches, so every epoch ends on a short window of 1.
"""

import ast
import importlib.util
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from accelerate.utils import DistributedType
from accelerate.utils.other import get_free_port

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train_causal_lm.py"
BIN = Path(sys.executable).parent
ALLOWED_IMPORTS = {"torch", "accelerate", "transformers"} | set(sys.stdlib_module_names)


def _load_script():
    spec = importlib.util.spec_from_file_location("take_home_train_causal_lm", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(tmp_path, launcher, *args, cpu_env=True, expect=0, mkdir=True):
    """Copy the script into an empty folder and run it there, with nothing of this repository on the path."""
    folder = tmp_path / "learner"
    if mkdir:
        folder.mkdir()
    shutil.copy(SCRIPT, folder)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "ACCELERATE_USE_CPU")}
    env["OMP_NUM_THREADS"] = "1"
    if cpu_env:
        env["ACCELERATE_USE_CPU"] = "1"
    command = [*launcher, "train_causal_lm.py", "--report", "report.json", *args]
    result = subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == expect, f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    report = folder / "report.json"
    return (json.loads(report.read_text()) if report.exists() else None), result


def _torchrun(n):
    return [str(BIN / "torchrun"), "--nproc_per_node", str(n), "--master_port", str(get_free_port())]


def _accelerate_launch(n):
    return [str(BIN / "accelerate"), "launch", "--multi_gpu", "--num_processes", str(n), "--main_process_port",
            str(get_free_port())]


def test_the_script_imports_nothing_from_this_repository_and_has_no_cpu_default():
    tree = ast.parse(SCRIPT.read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, "a relative import"
            imported.add(node.module.split(".")[0])
    assert imported <= ALLOWED_IMPORTS, imported - ALLOWED_IMPORTS
    module = _load_script()
    assert inspect.signature(module.train_causal_lm).parameters["cpu"].default is False
    assert module.parse_args([]).cpu is False  # the device is Accelerate's choice unless --cpu is given


@pytest.mark.real
@pytest.mark.slow
def test_torchrun_two_cpu_processes_equal_the_full_batch_with_a_short_last_window(tmp_path):
    report, result = _run(tmp_path, _torchrun(2))
    assert report["num_processes"] == 2 and report["distributed_type"] == "MULTI_CPU"
    check = report["check"]
    assert check["equal"] and check["largest_weight_difference"] < 1e-6 and check["updates"] == 8
    assert check["largest_loss_difference"] < 1e-5
    assert "equals its float32 full batch" in result.stdout
    # the line the README prints; float32 rounding differs between CPUs (8.4e-08 on one, 1.2e-07 on
    # an AVX-512 EPYC), so the figure is checked for its size, not its last digits
    largest, = re.findall(r"at most ([0-9.e+-]+) \(mean [0-9.e+-]+, tolerance 1e-06\)", result.stdout)
    assert 1e-8 < float(largest) < 5e-7
    # 50 rows: 3 full updates of 16 rows and one of 2 per epoch (the short last window), every row once
    assert len(report["update_targets"]) == 8 and report["update_targets"][3] < min(report["update_targets"][:3]) / 4
    assert report["update_targets"][:4] == report["update_targets"][4:]
    assert max(n for n in report["grad_norms"]) > 1.0  # clipping at norm 1 acts
    assert report["lrs"][0] == 1.0 and report["lrs"] == sorted(report["lrs"], reverse=True)  # the schedule decays


@pytest.mark.real
@pytest.mark.slow
def test_accelerate_launch_with_rows_that_do_not_divide_by_the_processes(tmp_path):
    # 37 rows: the last micro-batch of 2 is half empty and one rank has one micro-batch fewer, padded
    report, _ = _run(tmp_path, _accelerate_launch(2), "--num_rows", "37", "--epochs", "1")
    assert report["num_processes"] == 2
    assert report["check"]["equal"] and report["check"]["largest_weight_difference"] < 1e-6


@pytest.mark.real
@pytest.mark.slow
def test_one_plain_process_with_accumulation_equals_its_full_batch(tmp_path):
    report, _ = _run(tmp_path, [sys.executable], "--epochs", "1", cpu_env=False)
    assert report["num_processes"] == 1 and report["distributed_type"] == "NO"
    assert report["check"]["equal"] and report["check"]["largest_weight_difference"] < 1e-6


@pytest.mark.real
@pytest.mark.slow
def test_even_batches_repeats_rows_and_the_check_says_so(tmp_path):
    report, result = _run(tmp_path, _torchrun(2), "--uneven", "repeat", expect=1)
    assert "does NOT equal its float32 full batch" in result.stdout
    assert report["check"]["largest_weight_difference"] > 1e-3
    # the last update of each epoch holds rows 48 and 49, and rows 0 and 1 a second time: their targets count twice
    rows = _load_script().demo_rows(50, vocab_size=64)
    targets = lambda indexes: sum(len(rows[i]) - 1 for i in indexes)
    assert report["update_targets"][3] == report["update_targets"][7] == targets([48, 49]) + targets([0, 1])


@pytest.mark.real
@pytest.mark.slow
def test_adamw_magnifies_float32_rounding_beyond_the_sgd_check(tmp_path):
    # What the README and --optimizer's help say: AdamW's per-weight step size turns rounding in near-zero
    # gradients into 3e-6 differences, where SGD stays near 1e-7; the mean difference stays tiny.
    report, result = _run(tmp_path, _torchrun(2), "--optimizer", "adamw", expect=1)  # its default lr, 0.01
    check = report["check"]
    assert "magnifies float32 rounding" in result.stdout and "--tolerance 1e-5" in result.stdout
    assert 1e-6 < check["largest_weight_difference"] < 1e-5 and check["mean_weight_difference"] < 1e-8


@pytest.mark.real
@pytest.mark.slow
def test_bf16_autocast_runs_and_stays_within_its_stated_distance_of_float32(tmp_path):
    module = _load_script()
    report, result = _run(tmp_path, _torchrun(2), "--mixed_precision", "bf16")
    check = report["check"]
    assert check["tolerance"] == module.TOLERANCES["bf16"] == 5e-3
    assert check["equal"] and 1e-6 < check["largest_weight_difference"] < 5e-3  # really bf16, and close
    assert "in bf16 equals its float32 full batch" in result.stdout


@pytest.mark.real
@pytest.mark.slow
def test_two_processes_without_cpu_mode_on_a_machine_without_gpus_stop_with_the_fix(tmp_path):
    _, result = _run(tmp_path, _torchrun(2), "--no_check", cpu_env=False, expect=1)
    assert "the launcher started 2 processes but Accelerate sees 1" in result.stderr
    assert "ACCELERATE_USE_CPU=1" in result.stderr


def test_deepspeed_and_fsdp_are_refused_with_the_reason():
    module = _load_script()
    with pytest.raises(RuntimeError, match="steps the engine whenever `accelerator.sync_gradients` is True"):
        module.check_backend(SimpleNamespace(distributed_type=DistributedType.DEEPSPEED, num_processes=2))
    with pytest.raises(RuntimeError, match="FSDP is not supported by this loop.*against a DDP run"):
        module.check_backend(SimpleNamespace(distributed_type=DistributedType.FSDP, num_processes=2))
    with pytest.raises(RuntimeError, match="XLA is not supported by this loop, which is written for one device and for "
                                           "DDP. $"):
        module.check_backend(SimpleNamespace(distributed_type=DistributedType.XLA, num_processes=8))
    module.check_backend(SimpleNamespace(distributed_type=DistributedType.NO, num_processes=1))  # no error


@pytest.mark.parametrize(("settings", "message"), [
    ({"grad_accum_steps": 0}, "grad_accum_steps must be an integer of at least 1, got 0"),
    ({"micro_batch_size": 2.0}, "micro_batch_size must be an integer of at least 1, got 2.0"),
    ({"optimizer": "adam"}, "optimizer must be one of \\['adamw', 'sgd'\\], got 'adam'"),
    ({"uneven": "drop"}, "uneven must be one of \\['pad', 'repeat'\\], got 'drop'"),
    ({"rows": [[1]]}, "each of at least 2 tokens"),
])
def test_bad_settings_get_a_clear_error(settings, message):
    module = _load_script()
    arguments = {"rows": [[1, 2, 3]], "grad_accum_steps": 2, "micro_batch_size": 1, "epochs": 1, "optimizer": "sgd",
                 "uneven": "pad", **settings}
    with pytest.raises(ValueError, match=message):
        module.check_settings(arguments.pop("rows"), **arguments)


def test_target_free_rows_add_no_target_and_fill_every_process():
    module = _load_script()
    rows = [[5, 6, 7], [8, 9]]
    padded = module.pad_with_target_free_rows(rows, 4)
    assert padded[:2] == rows and padded[2:] == [None, None]
    batch = module.collate_rows(padded)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 9, 0], [0, 0, 0], [0, 0, 0]]
    assert int(batch["labels"][:, 1:].ne(-100).sum()) == 3  # 2 + 1 targets after the shift; none from padding
    assert module.pad_with_target_free_rows(rows, 2) == rows


# ----------------------------------------------------------------------------------------------
# Lesson 05 trains with these very functions: its cells hold them character for character.
# ----------------------------------------------------------------------------------------------

LESSON = ROOT / "notebooks" / "05_capstone_language_model.ipynb"
RECIPE = ("IGNORE_INDEX", "UNEVEN_CHOICES", "OPTIMIZERS", "collate_rows", "pad_with_target_free_rows",
          "summed_next_token_loss", "check_settings", "check_backend", "train_causal_lm")


def _top_level(source):
    """Each top-level function and assignment of `source`, by name, as its exact text (comments on its line too)."""
    lines, found = source.splitlines(), {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef):
            found[node.name] = "\n".join(lines[node.lineno - 1:node.end_lineno])
        elif isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            found[node.targets[0].id] = "\n".join(lines[node.lineno - 1:node.end_lineno])
    return found


def _lesson_code():
    cells = json.loads(LESSON.read_text())["cells"]
    return ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]


def test_lesson_05_holds_the_scripts_recipe_character_for_character():
    in_script = _top_level(SCRIPT.read_text())
    in_lesson = {}
    for cell in _lesson_code():
        for name, text in _top_level(cell).items():
            assert name not in in_lesson or name not in RECIPE, f"lesson 05 defines {name} twice"
            in_lesson[name] = text
    for name in RECIPE:
        assert name in in_lesson, f"lesson 05 does not show {name}"
        assert in_lesson[name] == in_script[name], f"{name} in lesson 05 differs from examples/train_causal_lm.py"


def test_lesson_05s_recipe_cells_run_alone_and_train_as_the_script_does():
    # The cells that define the recipe, run by themselves in a fresh namespace: nothing else of the lesson needed.
    namespace = {}
    for cell in _lesson_code():
        if any(f"def {name}(" in cell for name in RECIPE):
            exec(compile(cell, str(LESSON), "exec"), namespace)
    module = _load_script()
    rows = module.demo_rows(11, vocab_size=16)
    settings = dict(grad_accum_steps=3, micro_batch_size=2, lr=0.5, optimizer="sgd", epochs=2, cpu=True)
    from gaccum_lib import reset_accelerate_state

    losses = {}
    for name, train in (("lesson", namespace["train_causal_lm"]), ("script", module.train_causal_lm)):
        losses[name] = train(module.tiny_llama(16), rows, **settings)
        reset_accelerate_state(quiet=True)
    assert len(losses["lesson"]) == 4 and losses["lesson"] == losses["script"]


def _take_home_ranks(rows, make_model, settings):
    """The script's train_causal_lm in this rank, measured by the lessons' UpdateRecorder."""
    from gaccum_lib.accelerate_runs import UpdateRecorder

    recorder = UpdateRecorder()
    _load_script().train_causal_lm(make_model(), rows, optimizer="sgd", cpu=True, on_update=recorder,
                                   max_grad_norm=None, final_lr_fraction=1.0, **settings)
    return recorder.record


@pytest.mark.real
def test_the_take_home_function_lands_on_real_runs_weights_exactly():
    # Two loops written apart (the script's and gaccum_lib.accelerate_runs'), the same update: lesson 05
    # trusts real_run's naive run on two processes because its token-normalised run is this one.
    from gaccum_lib import launch, real_run, tiny_lm
    from gaccum_lib.accelerate_runs import trajectory_from_ranks

    problem = tiny_lm(24)
    settings = dict(grad_accum_steps=2, micro_batch_size=2, lr=0.5, epochs=2)
    rows = [example["input_ids"].tolist() for example in problem.examples]
    records = launch(_take_home_ranks, args=(rows, problem.make_model, settings), num_processes=2)
    take_home = trajectory_from_ranks(records, strategy="token_normalised", grad_accum_steps=2, micro_batch_size=2,
                                      lr=0.5)
    library = real_run(problem, "token_normalised", num_processes=2, **settings)
    assert take_home.weights.shape == library.weights.shape == (7, library.weights.shape[1])  # 3 updates an epoch
    assert np.array_equal(take_home.weights, library.weights)


def _save_word_level_model(folder):
    """A tiny Llama and a word-level tokenizer, saved as a Hugging Face model folder (no network)."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    words = ["<pad>", "<unk>", "the", "tide", "clock", "turns", "and", "sea", "keeps", "time", "slow", "fast"]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", unk_token="<unk>").save_pretrained(folder)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(words), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0)
    LlamaForCausalLM(config).save_pretrained(folder)


@pytest.mark.real
@pytest.mark.slow
def test_your_own_model_folder_and_text_file_with_a_line_too_short_to_predict(tmp_path):
    _save_word_level_model(tmp_path / "learner" / "my_model")
    lines = ["the tide clock turns", "and the sea keeps time", "slow", "the clock turns fast and slow",
             "the sea turns", "time keeps the tide", "fast"]
    (tmp_path / "learner" / "lines.txt").write_text("\n".join(lines) + "\n")
    report, result = _run(tmp_path, [sys.executable], "--model", "my_model", "--text", "lines.txt",
                          "--grad_accum_steps", "2", "--epochs", "1", cpu_env=False, mkdir=False)
    assert "left out 2 line(s) of fewer than 2 tokens" in result.stderr  # "slow" and "fast"
    # 5 rows, micro-batches of 2, GA 2: one update of 4 rows and one of 1; targets = words - 1 per row
    assert report["update_targets"] == [3 + 4 + 5 + 2, 3]
    assert report["check"]["equal"] and report["check"]["largest_weight_difference"] < 1e-6


@pytest.mark.real
@pytest.mark.slow
def test_a_text_file_with_the_tiny_model_reads_bytes(tmp_path):
    (tmp_path / "learner").mkdir()
    (tmp_path / "learner" / "lines.txt").write_text("a tide clock\nturns\nhé\n")
    report, _ = _run(tmp_path, [sys.executable], "--text", "lines.txt", "--micro_batch_size", "1",
                     "--grad_accum_steps", "3", "--epochs", "1", cpu_env=False, mkdir=False)
    assert report["update_targets"] == [11 + 4 + 2]  # UTF-8 bytes less one per row ("é" is 2 bytes)
    assert report["check"]["equal"]

"""examples/train_causal_lm.py as a learner runs it: copied alone into an empty folder, under the launchers.

Its full-batch check is gaccum's verifier, run as the script's docstring shows it: the script at GA 4 on 1
and on 2 processes, each against one process at GA 1 with every update's rows in one micro-batch. The
default data (50 rows, micro-batches of 2, GA 4) does not divide evenly: on 2 processes each rank has 13
micro-batches (rank 1's last one holds two rows without targets), so every epoch ends on a short window of 1.
"""

import ast
import importlib.util
import json
import os
import re
import shlex
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
UPDATE_LINE = re.compile(r"^update (\d+): loss per target (\d+\.\d+) over (\d+) targets, lr ([0-9.e+-]+)"
                         r"(?:, gradient norm (\d+\.\d+))?$", re.M)


def _load_script():
    spec = importlib.util.spec_from_file_location("take_home_train_causal_lm", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _learner_folder(tmp_path, script_text=None):
    """An empty folder holding only the script (or a variant of it), named as the learner saves it."""
    folder = tmp_path / "learner"
    folder.mkdir(parents=True)
    if script_text is None:
        shutil.copy(SCRIPT, folder)
    else:
        (folder / "train_causal_lm.py").write_text(script_text)
    return folder


def _run(tmp_path, launcher, *args, cpu_env=True, expect=0):
    """Copy the script into an empty folder and run it there, with nothing of this repository on the path."""
    folder = _learner_folder(tmp_path)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "ACCELERATE_USE_CPU")}
    env["OMP_NUM_THREADS"] = "1"
    if cpu_env:
        env["ACCELERATE_USE_CPU"] = "1"
    result = subprocess.run([*launcher, "train_causal_lm.py", *args], cwd=folder, env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == expect, f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


def _updates(stdout):
    """The printed updates: (loss, targets, lr, gradient norm or None) of each, in order."""
    found = UPDATE_LINE.findall(stdout)
    assert [int(u[0]) for u in found] == list(range(1, len(found) + 1)), stdout
    return [(float(loss), int(n), float(lr), float(norm) if norm else None) for _, loss, n, lr, norm in found]


def _targets_per_update(rows_per_update, num_rows=50):
    """Targets (after the shift) of each update of one epoch: every row once, the last update short."""
    rows = _load_script().demo_rows(num_rows, vocab_size=64)
    return [sum(len(row) - 1 for row in rows[i:i + rows_per_update]) for i in range(0, len(rows), rows_per_update)]


def _torchrun(n):
    return [str(BIN / "torchrun"), "--nproc_per_node", str(n), "--master_port", str(get_free_port())]


def _accelerate_launch(n):
    return [str(BIN / "accelerate"), "launch", "--multi_gpu", "--num_processes", str(n), "--main_process_port",
            str(get_free_port())]


def _docstring_check_command():
    """The `gaccum-check invariance -- ...` command of the script's docstring, as a learner would paste it."""
    docstring = ast.get_docstring(ast.parse(SCRIPT.read_text()))
    command, = re.findall(r"^ *(gaccum-check invariance .*?[^\\])$", docstring.replace("\\\n", " "), re.M)
    return shlex.split(command)


def _invariance(folder, command, *options):
    """The verifier (this environment's `gaccum-check`), run in the learner's folder."""
    gaccum_check, subcommand, *rest = command
    assert gaccum_check == "gaccum-check" and subcommand == "invariance"
    return subprocess.run([str(BIN / gaccum_check), subcommand, *options, *rest], cwd=folder, capture_output=True,
                          text=True, timeout=600)


def test_the_script_is_at_most_200_lines_recipe_first_and_imports_nothing_from_this_repository():
    text = SCRIPT.read_text()
    assert len(text.splitlines()) <= 200  # issue 38's bound
    tree = ast.parse(text)
    functions = [node.name for node in tree.body if isinstance(node, ast.FunctionDef)]
    assert functions[0] == "train_causal_lm"
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, "a relative import"
            imported.add(node.module.split(".")[0])
    assert imported <= ALLOWED_IMPORTS, imported - ALLOWED_IMPORTS


@pytest.mark.real
@pytest.mark.slow
def test_one_plain_process_counts_every_row_once_clips_and_decays_the_learning_rate(tmp_path):
    # No ACCELERATE_USE_CPU and no --cpu: the device is Accelerate's choice (the CPU on this machine).
    updates = _updates(_run(tmp_path, [sys.executable], cpu_env=False).stdout)
    assert [n for _, n, _, _ in updates] == _targets_per_update(8) * 2  # 2 epochs of 7 updates, the 7th of 2 rows
    lrs = [lr for _, _, lr, _ in updates]
    assert lrs[0] == 1.0 and all(a > b for a, b in zip(lrs, lrs[1:], strict=False)) and lrs[-1] > 0.1
    assert max(norm for *_, norm in updates) > 1.0  # the clip at norm 1 acts
    assert np.mean([loss for loss, *_ in updates[-7:]]) < np.mean([loss for loss, *_ in updates[:7]])  # it learns


@pytest.mark.real
@pytest.mark.slow
def test_torchrun_on_two_cpu_processes_logs_once_per_update_with_every_rows_targets(tmp_path):
    updates = _updates(_run(tmp_path, _torchrun(2)).stdout)
    # rank 0 alone prints; each update's count is gathered over both ranks: 16 rows, then the short window of 2
    assert [n for _, n, _, _ in updates] == _targets_per_update(16) * 2


@pytest.mark.real
@pytest.mark.slow
def test_accelerate_launch_on_two_cpu_processes_with_rows_that_do_not_divide(tmp_path):
    # 37 rows: the last micro-batch of 2 is half empty and rank 1 has one micro-batch fewer, padded
    updates = _updates(_run(tmp_path, _accelerate_launch(2), "--num_rows", "37", "--epochs", "1").stdout)
    assert [n for _, n, _, _ in updates] == _targets_per_update(16, num_rows=37)


@pytest.mark.real
@pytest.mark.slow
def test_the_docstrings_invariance_command_passes_on_one_and_two_processes(tmp_path):
    # 50 rows, micro-batch 2, GA 4: on 2 processes the data does not divide evenly and still equals its full batch.
    done = _invariance(_learner_folder(tmp_path), _docstring_check_command())
    assert done.returncode == 0, done.stdout + done.stderr
    assert "invariance check passed" in done.stdout
    for line in ("1 process (GA=4): passed  14 updates (full batch 14)", "2 processes (GA=4): passed  8 updates "
                 "(full batch 8)", "logged losses by 0.0e+00"):
        assert line in done.stdout, done.stdout


@pytest.mark.real
@pytest.mark.slow
def test_without_the_padding_even_batches_counts_rows_twice_and_the_check_fails(tmp_path):
    plain = ("loader = torch.utils.data.DataLoader(demo_rows(args.num_rows, vocab_size=64), "
             "batch_size=args.micro_batch_size, collate_fn=collate_rows)")
    text = SCRIPT.read_text()
    padded = "loader = padded_loader(demo_rows(args.num_rows, vocab_size=64), args.micro_batch_size, " \
             "accelerator.num_processes)"
    assert text.count(padded) == 1
    done = _invariance(_learner_folder(tmp_path, text.replace(padded, plain)), _docstring_check_command(),
                       "--processes", "2")
    assert done.returncode == 1, done.stdout + done.stderr
    # update 4 is the first epoch's short window, where rank 1 reads rows 0 and 1 a second time
    assert "2 processes (GA=4): FAILED" in done.stdout and "first differs at update 4" in done.stdout, done.stdout
    assert "updates 1-3 match" in done.stdout, done.stdout


@pytest.mark.real
@pytest.mark.slow
def test_bf16_autocast_on_two_processes_trains_as_float32_does_within_bf16_rounding(tmp_path):
    float32 = _updates(_run(tmp_path / "float32", _torchrun(2), "--epochs", "1").stdout)
    bf16 = _updates(_run(tmp_path / "bf16", _torchrun(2), "--epochs", "1", "--mixed_precision", "bf16").stdout)
    gaps = [abs(a[0] - b[0]) for a, b in zip(float32, bf16, strict=True)]
    assert 0 < max(gaps) < 1e-2  # really bf16 (the printed losses move), and close to float32


@pytest.mark.real
@pytest.mark.slow
def test_two_processes_without_cpu_mode_on_a_machine_without_gpus_stop_with_the_fix(tmp_path):
    result = _run(tmp_path, _torchrun(2), cpu_env=False, expect=1)
    assert "the launcher started 2 processes but Accelerate sees 1" in result.stderr
    assert "ACCELERATE_USE_CPU=1" in result.stderr


@pytest.mark.real
@pytest.mark.slow
def test_a_bad_setting_on_the_command_line_stops_with_its_name_and_range(tmp_path):
    result = _run(tmp_path, [sys.executable], "--grad_accum_steps", "0", "--cpu", expect=1)
    assert "ValueError: grad_accum_steps must be an integer of at least 1, got 0" in result.stderr


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
    ({"grad_accum_steps": 2.0}, "grad_accum_steps must be an integer of at least 1, got 2.0"),
    ({"epochs": True}, "epochs must be an integer of at least 1, got True"),
    ({"max_grad_norm": -1.0}, "max_grad_norm must be at least 0 \\(0 or None: no clipping\\), got -1.0"),
    ({"final_lr_fraction": 1.5}, "final_lr_fraction must be in \\[0, 1\\], got 1.5"),
])
def test_bad_training_settings_get_a_clear_error_before_anything_runs(settings, message):
    accelerator = SimpleNamespace(gradient_accumulation_steps=settings.pop("grad_accum_steps", 2))
    with pytest.raises(ValueError, match=message):  # model, loader and optimizer are never touched
        _load_script().train_causal_lm(None, None, None, accelerator, **settings)


@pytest.mark.parametrize(("rows", "micro_batch_size", "message"), [
    ([[1, 2, 3]], 0, "micro_batch_size must be an integer of at least 1, got 0"),
    ([[1, 2, 3]], "2", "micro_batch_size must be an integer of at least 1, got '2'"),
    ([], 2, "rows must hold at least one row"),
    ([[1, 2], [7]], 2, "each of at least 2 tokens"),
])
def test_bad_data_settings_get_a_clear_error(rows, micro_batch_size, message):
    with pytest.raises(ValueError, match=message):
        _load_script().padded_loader(rows, micro_batch_size, 1)


def test_target_free_rows_add_no_target_and_fill_every_process():
    module = _load_script()
    rows = [[5, 6, 7], [8, 9]]
    batches = list(module.padded_loader(rows, 2, 2))  # 2 processes x micro-batches of 2: 4 rows
    assert len(batches) == 2 and batches[1]["input_ids"].tolist() == [[0], [0]]
    assert batches[0]["input_ids"].tolist() == [[5, 6, 7], [8, 9, 0]]
    assert [int(b["labels"][:, 1:].ne(-100).sum()) for b in batches] == [3, 0]  # 2 + 1 after the shift, then none
    assert len(module.padded_loader(rows, 2, 1)) == 1  # one process: nothing to top up


# ----------------------------------------------------------------------------------------------
# Lesson 05 trains with these very functions: its cells hold them character for character.
# Deep dive 12 runs them again, from one collapsed cell: the same text.
# ----------------------------------------------------------------------------------------------

LESSON = ROOT / "notebooks" / "05_capstone_language_model.ipynb"
FURTHER = ROOT / "notebooks" / "12_capstone_further.ipynb"
RECIPE = ("IGNORE_INDEX", "train_causal_lm", "summed_next_token_loss", "collate_rows", "padded_loader",
          "check_settings", "check_backend")


def _top_level(source):
    """Each top-level function and assignment of `source`, by name, as its exact text (comments on its line too)."""
    lines, found = source.splitlines(), {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef):
            found[node.name] = "\n".join(lines[node.lineno - 1:node.end_lineno])
        elif isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            found[node.targets[0].id] = "\n".join(lines[node.lineno - 1:node.end_lineno])
    return found


def _lesson_code(lesson=LESSON):
    cells = json.loads(lesson.read_text())["cells"]
    return ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]


@pytest.mark.parametrize("lesson", [LESSON, FURTHER], ids=["05", "12"])
def test_lessons_05_and_12_hold_the_scripts_recipe_character_for_character(lesson):
    in_script = _top_level(SCRIPT.read_text())
    in_lesson = {}
    for cell in _lesson_code(lesson):
        for name, text in _top_level(cell).items():
            assert name not in in_lesson or name not in RECIPE, f"{lesson.name} defines {name} twice"
            in_lesson[name] = text
    for name in RECIPE:
        assert name in in_lesson, f"{lesson.name} does not show {name}"
        assert in_lesson[name] == in_script[name], f"{name} in {lesson.name} differs from examples/train_causal_lm.py"


def _train_in_this_process(functions, model, rows, *, grad_accum_steps, micro_batch_size, **knobs):
    """The script's main(), but with a given model and rows; the Accelerator is dropped afterwards."""
    import torch
    from accelerate import Accelerator

    from gaccum_lib import reset_accelerate_state

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=grad_accum_steps)
    loader = functions["padded_loader"](rows, micro_batch_size, accelerator.num_processes)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    try:
        return functions["train_causal_lm"](model, loader, optimizer, accelerator, **knobs)
    finally:
        reset_accelerate_state(quiet=True)


def test_lesson_05s_recipe_cells_run_alone_and_train_as_the_script_does():
    # The cells that define the recipe, run by themselves in a fresh namespace: nothing else of the lesson needed.
    namespace = {}
    for cell in _lesson_code():
        if any(f"def {name}(" in cell for name in RECIPE):
            exec(compile(cell, str(LESSON), "exec"), namespace)
    module = _load_script()
    rows = module.demo_rows(11, vocab_size=16)
    losses = {name: _train_in_this_process(functions, module.tiny_llama(16), rows, grad_accum_steps=3,
                                           micro_batch_size=2, epochs=2)
              for name, functions in (("lesson", namespace), ("script", vars(module)))}
    assert len(losses["lesson"]) == 4 and losses["lesson"] == losses["script"]


def _take_home_ranks(rows, make_model, settings):
    """The script's train_causal_lm in this rank, measured by the lessons' UpdateRecorder."""
    import torch
    from accelerate import Accelerator

    from gaccum_lib.accelerate_runs import UpdateRecorder

    module, recorder = _load_script(), UpdateRecorder()
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=settings["grad_accum_steps"])
    model = make_model()
    loader = module.padded_loader(rows, settings["micro_batch_size"], accelerator.num_processes)
    module.train_causal_lm(model, loader, torch.optim.SGD(model.parameters(), lr=settings["lr"]), accelerator,
                           epochs=settings["epochs"], max_grad_norm=None, final_lr_fraction=1.0, on_update=recorder)
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

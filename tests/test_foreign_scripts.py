"""The invariance check on public training scripts nobody here wrote (issue 40): the verdict their code calls for.

Their code is not ours to commit: tests/foreign_scripts/README.md names each script's source, commit and
licence, what was changed so that it runs offline, and the verdict its code calls for, decided before the
check ran. Fetch them at those commits, make those changes, and point GACCUM_FOREIGN_SCRIPTS at the folder
(laid out as the README says); without it these tests are skipped. The classes they exercise are tested
on gaccum's own scripts in every run (tests/test_invariance.py). Each test runs the command line as a
user would and checks that the headline, the lines right after it and the exit status agree.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

FOREIGN = Path(os.environ.get("GACCUM_FOREIGN_SCRIPTS", "/nonexistent"))
pytestmark = [pytest.mark.real, pytest.mark.slow,
              pytest.mark.skipif(not (FOREIGN / "accelerate").is_dir(),
                                 reason="GACCUM_FOREIGN_SCRIPTS unset: see tests/foreign_scripts/README.md")]
OFFLINE_DATA = Path(__file__).resolve().parent / "foreign_scripts" / "accelerate"  # gaccum's own stand-in data
EXIT_STATUS = {"passed": 0, "failed": 1, "inconclusive": 3}
HEADLINE = {"passed": "invariance check passed", "failed": "invariance check FAILED",
            "inconclusive": "invariance check INCONCLUSIVE"}


def check(folder, processes, *command):
    """`python -m gaccum_check invariance --processes ... -- python ...` (GA 4, 2 rows), run in ``folder``."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    # the check's own timeout comes first: it stops a hung run with its ranks and reports it
    done = subprocess.run([sys.executable, "-m", "gaccum_check", "invariance", "--timeout", "300", "--processes",
                           *processes, "--", "python", *map(str, command)], cwd=folder, capture_output=True,
                          text=True, env=env, timeout=900)
    return done


def said(done, verdict) -> list[str]:
    """The report's lines, once its exit status, headline and the line after it agree on ``verdict``."""
    lines = done.stdout.splitlines()
    assert done.returncode == EXIT_STATUS[verdict], done.stdout + done.stderr[-3000:]
    assert lines[0].startswith(HEADLINE[verdict] + " (relative tol 0.0001)"), done.stdout
    if verdict != "passed":
        assert lines[1] == ("diagnosis:" if verdict == "failed" else "cannot judge:"), done.stdout
    return lines


def test_accelerate_nlp_example_steps_on_an_off_by_one_boundary(tmp_path):
    # `if step % gradient_accumulation_steps == 0` with step from 0; one process: the same shuffled order in both.
    done = check(tmp_path, ["1"], FOREIGN / "accelerate" / "nlp_example.py", "--cpu", "--num_epochs", "1",
                 "--gradient_accumulation_steps", "{grad_accum_steps}", "--micro_batch_size", "{micro_batch_size}")
    lines = said(done, "failed")
    assert lines[2].startswith("  - off-by-one step boundary: update 1 trained on 1 micro-batch per process, and "
                               "every later update on the next GA=4"), done.stdout
    assert "1 process (GA=4): FAILED  8 updates (full batch 8)" in done.stdout
    assert "weighted unequally" not in done.stdout  # what the check said before issue 40


def test_accelerate_gradient_accumulation_shuffles_other_rows_on_two_processes(tmp_path):
    done = check(tmp_path, ["2"], FOREIGN / "accelerate" / "gradient_accumulation.py", "--cpu", "--num_epochs", "1",
                 "--gradient_accumulation_steps", "{grad_accum_steps}", "--micro_batch_size", "{micro_batch_size}")
    lines = said(done, "inconclusive")
    assert lines[2].startswith("  - other rows (2 processes): update 1 trained on 16 rows, "), done.stdout
    assert "the same rows reach the updates in another order: a shuffled sampler" in lines[2]
    assert "diagnosis:" not in done.stdout and "wrong update size" not in done.stdout  # said before issue 40


def test_accelerate_autoregressive_example_passes_on_two_processes(tmp_path):
    done = check(tmp_path, ["2"], FOREIGN / "accelerate" / "gradient_accumulation_for_autoregressive_models.py",
                 "--cpu", "--num_epochs", "1", "--gradient_accumulation_steps", "{grad_accum_steps}",
                 "--per_device_batch_size", "{micro_batch_size}")
    lines = said(done, "passed")
    assert lines[1].startswith("  2 processes (GA=4): passed  4 updates (full batch 4); weights off by "), done.stdout
    assert "logged losses by" in lines[1]  # "train loss: ..." read, one line per update


def test_nanogpt_draws_other_rows_and_its_ranks_raise_their_own_exception(tmp_path):
    for name in ("train.py", "model.py", "configurator.py"):  # it reads configurator.py from where it runs
        shutil.copy(FOREIGN / "nanogpt" / name, tmp_path / name)
    done = check(tmp_path, ["1", "2"], "train.py", "--device=cpu", "--dtype=float32", "--compile=False",
                 "--backend=gloo", "--dataset=tiny", "--n_layer=1", "--n_head=2", "--n_embd=16", "--block_size=16",
                 "--dropout=0.0", "--max_iters=2", "--eval_iters=1", "--log_interval=1",
                 "--always_save_checkpoint=False", "--gradient_accumulation_steps={grad_accum_steps}",
                 "--batch_size={micro_batch_size}")
    said(done, "inconclusive")
    block = done.stdout.split("cannot judge:\n", 1)[1].split("\n  1 process (GA=4)", 1)[0]
    assert "  - other rows (1 process): update 1 trained on 8 rows" in block, done.stdout
    assert "other rows altogether: rows drawn at random per batch" in block
    assert "1 process (GA=4): INCONCLUSIVE  3 updates (full batch 3); other rows" in done.stdout  # kept
    if torch.cuda.device_count() < 2:  # it sets cuda:{local rank} under torchrun, whatever --device says
        assert "  - run failed (2 processes): the script raised on rank " in block, done.stdout
        assert 'File "train.py", line' in block and "torch.cuda.set_device(device)" in block
        assert "ChildFailedError" not in done.stdout  # torchrun's banner, all it showed before issue 40


def _alpaca_files(folder: Path):
    """A 1-layer Llama with a word-level tokenizer saved where --model_name_or_path finds it, and 64 rows."""
    sys.path.insert(0, str(OFFLINE_DATA))
    try:
        import offline_data
    finally:
        sys.path.pop(0)
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(offline_data.tiny_llama_config()).save_pretrained(folder / "model")
    offline_data.tiny_tokenizer().save_pretrained(folder / "model")
    rows = [{"instruction": f"w{5 + i % 20} w{6 + i % 7}", "input": "",
             "output": " ".join(f"w{5 + (i * j) % 27}" for j in range(1 + i % 9))} for i in range(64)]
    (folder / "data.json").write_text(json.dumps(rows))


def test_stanford_alpaca_fails_with_its_own_exception_on_transformers_5(tmp_path):
    _alpaca_files(tmp_path)
    done = check(tmp_path, ["1"], FOREIGN / "stanford_alpaca" / "train.py", "--model_name_or_path", "model",
                 "--data_path", "data.json", "--output_dir", "out", "--use_cpu", "True", "--report_to", "none",
                 "--num_train_epochs", "1", "--logging_steps", "1", "--save_strategy", "no",
                 "--gradient_accumulation_steps", "{grad_accum_steps}", "--per_device_train_batch_size",
                 "{micro_batch_size}")
    lines = said(done, "inconclusive")
    assert lines[2] == "  - run failed (1 process): its full batch could not be made: the script raised on 1 " \
                       "process at GA 1, micro-batch 8:", done.stdout
    assert "TypeError: Trainer.__init__() got an unexpected keyword argument 'tokenizer'" in done.stdout

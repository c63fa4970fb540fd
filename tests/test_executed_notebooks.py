"""What the executed notebooks show (run by `make notebooks` after nbmake wrote the outputs).

nbmake fails a notebook on an error or a failed assert; these tests add that the reference
figures are visible in the outputs a learner reads.
"""

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXECUTED = ROOT / "build" / "executed"

# Text each executed notebook must show somewhere in its outputs.
EXPECTED_FIGURES = {
    "00_start_here.ipynb": ["weight after one accumulated update: 2.04000",
                            "weight after one full-batch step:    2.04000"],
    "01_why_accumulate.ipynb": ["2,363,393 weights; weights + gradients: 18.0 MiB at every batch size",
                                "             32 |                            0.78 |         0.78",
                                "            512 |                           12.50 |         0.78",
                                "accumulated, loss / GA:    w = 2.04000", "accumulated, no division:  w = 8.16000",
                                "full batch, one step:      w = 2.04000",
                                "full batch         weights after each update: [0.0, 2.04, 1.9992, 2.0]",
                                "forgot / GA        weights after each update: [0.0, 8.16, -16.9728, 60.4362]"],
    "02_accelerate_does_it.ipynb": ["w/ accumulation, final weight: 2.04000",
                                    "w/o accumulation, final weight: 2.04000",
                                    "updates after micro-batches: [4, 8, 10]",
                                    "divided by hand and by accelerator.backward: 0.51000",
                                    "full batch    weight after each update: [0.0, 0.204, 1.36422, 2.23778]",
                                    "accumulate()  weight after each update: [0.0, 0.204, 1.36422, 1.801]",
                                    "last update: full batch 0.87357, accumulate() 0.43678, ratio 0.500",
                                    "fixed loop    weight after each update: [0.0, 0.204, 1.36422, 2.23778]"],
    "08_your_real_stack.ipynb": [
        "labels per update: [294, 425]   targets after the shift: [278, 409]",
        "counts: default 294, with loss_type set 278",
        "true gradient's norm 2.31: clipped to 1",  # the prose quotes it: clipping would bind
        "GPT-2's update with the default count is 0.94558 of the true one; targets / labels = 278/294 = 0.94558",
        "2 processes, GA 4 x 2 rows ",
        "weights torch.float32  gradients torch.float32",
        "gpt2, Trainer.training_step: failed: targets counted before the shift"],
    "09_schedulers_across_processes.ipynb": [
        "2 processes  12 batches per rank, scheduler steps after each update: [2, 4, 6]",
        "250 batches per rank, 32 updates, 128 scheduler steps in the epoch (formula: 128; usual rule: 125)",
        "split_batches: 24 batches per rank, scheduler steps [1, 2, 3, 4, 5, 6]",
        "all-reduces after each update: default [1, 2, 3], sync_each_batch [4, 8, 12]",
        "plugin.adjust_scheduler = True, what the scheduler reads = False",
        "handed to the gradient state: {'num_steps': 4}",  # the default-valued option is left out
        "lr of each update, flag honoured:          [0.004, 0.035, 0.0879, 0.0994, 0.0994, 0.0994,"],
    "03_variable_length_trap.ipynb": ["initial weights: [-0.0075, 0.5364]", "full batch:       [0.0953, 0.4337]",
                                      "naive (mean of means): [0.0775, 0.4514]",
                                      "token-normalised (36 targets): [0.0953, 0.4337]",
                                      "  2 |           4 |    [0.0775, 0.4514] | 0.0178",
                                      "  8 |           1 |    [0.0666, 0.4623] | 0.0286",
                                      "spread 0.75: 8 updates, largest distance to the full batch: naive 1.4e-02",
                                      "spread 0.0: 8 updates, largest distance to the full batch: naive 4.2e-08"],
    "04_many_processes.ipynb": ["rank 0: micro-batches of lengths [[1, 2, 3, 4], [9, 10, 11, 12]] -> 52 target tokens",
                                "targets in the whole update: 136",
                                "global count, x processes: [0.2117, 0.3172]",
                                "forgot x processes:        [0.1021, 0.4268]",
                                "local count, not gathered: [0.4160, 0.1130]",
                                "targets (local, total) per update [(52, 136), (74, 164)], weights [0.4773, 0.0516]",
                                "targets (local, total) per update [(84, 136), (90, 164)], weights [0.4773, 0.0516]",
                                "no_sync        all-reduces per update [1, 1, 1, 1]:",
                                "every_step     all-reduces per update [4, 4, 4, 4]:",
                                "backward_only  all-reduces per update [4, 4, 4, 4]:"],
    "05_capstone_language_model.ipynb": [
        "14993 weights, dtype torch.float64",  # the prose: the distance is over all 14,993 weights
        "labels that are not padding: 149; targets after the shift: 146",
        "targets of the first update, rank 0 and rank 1: [521, 376] of 897",
        "accelerate (DistributedType.MULTI_CPU, 2 process(es))",
        "1 process: naive, largest distance to the full batch 0.1759, after the last update / after the first 3.1",
        "2 real processes: naive, largest distance to the full batch 0.2042, after the last update / after the "
        "first 2.5",
        "no_sync, all-reduces per update: [1, 1, 1, 1, 1, 1, 1, 1] ...",
        "gradient norm above 1 (clipped) in 5 of 12 updates; learning rate 0.5 at the first update, 0.0875 at "
        "the last"],
    "12_capstone_further.ipynb": [
        "  2            8 |                  0.0466",
        " 16            1 |                  0.2321",
        "packed: 64 blocks of 58 characters, 3648 targets (one line per row: 3674)",
        "first update (same weights for all): full batch 4.17589, naive 4.17795, token-normalised 4.17589",
        "targets per update in the first epoch: full batch [897, 126] {'pad': [897, 126], 'repeat': [897, 210]}",
        "'repeat': '3.5e-02'}",
        "bf16 autocast vs float32 over 4 updates",
        "DEEPSPEED: DeepSpeed is not supported by this loop",
        "FSDP: FSDP is not supported by this loop"],
    "07_benchmarks.ipynb": ["all-reduces per update: 1 with no_sync, 8 without",
                            "token-normalised / naive, per update:",
                            "14,993 weights: 60 KB of gradients"],
    "06_pitfalls_gallery.ipynb": [
        "check_accumulation passed", "FAILED: loss divided by GA twice", "update / full-batch update: {'GA=4': 0.25, "
        "'GA=2': 0.5}", "FAILED: mean of micro-batch means",
        "update's distance to the full batch's, relative: {'GA=2': 0.17, 'GA=4': 0.226, 'GA=8': 0.242}",
        "2 processes at GA 2: 0.226, as 1 process at GA 4",
        "FAILED: token count not gathered across ranks", "each rank's count: [52, 84] of 136",
        "FAILED: missing x num_processes", "targets after the shift 390, before 398: the update is 0.9799x",
        "FAILED: optimizer stepped on every micro-batch",
        "prepared optimizer, GA 4, no accumulate(): the weights moved after 4 of 4 micro-batches",
        "backward_only  all-reduces per update [4, 4], ranks differ by 0.0e+00",
        "inverted       all-reduces per update [3, 3]",
        "micro_batches    lr of the last update 0.0760; updates at lr 0: 0",
        "sharded_updates  lr of the last update 0.0000; updates at lr 0: 12",
        "the last update's step: {'full_batch': 0.87357, 'mean_of_means': 0.43678, 'token_normalised': 0.87357}",
        "{'gather': [0, 0, 1, 1, 2, 2, 3, 4], 'gather_for_metrics': [0, 1, 2, 3, 4]}",
        "rank 0 of 2 failed with AttributeError",
        "notebook_launcher, each process's (rank, processes): [(0, 1), (0, 1)]",
        "gaccum_lib.launch, each process's (rank, processes): [(0, 2), (1, 2)]",
        "its state was reset",
        "gaccum_lib.launch after a reset: [0.2117, 0.3172]", "threads: kernel 2, launched processes [1, 1]",
        "accumulate updates that moved the weights: 1 of 4",
        "4 micro-batches, 1 update: w = 4.08000 (correct: 2.04000)",
        "one batch at a time         the weights moved after micro-batches [3, 7]",
        "read ahead                  the weights moved after micro-batches [3, 4, 5, 6, 7]",
        "read ahead, synced by hand  the weights moved after micro-batches [3, 7]",
        "evaluation left early            updates at (epoch, micro-batch) [(0, 3), (0, 7), (1, 1), (1, 5), (1, 9)]",
        "evaluation run to its end        updates at (epoch, micro-batch) [(0, 3), (0, 7), (0, 9), (1, 3), (1, 7), "
        "(1, 9)]",
        "left early, loader not prepared  updates at (epoch, micro-batch) [(0, 3), (0, 7), (0, 9), (1, 3), (1, 7), "
        "(1, 9)]"],
    "10_fsdp_and_deepspeed.ipynb": [
        "collectives per update {'all-gather': 24, 'reduce-scatter': 3}",
        "collectives per update {'all-gather': 24, 'reduce-scatter': 12}",
        "gradient elements held after each backward of the first window [369, 369, 369, 193]",
        "('DistributedType.MULTI_CPU', 'DistributedDataParallel')",
        "accumulate()'s sync_gradients: 4 updates",
        "sync_gradients always True (as under ZeRO 2/3, where no_sync does nothing): 16 updates",
        "rank 0 of 2 failed with AssertionError: It is illegal to call Engine.step() inside no_sync context manager"],
    "11_rl_and_unaccumulable_losses.ipynb": [
        "(1, 2): '0.251', (2, 1): '0.251'", "(8, 2): '0.883'",
        "'grpo': (0.8834, 0.763)", "'dr_grpo': (0.4844, 1.0)",
        "'bnpo': [1.221, 1.049]", "'dapo': [0.621, 0.379]", "'dapo (TRL 1.16)': [1.242, 0.758]",
        "InfoNCE loss, whole window 1.626 | GA 8's micro-batches 0.318",
        "('batch_norm', 4, 'naive 0.401'", "('in_batch_negatives', 4, 'naive 0.460'",
        "('load_balancing', 4, 'naive 0.165'", "('batch_norm', 8, 'naive 0.662'",
        "per-micro-batch InfoNCE: passed | BatchNorm net: failed",
        "0.4 (relative) from one forward over the whole window"],
}

NOTEBOOKS = sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb"))


def _output_text(path: Path) -> str:
    nb = json.loads(path.read_text())
    parts = []
    for cell in nb["cells"]:
        for output in cell.get("outputs", []):
            if output.get("output_type") == "stream":
                parts.append("".join(output["text"]))
            elif "data" in output:
                parts.append("".join(output["data"].get("text/plain", "")))
                parts.append("".join(output["data"].get("text/markdown", "")))
            elif output.get("output_type") == "error":
                parts.append(f"ERROR {output.get('ename')}: {output.get('evalue')}")
    return "\n".join(parts)


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_was_executed_without_error(name):
    path = EXECUTED / name
    assert path.exists(), f"{path} missing: run `make notebooks`"
    nb = json.loads(path.read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert any(c.get("outputs") for c in code), "no outputs: was it executed?"
    errors = [o for c in code for o in c.get("outputs", []) if o.get("output_type") == "error"
              and "raises-exception" not in c.get("metadata", {}).get("tags", [])]
    assert errors == []


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_reference_figures_appear_in_the_outputs(name):
    assert name in EXPECTED_FIGURES, f"add the figures {name} must show to EXPECTED_FIGURES"
    text = _output_text(EXECUTED / name)
    missing = [figure for figure in EXPECTED_FIGURES[name] if figure not in text]
    assert missing == []


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_every_figure_is_shown_as_a_picture_not_as_its_repr(name):
    nb = json.loads((EXECUTED / name).read_text())
    bare = [i for i, cell in enumerate(nb["cells"]) for output in cell.get("outputs", [])
            if "".join(output.get("data", {}).get("text/plain", "")).startswith("<Figure size")
            and "image/png" not in output.get("data", {})]
    assert bare == [], f"cells {bare} show '<Figure size ...>' text where the learner expects the plot"

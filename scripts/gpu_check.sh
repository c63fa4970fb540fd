#!/usr/bin/env bash
# The device check, for a session that is lent a GPU machine: run once, from the repository root,
# through the device tool (`bash scripts/gpu_check.sh`, timeout_s 480). The machine has its own torch
# (CUDA), accelerate and transformers and no network, and no Jupyter: the take-home script runs as
# a learner copies it (examples/train_causal_lm.py needs nothing else from this repository), and the
# library's GPU-facing parts run from this checkout (gaccum_lib needs only torch and accelerate).
#
# What it shows, in about 3 minutes on one GPU:
#   - the take-home script chooses the GPU by itself and runs there in float32 and under bf16 and fp16
#     autocast (how far their printed losses are from float32's is printed, not yet a check); `--cpu`
#     is honoured; gaccum-check invariance finds it equal to its full batch there in float32;
#   - lesson 01's memory figure (weights + gradients + the activations autograd saves) next to what
#     torch.cuda.max_memory_allocated reports for the same update on the GPU (printed, not yet a
#     check: no GPU has run it, so no tolerance is known);
#   - two launched processes while CUDA is present (the launch cells' one-GPU branch: CPU processes
#     over gloo; one GPU cannot host two NCCL ranks) and `make bench`'s all-reduce and time-cost
#     sections on this machine.
# Not covered: the notebooks themselves (they need Jupyter, which the machine lacks) and DDP over
# NCCL (it needs two GPUs).
#
# EXPECT_DEVICE=cpu runs the same checks on a machine without a GPU (tests/test_gpu_check.py does,
# with fewer updates): what needs CUDA says it was skipped. Everything lands in $OUT: gpu_check.log,
# the output of each take-home run (run_<name>.txt), memory.json and bench.json.
set -uo pipefail
OUT=${OUT:-build/gpu_check}
EXPECT_DEVICE=${EXPECT_DEVICE:-cuda}
EPOCHS=${EPOCHS:-2}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
LOG="$OUT/gpu_check.log"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
work=$(mktemp -d)
cp examples/train_causal_lm.py "$work/"
{
  nvidia-smi --query-gpu=name,memory.total --format=csv 2>&1 || echo "nvidia-smi: not available"
  python -c 'import torch, accelerate, transformers; print("torch", torch.__version__, "cuda", torch.version.cuda,
"accelerate", accelerate.__version__, "transformers", transformers.__version__)'
} >"$LOG" 2>&1
status=0
run() {  # name, then the script's arguments
  local name=$1; shift
  echo "== $name: python train_causal_lm.py $*" >>"$LOG"
  (cd "$work" && timeout 150 python train_causal_lm.py --epochs "$EPOCHS" "$@") >"$OUT/run_$name.txt" 2>&1
  local code=$?
  cat "$OUT/run_$name.txt" >>"$LOG"
  echo "== $name: exit $code" >>"$LOG"
  [ $code -eq 0 ] || status=1
}
run gpu_float32
run gpu_bf16 --mixed_precision bf16
run gpu_fp16 --mixed_precision fp16
run forced_cpu --cpu
echo "== invariance: the take-home script at GA 4 against its full batch, one process, float32" >>"$LOG"
(cd "$work" && timeout 240 python -m gaccum_check invariance --processes 1 -- python train_causal_lm.py \
  --epochs "$EPOCHS" --grad_accum_steps {grad_accum_steps} --micro_batch_size {micro_batch_size}) >>"$LOG" 2>&1 || status=1
echo "== memory: lesson 01's count against torch.cuda.max_memory_allocated" >>"$LOG"
timeout 120 python - "$OUT" >>"$LOG" 2>&1 <<'PY' || status=1
import json, pathlib, sys

import torch

from gaccum_lib.memory import memory_demo_model, peak_step_memory

out = pathlib.Path(sys.argv[1])
if not torch.cuda.is_available():
    print("memory: skipped, CUDA is not available")
    (out / "memory.json").write_text(json.dumps({"skipped": "no CUDA"}) + "\n")
    sys.exit(0)
rows = []
model = memory_demo_model().cuda()
for micro_batch, ga in ((32, 1), (32, 4), (128, 1)):
    torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
    step = peak_step_memory(model, micro_batch, ga, device="cuda")  # lesson 01's count, on the GPU
    torch.cuda.synchronize()
    row = {"micro_batch": micro_batch, "ga": ga, "lesson_01_mib": step.peak / 2**20,
           "max_memory_allocated_mib": torch.cuda.max_memory_allocated() / 2**20}
    rows.append(row)
    print(f"micro-batch {micro_batch} x GA {ga}: lesson 01 counts {row['lesson_01_mib']:.1f} MiB, "
          f"max_memory_allocated {row['max_memory_allocated_mib']:.1f} MiB")
(out / "memory.json").write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1) + "\n")
PY
echo "== bench: all-reduce (2 launched processes) and time cost on this machine" >>"$LOG"
timeout 240 python benchmarks/bench.py --only time_cost,allreduce --quick --out "$OUT/bench.json" --no-plot >>"$LOG" 2>&1 \
  || status=1
python - "$OUT" "$EXPECT_DEVICE" >>"$LOG" 2>&1 <<'PY' || status=1
import json, pathlib, re, sys
out, expected = pathlib.Path(sys.argv[1]), sys.argv[2]
losses = {}
for name, device in (("gpu_float32", expected), ("gpu_bf16", expected), ("gpu_fp16", expected), ("forced_cpu", "cpu")):
    text = (out / f"run_{name}.txt").read_text()
    found = re.findall(r"^training on (\S+), 1 process\(es\)$", text, re.M)
    losses[name] = [float(x) for x in re.findall(r"loss per target (\d+\.\d+)", text)]
    gap = max(abs(a - b) for a, b in zip(losses[name], losses["gpu_float32"], strict=True))
    print(f"{name}: device {found}, {len(losses[name])} updates, printed losses at most {gap:.1e} from gpu_float32's")
    assert found and found[0].startswith(device), (name, found)
    assert len(losses[name]) == len(losses["gpu_float32"]) > 0, name
bench = json.loads((out / "bench.json").read_text())
assert bench["allreduce"]["allreduce_rounds_per_update"] == {"no_sync": 1, "every_micro_batch": 8}, bench["allreduce"]
assert bench["time_cost"]["packed"]["same_gradient_max_diff"] < 1e-5, bench["time_cost"]
print(f"bench: all-reduce on {bench['allreduce']['device']}, without / with no_sync "
      f"{bench['allreduce']['every_micro_batch_over_no_sync']:.2f}x; GA 16 / one big batch "
      f"{bench['time_cost']['packed']['over_big_batch']['16']:.2f}x (packed rows)")
PY
echo "gpu_check: exit $status" >>"$LOG"
cat "$LOG"
exit $status

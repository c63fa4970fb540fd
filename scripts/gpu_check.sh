#!/usr/bin/env bash
# The device check, for a session that is lent a GPU machine: run once, from the repository root,
# through the device tool (`bash scripts/gpu_check.sh`, timeout_s 480). The machine has its own torch
# (CUDA), accelerate and transformers and no network: only examples/train_causal_lm.py runs there,
# as a learner copies it (it needs nothing else from this repository).
#
# What it shows: the take-home script chooses the GPU by itself, equals its full batch there in
# float32, and stays within its stated tolerance of float32 under bf16 and fp16 autocast; `--cpu`
# is honoured. (One GPU cannot host two NCCL ranks, so DDP on GPUs needs a machine with two.)
# Everything lands in $OUT: gpu_check.log and one JSON report per run.
set -uo pipefail
OUT=${OUT:-build/gpu_check}
mkdir -p "$OUT"
LOG="$OUT/gpu_check.log"
export PYTHONUNBUFFERED=1
work=$(mktemp -d)
cp examples/train_causal_lm.py "$work/"
{
  nvidia-smi --query-gpu=name,memory.total --format=csv
  python -c 'import torch, accelerate, transformers; print("torch", torch.__version__, "cuda", torch.version.cuda,
"accelerate", accelerate.__version__, "transformers", transformers.__version__)'
} >"$LOG" 2>&1
status=0
run() {  # name, then the script's arguments
  local name=$1; shift
  echo "== $name: python train_causal_lm.py $*" >>"$LOG"
  (cd "$work" && timeout 150 python train_causal_lm.py --report "report_$name.json" "$@") >>"$LOG" 2>&1
  local code=$?
  cp "$work/report_$name.json" "$OUT/" 2>/dev/null
  echo "== $name: exit $code" >>"$LOG"
  [ $code -eq 0 ] || status=1
}
run gpu_float32
run gpu_bf16 --mixed_precision bf16
run gpu_fp16 --mixed_precision fp16
run forced_cpu --cpu --epochs 1
python - "$OUT" >>"$LOG" 2>&1 <<'PY' || status=1
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
for name, device in (("gpu_float32", "cuda"), ("gpu_bf16", "cuda"), ("gpu_fp16", "cuda"), ("forced_cpu", "cpu")):
    report = json.loads((out / f"report_{name}.json").read_text())
    check = report["check"]
    print(f"{name}: device {report['device']}, {check['updates']} updates, largest weight difference "
          f"{check['largest_weight_difference']:.1e} (tolerance {check['tolerance']:.0e}), equal {check['equal']}")
    assert report["device"].startswith(device), (name, report["device"])
    assert check["equal"], name
PY
echo "gpu_check: exit $status" >>"$LOG"
cat "$LOG"
exit $status

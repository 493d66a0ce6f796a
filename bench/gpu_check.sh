#!/usr/bin/env bash
# One-shot GPU check for a lent NVIDIA machine (docs/benchmarks.md, "TensorRT"), under 8 min:
#   1. installs the carried wheels (.whl/, from bench/fetch_gpu_wheels.sh) into /tmp/site,
#   2. SD-1.5-sized UNet (random weights, fp16, 512 px) steps/s at batch 1/4/8 for torch
#      eager, TensorRT (engine built here, checked against eager) and torch.compile,
#   3. an SDXL-sized UNet (fp16) and a Flux-sized transformer (bf16, 12 B parameters), random
#      weights, 1024 px, through the worker's family interface (bench/gpu_families.py), eager,
#   4. the worker engine's end-to-end turbo latency (bench/gpu_e2e.py), torch and TensorRT,
#   5. the GPU tests (real engines from the tiny model vs torch) with the time left,
#   6. prints the side-by-side table. Files go to $OUT (the device tool's) or bench/out/gpu;
#      each stage's result (bench/record.py) to bench/results/, and a copy to $OUT/bench/results/
#      (what comes back from a device machine: copy it into the checkout's bench/results/).
# Stages run most important first, each in its own process under a time limit, so one that
# fails or runs long costs only itself.
# Knobs: GPU_CHECK_BUDGET_S (460), TRT_OPT_LEVEL (3; 2 builds the engine faster if it times out),
# GPU_CHECK_DRY_RUN=1: no GPU needed; runs what has a CPU dry run (the family rows, tiny
# variants) to check this script and its stages where no GPU is (figures meaningless).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/bench/out/gpu}
BUDGET=${GPU_CHECK_BUDGET_S:-460}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
LOG="$OUT/gpu_check.log"
: >"$LOG"
STARTED="$OUT/.started"
: >"$STARTED"
# the results this run wrote, copied where they come back (a device machine returns $OUT alone)
keep_results() {
    find bench/results -name '*.json' -newer "$STARTED" -exec cp --parents {} "$OUT" \; 2>/dev/null
}
trap keep_results EXIT
export PYTHONUNBUFFERED=1
say() { printf '[gpu_check %3ds] %s\n' "$SECONDS" "$*" | tee -a "$LOG"; }

if ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        >>"$LOG" 2>&1 || { say "installing the carried wheels failed (see $LOG)"; exit 1; }
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
DRY=${GPU_CHECK_DRY_RUN:-0}
# a dry run's figures are meaningless: its results stay beside its other files
[ "$DRY" = 1 ] && export BENCH_RESULTS=${BENCH_RESULTS:-$OUT/results}

# stage NAME MAX_SECONDS COMMAND...: run within min(MAX, what is left of the budget).
stage() {
    local name=$1 max=$2 left limit rc
    shift 2
    left=$((BUDGET - SECONDS))
    limit=$((max < left ? max : left))
    if [ "$limit" -lt 30 ]; then say "$name: skipped, ${left}s of the ${BUDGET}s budget left"; return; fi
    say "$name: start (limit ${limit}s)"
    timeout "$limit" "$@" 2>&1 | tee -a "$LOG"
    rc=${PIPESTATUS[0]}
    say "$name: exit $rc$([ "$rc" -eq 124 ] && echo ' (time limit)')"
}

FAMILIES=(bench/gpu_families.py --rows 1,4 --size 1024)
family_rows() {  # the SDXL- and Flux-sized rows; $1: extra arguments (--dry-run)
    stage sdxl 60 "$PY" "${FAMILIES[@]}" --family sdxl "$@" --json "$OUT/family_sdxl.json"
    stage flux 100 "$PY" "${FAMILIES[@]}" --family flux "$@" --json "$OUT/family_flux.json"
}
family_report() {
    "$PY" bench/gpu_families.py --report "$OUT"/family_sdxl.json "$OUT"/family_flux.json 2>&1 | tee -a "$OUT/report.txt" "$LOG"
}

if [ "$DRY" = 1 ]; then
    say "dry run on $(uname -m) without a GPU: the family rows on the CPU (tiny variants)"
    : >"$OUT/report.txt"
    family_rows --dry-run
    family_report
    say "dry run done in ${SECONDS}s"
    exit 0
fi

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | tee -a "$LOG"
"$PY" - <<'EOF' 2>&1 | tee -a "$LOG"
import torch, diffusers
print(f"python ok: torch {torch.__version__} (CUDA {torch.version.cuda}, GPU {torch.cuda.is_available()}), "
      f"diffusers {diffusers.__version__}")
from render.engine.backends.tensorrt import tensorrt_unavailable_reason
print("tensorrt:", tensorrt_unavailable_reason() or "available")
raise SystemExit(0 if torch.cuda.is_available() else 3)
EOF
case "${PIPESTATUS[0]}" in
    0) ;;
    3) say "torch sees no CUDA GPU: nothing to measure here"; exit 1 ;;
    *) say "torch/diffusers not importable: carry .whl (bench/fetch_gpu_wheels.sh)"; exit 1 ;;
esac

UNET=(bench/gpu_unet.py --batches 1,4,8 --size 512 --cache-dir /tmp/turbonode-engines --trt-opt-level "${TRT_OPT_LEVEL:-3}")
E2E=(bench/gpu_e2e.py --max-batch 8 --cache-dir /tmp/turbonode-engines)
stage eager 90 "$PY" "${UNET[@]}" --mode eager --json "$OUT/eager.json"
# Builds the UNet engine (batch 1..8, 512 px) that the TensorRT end-to-end run then finds cached.
stage tensorrt 270 "$PY" "${UNET[@]}" --mode tensorrt --json "$OUT/tensorrt.json"
family_rows
stage compile 150 "$PY" "${UNET[@]}" --mode compile --json "$OUT/compile.json"
stage e2e-torch 90 "$PY" "${E2E[@]}" --backend torch --json "$OUT/e2e_torch.json"
stage e2e-tensorrt 150 "$PY" "${E2E[@]}" --backend tensorrt --json "$OUT/e2e_tensorrt.json"
stage gpu-tests 150 "$PY" -m pytest -q -m gpu -p no:cacheprovider tests/render/engine/test_tensorrt_backend.py

say "summary"
"$PY" bench/gpu_unet.py --report "$OUT"/eager.json "$OUT"/compile.json "$OUT"/tensorrt.json 2>&1 \
    | tee "$OUT/report.txt" | tee -a "$LOG"
"$PY" bench/gpu_e2e.py --report "$OUT"/e2e_torch.json "$OUT"/e2e_tensorrt.json 2>&1 | tee -a "$OUT/report.txt" "$LOG"
family_report
say "done in ${SECONDS}s"

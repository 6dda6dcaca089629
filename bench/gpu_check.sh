#!/usr/bin/env bash
# The GPU checks, in one go, on a machine with one NVIDIA GPU (under 5 minutes):
#
#   bench/gpu_check.sh OUTDIR
#
#   1. device info: nvidia-smi, and what torch sees  -> nvidia-smi.txt, device.json
#   2. the GPU-marked tests (tests/test_gpu.py: nccl with one rank, set_device, pinned
#      memory, bf16 autocast, fp16 with GradScaler)  -> junit.xml, pytest.log
#   3. bench/overhead.py on cuda:0 (nccl, one rank): ddpkit vs the hand-written loop,
#      3 launches per workload                       -> overhead.json, overhead.txt
#   and summary.json: each step's exit status and seconds. Every step runs, under its own
#   timeout (at most 275 s in all), even if an earlier one failed; the exit status is 1
#   if any failed.
#
# DDPKIT_GPU_CHECK_DEVICE=cpu runs the same steps without a GPU (the GPU tests skip,
# overhead.py runs --device cpu --quick): that is how tests/test_bench.py checks this
# script. PYTHON picks the interpreter (default: .venv/bin/python, else python3).
set -euo pipefail

if [[ $# -ne 1 ]]; then
    echo "usage: bench/gpu_check.sh OUTDIR" >&2
    exit 2
fi
DEVICE=${DDPKIT_GPU_CHECK_DEVICE:-cuda}
if [[ "$DEVICE" != cuda && "$DEVICE" != cpu ]]; then
    echo "gpu_check: DDPKIT_GPU_CHECK_DEVICE must be cuda or cpu (got '$DEVICE')" >&2
    exit 2
fi
mkdir -p "$1"
OUT=$(cd "$1" && pwd)
cd "$(dirname "$0")/.."
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
export PYTHONUNBUFFERED=1

STEPS=()
FAILED=0

# step NAME SECONDS LOG COMMAND...: run COMMAND under a timeout with its output in LOG,
# and record its exit status and duration.
step() {
    local name=$1 limit=$2 log=$3 rc=0 start=$SECONDS
    shift 3
    echo "gpu_check: $name (at most ${limit}s)" >&2
    timeout --kill-after=10 "$limit" "$@" >"$log" 2>&1 || rc=$?
    if [[ $rc -ne 0 ]]; then
        FAILED=1
        echo "gpu_check: $name failed with status $rc$([[ $rc -eq 124 ]] && echo ' (timed out)'); see $log" >&2
    fi
    STEPS+=("\"$name\": {\"status\": $rc, \"seconds\": $((SECONDS - start))}")
}

# What torch sees. On a GPU machine, torch without CUDA would turn every GPU test into
# a skip: that is a failure here, not a pass.
DEVICE_INFO='
import json, platform, sys
import torch

want, out = sys.argv[1], sys.argv[2]
cuda = torch.cuda.is_available()
info = {
    "torch": torch.__version__,
    "python": platform.python_version(),
    "cuda_build": torch.version.cuda,
    "cuda_available": cuda,
    "device_count": torch.cuda.device_count() if cuda else 0,
    "nccl": torch.distributed.is_nccl_available(),
    "checked_on": want,
}
if cuda:
    props = torch.cuda.get_device_properties(0)
    info.update(
        name=torch.cuda.get_device_name(0),
        capability=f"{props.major}.{props.minor}",
        memory_gib=round(props.total_memory / 2**30, 1),
        bf16=torch.cuda.is_bf16_supported(),
    )
with open(out, "w") as f:
    json.dump(info, f, indent=2)
print(json.dumps(info))
if want == "cuda" and not cuda:
    sys.exit(f"gpu_check: torch {torch.__version__} sees no CUDA GPU")
'

if command -v nvidia-smi >/dev/null; then
    step nvidia_smi 15 "$OUT/nvidia-smi.txt" nvidia-smi
else
    echo "nvidia-smi: not found" >"$OUT/nvidia-smi.txt"
    if [[ "$DEVICE" == cuda ]]; then
        FAILED=1
        echo "gpu_check: nvidia-smi not found" >&2
    fi
fi
step device_info 40 "$OUT/device.log" "$PYTHON" -c "$DEVICE_INFO" "$DEVICE" "$OUT/device.json"
step gpu_tests 100 "$OUT/pytest.log" \
    "$PYTHON" -m pytest -m gpu tests/test_gpu.py -q -rs -p no:cacheprovider \
    --junitxml="$OUT/junit.xml"
overhead=(--device "$DEVICE" --nprocs 1 --out "$OUT/overhead.json")
if [[ "$DEVICE" == cuda ]]; then overhead+=(--repeats 3); else overhead+=(--quick); fi
step overhead 120 "$OUT/overhead.txt" "$PYTHON" bench/overhead.py "${overhead[@]}"

summary=$(IFS=,; echo "${STEPS[*]}")
ok=$([[ $FAILED -eq 0 ]] && echo true || echo false)
echo "{\"device\": \"$DEVICE\", \"ok\": $ok, \"steps\": {$summary}}" >"$OUT/summary.json"
echo "gpu_check: wrote $OUT ($([[ $FAILED -eq 0 ]] && echo 'all passed' || echo 'FAILED'))" >&2
exit $FAILED

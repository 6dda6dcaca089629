#!/usr/bin/env bash
# The GPU checks, in one go, on a machine with one NVIDIA GPU, torch (and numpy) and
# nothing else (no network, no .venv, no pytest, ddpkit not installed): at most 7 minutes.
#
#   bench/gpu_check.sh OUTDIR
#
#   1. device info: nvidia-smi, and what torch sees  -> nvidia-smi.txt, device.json
#   2. bench/gpu_checks.py: one NCCL rank through the spawn path and its teardown, a
#      forced-distributed Trainer with resume and a host-sync audit, NCCL's timeout,
#      two gloo ranks on one GPU, FSDP on one rank, bf16/fp16, pinned memory; each in
#      a fresh interpreter                        -> checks.json, <check>.json/.log
#   3. bench/overhead.py on cuda:0 (nccl, one rank): ddpkit vs the hand-written loop
#                                                 -> overhead.json, overhead.txt
#   and summary.json: each step's exit status and seconds, and every check's result
#   (also printed). Every step runs under its own timeout (405 s in all), even if an
#   earlier one failed; the exit status is 1 if any failed.
#
# ddpkit comes from this checkout's src/ (PYTHONPATH), so the machine's own torch is the
# one tested. DDPKIT_GPU_CHECK_DEVICE=cpu runs the same steps without a GPU (each check
# on the CPU with gloo, overhead.py --device cpu --quick): that is how tests/test_bench.py
# checks this script, in a fresh virtual environment that holds torch alone. PYTHON
# picks the interpreter (default: python3).
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
PYTHON=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
if ! "$PYTHON" -c "import torch, numpy, ddpkit" 2>"$OUT/import.log"; then
    # numpy: torch's object collectives need it, though torch does not install it.
    echo "gpu_check: $PYTHON cannot import torch, numpy and ddpkit (see $OUT/import.log)" >&2
    exit 2
fi

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
step checks 260 "$OUT/checks.log" \
    "$PYTHON" bench/gpu_checks.py --device "$DEVICE" --out "$OUT" --budget 240
overhead=(--device "$DEVICE" --nprocs 1 --out "$OUT/overhead.json")
if [[ "$DEVICE" == cuda ]]; then overhead+=(--repeats 1); else overhead+=(--quick); fi
step overhead 90 "$OUT/overhead.txt" "$PYTHON" bench/overhead.py "${overhead[@]}"

summary=$(IFS=,; echo "${STEPS[*]}")
ok=$([[ $FAILED -eq 0 ]] && echo true || echo false)
checks=$(cat "$OUT/checks.json" 2>/dev/null || echo null)
echo "{\"device\": \"$DEVICE\", \"ok\": $ok, \"steps\": {$summary}, \"checks\": $checks}" >"$OUT/summary.json"
cat "$OUT/summary.json"
echo "gpu_check: wrote $OUT ($([[ $FAILED -eq 0 ]] && echo 'all passed' || echo 'FAILED'))" >&2
exit $FAILED

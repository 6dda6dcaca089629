"""What only a GPU can show: the checks of bench/gpu_checks.py (one NCCL rank through
the spawn path, a forced-distributed Trainer with resume and a host-sync audit, two gloo
ranks sharing the GPU, FSDP on one rank, bf16/fp16, pinned memory), each in a fresh
interpreter.

Every test is marked `gpu` and skipped where CUDA is not available. `bench/gpu_check.sh`
runs the same checks on the GPU machine without pytest (it may have torch alone), and
tests/test_bench.py runs that script's CPU side.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT

GPU_CHECKS = ROOT / "bench" / "gpu_checks.py"
NAMES = [
    "nccl_spawn",
    "forced_ddp",
    "gloo_two_ranks",
    "fsdp_one_rank",
    "mixed_precision",
    "pinned_loader",
]

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (CUDA)"),
]


@pytest.mark.parametrize("name", NAMES)
def test_gpu_check(name: str, tmp_path: Path) -> None:
    subprocess.run(
        [
            sys.executable,
            str(GPU_CHECKS),
            "--device",
            "cuda",
            "--out",
            str(tmp_path),
            "--only",
            name,
        ],
        cwd=ROOT,
        timeout=300,
        check=False,
    )
    report = json.loads((tmp_path / f"{name}.json").read_text())
    assert report["ok"], report.get("trace") or report

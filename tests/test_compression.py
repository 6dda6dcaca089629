"""grad_compression="bf16": gradients all-reduced in bfloat16 on gloo, checked on 2 real
ranks: the average is right to bfloat16's precision, every rank ends with the same
model and optimizer state, and `verify` reports what the rounding did."""

from __future__ import annotations

import json
from pathlib import Path
from typing import cast

import pytest
import torch
from torch import nn

import ddpkit
from ddpkit import DistContext, launch
from ddpkit.errors import ConfigError
from ddpkit.parallel.ranks import all_gather
from tests.conftest import ROOT, run_cli

JOBS = ROOT / "tests" / "shaped_jobs.py"


def _averaged_gradient(ctx: DistContext) -> tuple[float, float]:
    """Each rank's gradient differs; DDP with the hook must leave their mean in bf16."""
    torch.manual_seed(0)
    model = ddpkit.prepare_model(nn.Linear(64, 64), ctx, grad_compression="bf16")
    bare = cast(nn.Linear, ddpkit.unwrap(model))
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(ctx.rank))
    model(x).square().sum().backward()
    assert bare.weight.grad is not None
    grads = all_gather(bare.weight.grad)  # the same tensor on both ranks
    # Each rank's own gradient, computed again without DDP.
    local = nn.Linear(64, 64)
    local.load_state_dict(bare.state_dict())
    local(x).square().sum().backward()
    assert local.weight.grad is not None
    mean = all_gather(local.weight.grad).view(2, 64, 64).mean(0)
    ranks_apart = float((grads[0] - grads[1]).abs().max())
    # Against the largest gradient: where the ranks' gradients cancel, the mean is near
    # zero and an element's own relative error says nothing about the rounding.
    relative = float((grads[0] - mean).abs().max() / mean.abs().max())
    return ranks_apart, relative


def test_the_bf16_hook_averages_the_ranks_gradients_to_bf16_precision() -> None:
    ranks_apart, relative = launch(_averaged_gradient, nprocs=2)
    assert ranks_apart == 0.0
    assert 0.0 < relative < 2**-7  # rounded (so it ran), within bfloat16's 8 bits


def _compress_with(ctx: DistContext, strategy: str, value: str) -> None:
    ddpkit.prepare_model(nn.Linear(4, 4), ctx, strategy=strategy, grad_compression=value)


def test_bad_grad_compression_is_a_clear_error() -> None:
    # Checked before anything else, so one process (which has nothing to compress)
    # refuses it too.
    with pytest.raises(ConfigError, match="grad_compression must be 'none' or 'bf16'"):
        launch(_compress_with, "ddp", "fp8", nprocs=1)
    with pytest.raises(ConfigError, match="strategy ddp only"):
        launch(_compress_with, "fsdp", "bf16", nprocs=1)


def _rank_states(folder: Path) -> list[dict[str, object]]:
    return [json.loads((folder / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.slow
def test_a_compressed_job_keeps_every_rank_equal_and_differs_from_full_precision(
    tmp_path: Path,
) -> None:
    runs = {}
    for compression in ("none", "bf16"):
        out = tmp_path / compression
        out.mkdir()
        done = run_cli(
            "train", "--job", f"{JOBS}:build_dict", "--nproc", "2",
            "--grad-compression", compression, env={"SHAPED_JOBS_OUT": str(out)},
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        states = _rank_states(out)
        assert states[0] == states[1], states  # parameters, AdamW and OneCycleLR state
        runs[compression] = states[0]
    assert runs["bf16"]["model"] != runs["none"]["model"]  # the rounding happened


@pytest.mark.slow
def test_verify_shows_what_bf16_gradients_do() -> None:
    out = run_cli(
        "verify", "--example", "linear", "--steps", "4", "--grad-compression", "bf16", "--json"
    )
    assert out.returncode == 0, out.stdout + out.stderr
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["passed"] is True
    assert max(report["max_abs_diff"]) > 0.0  # not bit-identical: the rounding shows
    (note,) = [n for n in report["notes"] if "bf16" in n]
    assert "grad_compression" in note and "largest parameter difference" in note

"""What only a GPU can show: nccl, set_device, pinned-memory copies, bf16 and fp16.

Every test is marked `gpu` and skipped where CUDA is not available; `bench/gpu_check.sh`
runs them (`pytest -m gpu`) on a machine with one NVIDIA GPU. They use one rank
(`launch(nprocs=1)` runs in this process), so one GPU is enough.
"""

from __future__ import annotations

from typing import Any, Literal

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit
from ddpkit.callbacks import Callback
from ddpkit.launcher import resolve_backend
from ddpkit.trainer import Trainer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (CUDA)"),
]


def _where(ctx: ddpkit.DistContext) -> dict[str, Any]:
    t = torch.full((1,), float(ctx.rank + 1), device=ctx.device)
    dist.all_reduce(t)  # nccl reduces GPU tensors only
    model = ddpkit.prepare_model(nn.Linear(4, 2), ctx)
    return {
        "backend": ctx.backend,
        "dist_backend": str(dist.get_backend()),
        "device": str(ctx.device),
        "current_device": torch.cuda.current_device(),  # what set_device chose
        "sum": t.item(),
        "param_devices": sorted({str(p.device) for p in model.parameters()}),
    }


def test_nccl_with_one_rank_sets_the_device_and_runs_a_collective() -> None:
    assert resolve_backend("auto") == "nccl"  # a GPU is visible: nccl by default
    out = ddpkit.launch(_where, nprocs=1, backend="nccl")
    assert out == {
        "backend": "nccl",
        "dist_backend": "nccl",
        "device": "cuda:0",
        "current_device": 0,
        "sum": 1.0,
        "param_devices": ["cuda:0"],
    }
    assert not dist.is_initialized()  # torn down again


def test_loader_pins_memory_on_gpu_and_non_blocking_copies_are_exact() -> None:
    ctx = ddpkit.DistContext.single("cuda:0")
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 8, generator=g), torch.randint(0, 3, (64,), generator=g))
    loader = ddpkit.prepare_loader(data, ctx, batch_size=16)
    assert loader.pin_memory
    for x, y in loader:
        assert x.is_pinned() and y.is_pinned()
        xg, yg = x.to(ctx.device, non_blocking=True), y.to(ctx.device, non_blocking=True)
        torch.cuda.synchronize()
        assert xg.device == yg.device == ctx.device
        assert torch.equal(xg.cpu(), x) and torch.equal(yg.cpu(), y)


class _Losses(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_epoch_end(self, trainer: Trainer, epoch: int, metrics: dict[str, float]) -> None:
        self.losses.append(metrics["loss"])


def _train(ctx: ddpkit.DistContext, precision: Literal["fp16", "bf16"]) -> dict[str, Any]:
    ddpkit.seed_everything(0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(512, 16, generator=g)
    data = TensorDataset(x, x[:, :4].sum(dim=1, keepdim=True))
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = _Losses()
    config = ddpkit.TrainConfig(epochs=6, batch_size=32, precision=precision, progress=False)
    trainer = Trainer(
        model,
        opt,
        data,
        ctx,
        config,
        loss_fn=nn.functional.mse_loss,
        callbacks=[losses],
        log_fn=lambda s: None,
    )
    trainer.fit()
    return {
        "losses": losses.losses,
        "device": str(next(trainer.model.parameters()).device),
        "scale": trainer.scaler.get_scale() if trainer.scaler else None,
    }


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_trains_on_the_gpu(precision: Literal["fp16", "bf16"]) -> None:
    if precision == "bf16" and not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bf16")
    out = ddpkit.launch(_train, precision, nprocs=1, backend="nccl")
    losses = out["losses"]
    assert out["device"] == "cuda:0"
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < 0.5 * losses[0], losses  # it learns
    if precision == "fp16":  # a GradScaler took part, and its scale stayed usable
        assert out["scale"] is not None and 0 < out["scale"] < float("inf")
    else:
        assert out["scale"] is None

"""What a GPU run needs, checked on CPU: the determinism and TF32 switches, one
autocast context per run, evaluation through the compiled model, and torch's
SyncBatchNorm for CUDA models."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.data import TensorDataset

from ddpkit import DistContext
from ddpkit.config import TrainConfig
from ddpkit.seed import seed_everything
from ddpkit.syncbn import SyncBatchNorm, convert_sync_batchnorm
from ddpkit.trainer import Trainer


def _data(n: int = 24, dtype: torch.dtype = torch.float32) -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, 4, generator=g, dtype=dtype)
    return TensorDataset(x, x.sum(dim=1, keepdim=True))


def _trainer(config: TrainConfig, **kwargs: Any) -> Trainer:
    seed_everything(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    return Trainer(
        model,
        opt,
        _data(),
        DistContext(),
        config,
        loss_fn=nn.functional.mse_loss,
        log_fn=lambda s: None,
        **kwargs,
    )


# -- deterministic and tf32 -----------------------------------------------------------


@pytest.fixture
def torch_flags() -> Iterator[None]:
    """Restores the process-wide switches a Trainer may set."""
    saved = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
        torch.get_float32_matmul_precision(),
        os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
    )
    yield
    torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved[2], saved[3]
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved[4], saved[5]
    torch.set_float32_matmul_precision(saved[6])
    if saved[7] is None:
        os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    else:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = saved[7]


def test_deterministic_sets_torch_cudnn_and_cublas_switches(
    torch_flags: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    torch.use_deterministic_algorithms(False)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = False, True
    _trainer(TrainConfig(epochs=1))
    assert not torch.are_deterministic_algorithms_enabled()  # the default leaves them
    assert torch.backends.cudnn.benchmark
    _trainer(TrainConfig(epochs=1, deterministic=True))
    assert torch.are_deterministic_algorithms_enabled()
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"


def test_deterministic_keeps_a_cublas_workspace_the_user_chose(
    torch_flags: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    _trainer(TrainConfig(epochs=1, deterministic=True))
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"


@pytest.mark.parametrize("tf32", [True, False])
def test_tf32_sets_both_switches_and_none_leaves_them(torch_flags: None, tf32: bool) -> None:
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = not tf32
    _trainer(TrainConfig(epochs=1))  # None: torch's settings stay as they are
    assert torch.backends.cuda.matmul.allow_tf32 is (not tf32)
    _trainer(TrainConfig(epochs=1, tf32=tf32))
    assert torch.backends.cuda.matmul.allow_tf32 is tf32
    assert torch.backends.cudnn.allow_tf32 is tf32


def test_deterministic_and_tf32_are_flags_with_their_defaults() -> None:
    import argparse

    from ddpkit.cli.flags import add_config_flags

    parser = argparse.ArgumentParser()
    add_config_flags(parser)
    args = parser.parse_args(["--deterministic", "--no-tf32"])
    assert args.deterministic is True and args.tf32 is False
    assert TrainConfig().tf32 is None and TrainConfig().deterministic is False


# -- autocast: one context per run ----------------------------------------------------


def test_autocast_is_built_once_not_every_step(monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[str] = []
    real = torch.autocast

    class Counting(real):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            built.append(str(args[0]))
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(torch, "autocast", Counting)
    trainer = _trainer(TrainConfig(epochs=2, batch_size=4, precision="bf16"), eval_set=_data(8))
    fit = trainer.fit()
    assert fit.global_step == 12  # 24 samples / 4, twice, plus two evaluations
    assert len(built) == 1, f"{len(built)} autocast contexts for {fit.global_step} steps"
    assert not torch.is_autocast_enabled("cpu")  # each step's exit restored it


# -- evaluate with compile=True -------------------------------------------------------


def test_evaluate_runs_the_compiled_model(monkeypatch: pytest.MonkeyPatch) -> None:
    graphs: list[bool] = []  # whether each graph compiled was traced in training mode
    real_compile = torch.compile

    def eager_backend(gm: torch.fx.GraphModule, inputs: Any) -> Callable[..., Any]:
        graphs.append(gm.training)
        return gm.forward

    def compile_(model: Any, **kwargs: Any) -> Any:
        return real_compile(model, backend=eager_backend)  # traced by dynamo, run eagerly

    monkeypatch.setattr(torch, "compile", compile_)
    torch._dynamo.reset()
    eval_set = _data(8)
    compiled = _trainer(TrainConfig(epochs=1, compile=True), eval_set=eval_set)
    plain = _trainer(TrainConfig(epochs=1), eval_set=eval_set)
    got = compiled.evaluate()
    assert graphs, "evaluate() ran the uncompiled model"
    assert got == plain.evaluate()
    torch._dynamo.reset()


# -- convert_sync_batchnorm picks the layer for the model's device --------------------


def _bn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2))


def test_a_cpu_model_gets_ddpkits_syncbatchnorm() -> None:
    converted, count = convert_sync_batchnorm(_bn())
    assert count == 1 and type(converted[1]) is SyncBatchNorm


def test_a_cuda_device_gets_torchs_syncbatchnorm() -> None:
    converted, count = convert_sync_batchnorm(_bn(), torch.device("cuda"))
    assert count == 1 and type(converted[1]) is nn.SyncBatchNorm
    converted, _ = convert_sync_batchnorm(_bn(), "cuda:1")
    assert type(converted[1]) is nn.SyncBatchNorm
    converted, _ = convert_sync_batchnorm(_bn(), "cpu")
    assert type(converted[1]) is SyncBatchNorm


def test_a_model_with_cuda_parameters_gets_torchs_syncbatchnorm() -> None:
    # A fake tensor says "cuda:0" as a real one would, with no GPU behind it.
    with FakeTensorMode():
        model = nn.Sequential(nn.Flatten(0, 0), nn.BatchNorm2d(2, device="cuda"))
    assert next(model.parameters()).device.type == "cuda"
    converted, count = convert_sync_batchnorm(model)
    assert count == 1 and type(converted[1]) is nn.SyncBatchNorm
    with torch.device("meta"):  # neither CPU nor CUDA: ddpkit's layer, which runs anywhere
        meta = _bn()
    assert type(convert_sync_batchnorm(meta)[0][1]) is SyncBatchNorm

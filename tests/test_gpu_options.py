"""What a GPU run needs, checked on CPU: determinism and TF32 switches, one autocast
context per run, evaluation through the compiled model, torch's SyncBatchNorm for CUDA
models, and uneven shards that agree on each step without a blocking collective."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.data import Sampler, TensorDataset

from ddpkit import DistContext, launch
from ddpkit.checkpoint.digest import model_digest
from ddpkit.errors import WorkerError
from ddpkit.parallel.syncbn import SyncBatchNorm, convert_sync_batchnorm
from ddpkit.seed import seed_everything
from ddpkit.training.config import TrainConfig
from ddpkit.training.trainer import Trainer
from tests.test_trainer_features import _Unequal  # rank 0: 10 samples, rank 1: 25


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


def _second(model: nn.Module) -> nn.Module:
    return list(model.children())[1]


def test_a_cpu_model_gets_ddpkits_syncbatchnorm() -> None:
    converted, count = convert_sync_batchnorm(_bn())
    assert count == 1 and type(_second(converted)) is SyncBatchNorm


def test_a_cuda_device_gets_torchs_syncbatchnorm() -> None:
    converted, count = convert_sync_batchnorm(_bn(), torch.device("cuda"))
    assert count == 1 and type(_second(converted)) is nn.SyncBatchNorm
    converted, _ = convert_sync_batchnorm(_bn(), "cuda:1")
    assert type(_second(converted)) is nn.SyncBatchNorm
    converted, _ = convert_sync_batchnorm(_bn(), "cpu")
    assert type(_second(converted)) is SyncBatchNorm


def test_a_model_with_cuda_parameters_gets_torchs_syncbatchnorm() -> None:
    # A fake tensor says "cuda:0" as a real one would, with no GPU behind it.
    with FakeTensorMode():
        model = nn.Sequential(nn.Flatten(0, 0), nn.BatchNorm2d(2, device="cuda"))
    assert next(model.parameters()).device.type == "cuda"
    converted, count = convert_sync_batchnorm(model)
    assert count == 1 and type(_second(converted)) is nn.SyncBatchNorm
    with torch.device("meta"):  # neither CPU nor CUDA: ddpkit's layer, which runs anywhere
        meta = _bn()
    assert type(_second(convert_sync_batchnorm(meta)[0])) is SyncBatchNorm


# -- uneven shards: the ranks agree without a blocking collective per step ------------


class _Indices(Sampler[int]):
    def __init__(self, indices: list[int]) -> None:
        self.indices = indices

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


def _fit_stranded(ctx: DistContext) -> None:
    model = nn.Linear(4, 1)
    Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.05),
        _data(),
        ctx,
        TrainConfig(epochs=1, batch_size=4),
        loss_fn=nn.functional.mse_loss,
        train_sampler=_Indices(list(range(8)) if ctx.rank == 0 else []),
        log_fn=lambda s: None,
    ).fit()


def test_a_rank_without_any_batch_stops_every_rank_with_the_fix() -> None:
    # Rank 0 reads the agreement only at its first backward; it must stop there too.
    with pytest.raises(WorkerError, match="must hold at least one batch"):
        launch(_fit_stranded, nprocs=2, hang_timeout=60)


def _fit_uneven(ctx: DistContext, accumulate: int) -> dict[str, Any]:
    calls = {"blocking": 0, "async": 0}
    real = dist.all_reduce

    def counting(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        calls["async" if kwargs.get("async_op") else "blocking"] += 1
        return real(tensor, *args, **kwargs)

    dist.all_reduce = counting  # type: ignore[assignment, unused-ignore]  # this worker only
    try:
        seed_everything(0)
        model = nn.Linear(4, 1).double()
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        trainer = Trainer(
            model,
            opt,
            _data(35, torch.float64),
            ctx,
            TrainConfig(epochs=2, batch_size=4, accumulate=accumulate, sync_batchnorm=False),
            loss_fn=nn.functional.mse_loss,
            train_sampler=_Unequal(ctx.rank),
            log_fn=lambda s: None,
        )
        fit = trainer.fit()
    finally:
        dist.all_reduce = real
    digests: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(digests, model_digest(trainer.model))
    params = [p.detach().clone() for p in trainer.model.parameters()]
    return {"calls": calls, "steps": fit.global_step, "digests": digests, "params": params}


def _reference(accumulate: int) -> list[torch.Tensor]:
    """The same training in one process: each step's mean loss over the samples that
    both ranks' batches of that step hold."""
    seed_everything(0)
    model = nn.Linear(4, 1).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    data = _data(35, torch.float64)
    shards = [list(range(10)), list(range(10, 35))]
    batches = [[s[i : i + 4] for i in range(0, len(s), 4)] for s in shards]
    longest = max(len(b) for b in batches)
    for _ in range(2):
        for first in range(0, longest, accumulate):
            idx = [i for b in batches for part in b[first : first + accumulate] for i in part]
            x, y = data[idx]
            nn.functional.mse_loss(model(x), y).backward()  # type: ignore[no-untyped-call]
            opt.step()
            opt.zero_grad()
    return [p.detach() for p in model.parameters()]


@pytest.mark.parametrize("accumulate", [1, 2])
def test_uneven_shards_agree_without_a_blocking_collective_per_step(accumulate: int) -> None:
    out = launch(_fit_uneven, accumulate, nprocs=2, hang_timeout=120)
    steps_per_epoch = -(-7 // accumulate)
    assert out["steps"] == 2 * steps_per_epoch
    # Blocking: only the epoch's one reduction for its log line, not one per step.
    assert out["calls"]["blocking"] == 2, out["calls"]
    # The agreement (each step, and once more to find the epoch's end) is asynchronous.
    assert out["calls"]["async"] == 2 * (steps_per_epoch + 1)
    assert out["digests"][0] == out["digests"][1]  # every rank the same model
    for got, want in zip(out["params"], _reference(accumulate), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)

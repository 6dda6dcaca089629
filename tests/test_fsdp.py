"""Strategy "fsdp" (FSDP2, `fully_shard`) on 2 gloo ranks: training, sharded checkpoints
with exact resume and resharding, verify, clipping, bf16, export."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

import ddpkit
from ddpkit import DistContext, TrainConfig, launch
from ddpkit.checkpoint.digest import model_digest
from ddpkit.errors import ConfigError, WorkerError
from ddpkit.examples.digits import model as digits_model
from ddpkit.parallel.fsdp import cpu_supported, shard_model
from tests.conftest import run_cli

pytestmark = pytest.mark.skipif(
    not cpu_supported(), reason="FSDP2 on CPU ranks needs torch >= 2.7 (see the test below)"
)
DIGITS = ("train", "--example", "digits", "--strategy", "fsdp", "--nproc", "2", "--json")


def _result(proc: Any) -> dict[str, Any]:
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(32, 32), nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.b(torch.relu(self.a(x)))
        return out


def _sharded_blocks(ctx: DistContext, how: str) -> list[str]:
    net = nn.Sequential(_Block(), _Block(), nn.Linear(32, 1))
    if how == "size":
        shard_model(net, ctx, min_params=2000)  # a Linear(32, 32) holds 1056
    elif how == "class":
        shard_model(net, ctx, blocks=[_Block])
    elif how == "names":
        shard_model(net, ctx, blocks=["1", "0.a"])
    else:
        shard_model(net, ctx, blocks=lambda m: isinstance(m, nn.Linear) and m.out_features == 1)
    return [name or "root" for name, m in net.named_modules() if isinstance(m, FSDPModule)]


@pytest.mark.parametrize(
    ("how", "blocks"),
    [
        ("size", ["root", "0", "1"]),
        ("class", ["root", "0", "1"]),
        ("names", ["root", "0.a", "1"]),
        ("predicate", ["root", "2"]),
    ],
)
def test_blocks_are_chosen_by_size_class_or_function(how: str, blocks: list[str]) -> None:
    assert launch(_sharded_blocks, how, nprocs=2) == blocks


def _with_an_optimizer_instance(ctx: DistContext) -> None:
    net = nn.Linear(4, 1)
    data = torch.utils.data.TensorDataset(torch.randn(8, 4), torch.randn(8, 1))
    ddpkit.Trainer(net, torch.optim.SGD(net.parameters()), data, ctx, TrainConfig(strategy="fsdp"))


def test_an_optimizer_built_before_sharding_is_refused_with_the_fix() -> None:
    with pytest.raises(WorkerError, match=r"optimizer=lambda params"):
        launch(_with_an_optimizer_instance, nprocs=2)
    with pytest.raises(ConfigError, match="no module named decoder"):
        shard_model(nn.Linear(2, 2), DistContext.single("cpu"), blocks=["decoder"])
    with pytest.raises(ConfigError, match="strategy must be 'ddp' or 'fsdp'"):
        ddpkit.prepare_model(nn.Linear(2, 2), DistContext.single("cpu"), strategy="zero3")


@pytest.mark.slow
def test_digits_trains_sharded_and_resumes_bit_for_bit(tmp_path: Path) -> None:
    straight = _result(run_cli(*DIGITS, "--epochs", "3", "--checkpoint-dir", str(tmp_path / "a")))
    assert straight["test_accuracy"] >= 0.95
    first = ("--epochs", "2", "--checkpoint-dir", str(tmp_path / "b"), "--keep-last", "1")
    _result(run_cli(*DIGITS, *first))
    assert [p.name for p in (tmp_path / "b").iterdir() if p.name != "ddpkit.lock"] == [
        "ckpt-000000046.dcp"  # the older one was pruned; no temporary folder is left
    ]
    newest = tmp_path / "b" / "ckpt-000000046.dcp"
    assert sorted(p.name for p in newest.iterdir()) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
        "meta.pt",
    ]
    resumed = _result(
        run_cli(*DIGITS, "--epochs", "3", "--checkpoint-dir", str(tmp_path / "b"), "--resume")
    )
    assert resumed["model_digest"] == straight["model_digest"]


@pytest.mark.slow
def test_a_sharded_checkpoint_resumes_on_one_process_and_back_on_two(tmp_path: Path) -> None:
    folder = str(tmp_path)
    two = _result(run_cli(*DIGITS, "--epochs", "2", "--checkpoint-dir", folder))
    one = ("train", "--example", "digits", "--strategy", "fsdp", "--nproc", "1", "--json")
    # 2 -> 1: the run is complete, so it only loads; the digest is of the loaded model.
    loaded = _result(run_cli(*one, "--epochs", "2", "--checkpoint-dir", folder, "--resume"))
    assert loaded["model_digest"] == two["model_digest"]
    further = _result(run_cli(*one, "--epochs", "3", "--checkpoint-dir", folder, "--resume"))
    again = _result(run_cli(*DIGITS, "--epochs", "4", "--checkpoint-dir", folder, "--resume"))
    assert further["global_step"] == 46 + 45 and again["global_step"] == 46 + 45 + 23  # 1 -> 2
    assert again["test_accuracy"] >= 0.95

    exported = tmp_path / "model.pt"
    out = run_cli("export", folder, str(exported))
    assert out.returncode == 0, out.stderr
    net = digits_model()
    net.load_state_dict(torch.load(exported, weights_only=True))  # the whole model


@pytest.mark.slow
def test_bf16_trains_sharded() -> None:
    out = _result(run_cli(*DIGITS, "--epochs", "2", "--precision", "bf16"))
    assert out["test_accuracy"] >= 0.9


def test_cpu_offload_on_cpu_ranks_is_one_line() -> None:
    out = run_cli(*DIGITS, "--fsdp-offload")
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert "drop --fsdp-offload" in out.stderr


@pytest.mark.slow
def test_verify_passes_sharded_with_clipping_and_accumulation_and_resumes_exactly() -> None:
    config = TrainConfig(strategy="fsdp", clip_grad_norm=0.05, accumulate=2)
    report = ddpkit.verify("digits", config, steps=4)
    assert report.passed, report
    assert ddpkit.verify("digits", TrainConfig(strategy="fsdp"), steps=4, resume=True).passed


def _fit_uneven_stream(ctx: DistContext, strategy: str = "fsdp") -> list[Any]:
    from tests.test_trainer_features import _mlp, _Stream

    ddpkit.seed_everything(0)
    trainer = ddpkit.Trainer(
        _mlp(),
        lambda params: torch.optim.SGD(params, lr=0.05),
        _Stream(ctx.rank),  # rank 0 has 10 samples, rank 1 has 22
        ctx,
        TrainConfig(epochs=2, batch_size=4, strategy=strategy, progress=False),  # type: ignore[arg-type]
        loss_fn=nn.functional.mse_loss,
        log_fn=lambda s: None,
    )
    trainer.fit()
    params = [ddpkit.parallel.fsdp.gathered(p).detach().clone() for p in trainer.model.parameters()]
    ranks: list[Any] = [None] * ctx.world_size
    torch.distributed.all_gather_object(ranks, (trainer.global_step, params))
    return ranks


def test_uneven_shards_train_sharded_without_join() -> None:
    ranks = launch(_fit_uneven_stream, nprocs=2, hang_timeout=60)
    steps, params = ranks[0]
    assert ranks[1][0] == steps  # every rank: the same steps and the same model
    assert all(torch.equal(a, b) for a, b in zip(params, ranks[1][1], strict=True))
    assert steps == 2 * 6  # the longer shard's 6 batches, every rank stepping together
    # The same job unsharded: the same training, up to the rounding of another reduction.
    ddp_steps, ddp_params = launch(_fit_uneven_stream, "ddp", nprocs=2, hang_timeout=60)[0]
    assert ddp_steps == steps
    for a, b in zip(params, ddp_params, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _fsdp_job(ctx: DistContext, opts: dict[str, Any]) -> list[Any]:
    """A sharded Trainer on uneven or logged work; every rank's (step, digest, eval)."""
    from tests.test_trainer_features import _data, _mlp, _Stream

    ddpkit.seed_everything(0)
    config = TrainConfig(
        epochs=2, batch_size=4, strategy="fsdp", progress=False, **opts.get("config", {})
    )
    trainer = ddpkit.Trainer(
        _mlp(),
        lambda params: torch.optim.AdamW(params, lr=0.01),
        _Stream(ctx.rank) if opts.get("stream") else _data(24),
        ctx,
        config,
        loss_fn=nn.functional.mse_loss,
        eval_set=_data(9) if opts.get("eval") else None,
        log_fn=lambda s: None,
    )
    fit = trainer.fit()
    mine = (trainer.global_step, model_digest(trainer.model), fit.eval)
    ranks: list[Any] = [None] * ctx.world_size
    torch.distributed.all_gather_object(ranks, mine)
    return ranks


def test_a_run_log_without_clipping_logs_the_sharded_grad_norm(tmp_path: Path) -> None:
    # The grad norm of the step log is a collective under FSDP: rank 0 alone hung in it.
    config = {"run_dir": str(tmp_path), "log_every": 2}
    ranks = launch(_fsdp_job, {"config": config}, nprocs=2, timeout=60, hang_timeout=30)
    assert ranks[0][:2] == ranks[1][:2]
    steps = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    norms = [x["grad_norm"] for x in steps if x["kind"] == "step"]
    assert len(norms) == 3 and all(n > 0 for n in norms)  # steps 2, 4, 6 of 6


def test_uneven_eval_batches_evaluate_sharded() -> None:
    # 9 eval samples, batch 4: rank 0 runs 2 eval batches, rank 1 one; every FSDP
    # forward gathers, so the ranks must run as many forwards as each other.
    ranks = launch(_fsdp_job, {"eval": True}, nprocs=2, timeout=60, hang_timeout=30)
    assert ranks[0] == ranks[1]
    assert ranks[0][2]["eval_samples"] == 9


def test_uneven_shards_with_accumulation_train_sharded() -> None:
    # Rank 0's stream has 3 batches, rank 1's 6: with accumulate 2, rank 0's last group
    # is short, so it ran fewer forwards (and gathers) than rank 1.
    config = {"accumulate": 2}
    ranks = launch(
        _fsdp_job, {"stream": True, "config": config}, nprocs=2, timeout=60, hang_timeout=30
    )
    assert ranks[0] == ranks[1]
    assert ranks[0][0] == 2 * 3  # rank 1's 6 batches in groups of 2, each epoch


def _evaluate_with_metrics(
    ctx: DistContext, strategy: Literal["ddp", "fsdp"], samples: int = 9, cap: int | None = None
) -> list[Any]:
    """The initial model's evaluation (9 samples, batches of 4: rank 0 has 2 batches,
    rank 1 one; at most `cap` batches a rank) with a metrics_fn that runs the model
    again; every rank's metrics."""
    from tests.test_trainer_features import _data, _mlp

    ddpkit.seed_everything(0)

    def metrics(model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        x, y = batch
        return {"mae": (model(x) - y).abs().mean(), "big": (model(2 * x) - y).abs().mean()}

    trainer = ddpkit.Trainer(
        _mlp(),
        lambda params: torch.optim.AdamW(params, lr=0.01),
        _data(24),
        ctx,
        TrainConfig(batch_size=4, strategy=strategy, progress=False, eval_max_batches=cap),
        loss_fn=nn.functional.mse_loss,
        eval_set=_data(samples),
        metrics_fn=metrics,
        log_fn=lambda s: None,
    )
    mine = trainer.evaluate()
    if not ctx.distributed:
        return [mine]
    ranks: list[Any] = [None] * ctx.world_size
    torch.distributed.all_gather_object(ranks, mine)
    return ranks


def test_uneven_eval_batches_with_a_metrics_fn_that_runs_the_model_evaluate_sharded() -> None:
    # The rank with fewer batches stood in with the loss's forward alone, while rank 0
    # ran a metrics_fn's forwards too: the ranks' gathers did not pair up, and it hung.
    ranks = launch(_evaluate_with_metrics, "fsdp", nprocs=2, timeout=60, hang_timeout=20)
    assert ranks[0] == ranks[1]
    (alone,) = launch(_evaluate_with_metrics, "ddp", nprocs=1)
    assert ranks[0]["eval_samples"] == alone["eval_samples"] == 9  # each sample once
    assert ranks[0].keys() == alone.keys()
    for name, value in alone.items():
        assert ranks[0][name] == pytest.approx(value, rel=1e-5), name


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_eval_max_batches_caps_each_ranks_batches(strategy: Literal["ddp", "fsdp"]) -> None:
    # nanoGPT's eval_iters: 2 batches of 4 a rank out of 5, on every rank alike; under
    # FSDP the shards of 9 (2 batches and 1) evaluate one batch each without a hang.
    ranks = launch(_evaluate_with_metrics, strategy, 40, 2, nprocs=2, timeout=60, hang_timeout=20)
    assert ranks[0] == ranks[1]
    assert ranks[0]["eval_samples"] == 16
    uneven = launch(_evaluate_with_metrics, strategy, 9, 1, nprocs=2, timeout=60, hang_timeout=20)
    assert uneven[0]["eval_samples"] == 8

"""Batches that are not `(inputs, targets)`, models that return their own loss, a
`training_step`, a `metrics_fn`, `build(ctx, config)`, and `prepare_loader` given a
one-GPU script's DataLoader: on one process, on 2 gloo ranks, and through `ddpkit train`."""

from __future__ import annotations

import json
from collections import OrderedDict, namedtuple
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset, WeightedRandomSampler

import ddpkit
from ddpkit import DistContext, TrainConfig, launch
from ddpkit.errors import ConfigError
from ddpkit.parallel.batches import count_samples, default_step, to_device
from ddpkit.parallel.ranks import all_gather_object
from ddpkit.training.job import build_job
from ddpkit.training.jobspec import build_arity
from tests import shaped_jobs
from tests.conftest import ROOT, run_cli

JOBS = ROOT / "tests" / "shaped_jobs.py"

Point = namedtuple("Point", ["x", "y"])


@dataclass
class Sample:
    image: torch.Tensor
    label: torch.Tensor
    name: str


def test_any_nesting_moves_to_the_device_keeping_its_types() -> None:
    meta = torch.device("meta")
    batch = {
        "a": (torch.zeros(3, 2), [torch.ones(3)]),
        "p": Point(torch.zeros(3), 7),
        "s": Sample(torch.zeros(3, 1), torch.zeros(3), "x"),
        "o": OrderedDict(t=torch.zeros(3)),
        "text": "kept",
    }
    moved = to_device(batch, meta)
    assert moved["a"][0].device == meta and moved["a"][1][0].device == meta
    assert isinstance(moved["p"], Point) and moved["p"].x.device == meta and moved["p"].y == 7
    assert isinstance(moved["s"], Sample) and moved["s"].label.device == meta
    assert moved["s"].name == "x" and moved["text"] == "kept"
    assert isinstance(moved["o"], OrderedDict) and moved["o"]["t"].device == meta
    assert count_samples(batch) == 3
    assert count_samples((torch.zeros(5, 2), torch.zeros(5))) == 5
    with pytest.raises(ConfigError, match="cannot tell how many samples"):
        count_samples({"name": "no tensor"})


def test_a_model_without_a_loss_gets_a_message_naming_the_fixes() -> None:
    with pytest.raises(ConfigError, match="holds no loss") as info:
        default_step(nn.Linear(2, 2), {"input": torch.zeros(1, 2)}, None)
    assert "training_step" in str(info.value) and "model(**batch)" in str(info.value)


def test_build_arity_passes_the_config_only_when_asked() -> None:
    def one(ctx: Any) -> None: ...
    def two(ctx: Any, config: Any) -> None: ...
    def optional(ctx: Any, config: Any = None) -> None: ...
    def width(ctx: Any, width: int = 64) -> None: ...
    def none() -> None: ...

    assert [build_arity(f) for f in (one, two, optional, width, none)] == [2 - 1, 2, 2, 1, 0]


@pytest.mark.parametrize(
    ("samples", "world", "batch", "accumulate", "drop_last"),
    [(200, 2, 8, 1, False), (97, 2, 8, 3, False), (97, 3, 8, 2, True), (10, 1, 4, 1, True)],
)
def test_steps_per_epoch_matches_what_the_trainer_does(
    samples: int, world: int, batch: int, accumulate: int, drop_last: bool
) -> None:
    config = TrainConfig(epochs=1, batch_size=batch, accumulate=accumulate, drop_last=drop_last)
    ctx = DistContext.single("cpu")
    loader = ddpkit.prepare_loader(
        TensorDataset(torch.zeros(samples)), ctx, batch, drop_last=drop_last
    )
    # One rank's share as DistributedSampler cuts it for `world` ranks.
    per_rank = len(
        torch.utils.data.DistributedSampler(
            TensorDataset(torch.zeros(samples)), num_replicas=world, rank=0, drop_last=drop_last
        )
    )
    batches = per_rank // batch if drop_last else -(-per_rank // batch)
    assert config.steps_per_epoch(samples, world) == -(-batches // accumulate)
    if world == 1:
        assert config.steps_per_epoch(samples) == -(-len(loader) // accumulate)


def _compare_every_rank(folder: Path, world: int) -> dict[str, Any]:
    states = [json.loads((folder / f"rank{r}.json").read_text()) for r in range(world)]
    assert all(s == states[0] for s in states), states
    return states[0]  # type: ignore[no-any-return]


@pytest.mark.slow
def test_a_dict_batch_job_with_its_own_loss_trains_through_the_cli(tmp_path: Path) -> None:
    out = run_cli(
        "train", "--job", f"{JOBS}:build_dict", "--nproc", "2", "--json",
        env={"SHAPED_JOBS_OUT": str(tmp_path)},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    state = _compare_every_rank(tmp_path, 2)
    # OneCycleLR, sized by build(ctx, config), was stepped exactly to its end.
    assert state["global_step"] == 3 * TrainConfig(batch_size=8).steps_per_epoch(200, 2)
    assert result["test_accuracy"] is None and result["final_loss"] < 0.6


@pytest.mark.slow
def test_a_training_step_job_with_metrics_trains_through_the_cli(tmp_path: Path) -> None:
    out = run_cli(
        "train", "--job", f"{JOBS}:build_step", "--nproc", "2", "--epochs", "4",
        "--num-workers", "0", env={"SHAPED_JOBS_OUT": str(tmp_path)},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "eval_mae" in out.stdout, out.stdout
    _compare_every_rank(tmp_path, 2)


def _evaluate_step_job(ctx: DistContext) -> list[dict[str, float]]:
    config = TrainConfig(epochs=1, batch_size=7, progress=False)
    trainer = build_job(ctx, shaped_jobs.build_step, config).trainer(ctx, config)
    return all_gather_object(trainer.evaluate())


def test_eval_metrics_count_each_sample_once_on_one_process_and_two_ranks() -> None:
    (one,) = launch(_evaluate_step_job, nprocs=1)
    both = launch(_evaluate_step_job, nprocs=2)
    assert set(one) == {"eval_loss", "eval_samples", "eval_mae"}
    assert both[0] == both[1]  # every rank reports the same numbers
    for key in one:
        assert both[0][key] == pytest.approx(one[key], rel=1e-6), key
    assert one["eval_samples"] == 30


def pad(items: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {"x": torch.stack([x for x, _ in items]), "i": torch.stack([i for _, i in items])}


def init(worker: int) -> None: ...


def _rebuilt(ctx: DistContext) -> dict[str, Any]:
    data = TensorDataset(torch.randn(50, 3), torch.arange(50))
    plain = DataLoader(
        data, batch_size=4, shuffle=True, num_workers=2, collate_fn=pad, drop_last=True,
        persistent_workers=True, prefetch_factor=3, worker_init_fn=init,
    )  # fmt: skip
    loader = ddpkit.prepare_loader(plain, ctx)
    kept = {
        "batch_size": loader.batch_size,
        "num_workers": loader.num_workers,
        "collate": loader.collate_fn is pad,
        "init": loader.worker_init_fn is init,
        "persistent": loader.persistent_workers,
        "prefetch": loader.prefetch_factor,
        "drop_last": loader.drop_last,
    }
    seen: list[list[int]] = []
    for epoch in range(2):
        loader.set_epoch(epoch)
        seen.append([int(i) for batch in loader for i in batch["i"]])
    everyone: list[Any] = [None] * ctx.world_size
    if ctx.distributed:
        dist.all_gather_object(everyone, seen)
    else:
        everyone = [seen]
    return {"kept": kept, "seen": everyone}


def test_prepare_loader_rebuilds_a_scripts_dataloader_keeping_its_options() -> None:
    for world in (1, 2):
        result = launch(_rebuilt, nprocs=world)
        assert result["kept"] == {
            "batch_size": 4, "num_workers": 2, "collate": True, "init": True,
            "persistent": True, "prefetch": 3, "drop_last": True,
        }, world  # fmt: skip
        epochs = list(zip(*result["seen"], strict=True))  # per epoch, each rank's indices
        for ranks in epochs:
            indices = [i for shard in ranks for i in shard]
            assert len(indices) == len(set(indices))  # disjoint shards
            assert all(len(shard) == 50 // world // 4 * 4 for shard in ranks)  # drop_last
        assert epochs[0] != epochs[1]  # shuffled, and reshuffled each epoch


def test_a_dataloader_ddpkit_cannot_shard_is_refused_with_the_fix() -> None:
    ctx = DistContext.single("cpu")
    data = TensorDataset(torch.zeros(8))
    weighted = DataLoader(data, batch_size=2, sampler=WeightedRandomSampler([1.0] * 8, 8))
    with pytest.raises(ConfigError, match="WeightedRandomSampler cannot be sharded"):
        ddpkit.prepare_loader(weighted, ctx)
    with pytest.raises(ConfigError, match="batch_sampler"):
        ddpkit.prepare_loader(DataLoader(data, batch_size=None), ctx)
    with pytest.raises(ConfigError, match="needs a batch_size"):
        ddpkit.prepare_loader(data, ctx)
    ordered = ddpkit.prepare_loader(DataLoader(data, batch_size=2), ctx)
    assert next(b[0].tolist() for b in ordered) == [0.0, 0.0]  # SequentialSampler: no shuffle


class _NestedTargets(Dataset[Any]):
    """13 samples `(x, (y, y_aux))`, or `(x, {"y": y, "aux": y_aux})` with `as_dict`:
    targets nested in a tuple or dict, as multi-task jobs have them."""

    def __init__(self, as_dict: bool, n: int = 13) -> None:
        g = torch.Generator().manual_seed(4)
        self.x, self.y = torch.randn(n, 3, generator=g), torch.randn(n, 1, generator=g)
        self.aux = torch.randn(n, generator=g)
        self.as_dict = as_dict

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> Any:
        y, aux = self.y[i], self.aux[i]
        return self.x[i], ({"y": y, "aux": aux} if self.as_dict else (y, aux))


def _two_headed_loss(outputs: torch.Tensor, targets: Any) -> torch.Tensor:
    y, aux = (targets["y"], targets["aux"]) if isinstance(targets, dict) else targets
    return nn.functional.mse_loss(outputs, y) + 0.5 * nn.functional.mse_loss(outputs[:, 0], aux)


def _nested_eval(ctx: DistContext, as_dict: bool) -> dict[str, float]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Dropout(0.3), nn.Linear(4, 1))
    data = _NestedTargets(as_dict)
    config = TrainConfig(epochs=1, batch_size=4, progress=False)
    trainer = ddpkit.Trainer(
        model, torch.optim.AdamW(model.parameters()), data, ctx, config,
        loss_fn=_two_headed_loss, eval_set=data,
    )  # fmt: skip
    return trainer.evaluate()


def test_nested_targets_count_their_samples_once() -> None:
    x, y, aux = torch.zeros(5, 2), torch.zeros(5, 1), torch.zeros(5)
    assert count_samples((x, (y, aux))) == 5  # not the 2 targets
    assert count_samples([x, [y, aux]]) == 5  # as default_collate returns it
    assert count_samples((x, {"y": y, "aux": aux})) == 5
    assert count_samples(({"ids": torch.zeros(3, 7)}, torch.zeros(3))) == 3
    assert count_samples((["some", "text"], torch.zeros(2))) == 2  # the first tensor


@pytest.mark.parametrize("as_dict", [False, True])
def test_eval_over_nested_targets_counts_each_sample_once_on_two_ranks(as_dict: bool) -> None:
    metrics = launch(_nested_eval, as_dict, nprocs=2)
    data = _NestedTargets(as_dict)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Dropout(0.3), nn.Linear(4, 1)).eval()
    with torch.no_grad():  # the mean over the samples, each once
        samples = [data[i] for i in range(len(data))]
        losses = [_two_headed_loss(model(x[None]), _batch_of_one(t)) for x, t in samples]
    assert metrics["eval_samples"] == 13
    assert metrics["eval_loss"] == pytest.approx(float(torch.stack(losses).mean()), rel=1e-5)


def _batch_of_one(targets: Any) -> Any:
    if isinstance(targets, dict):
        return {k: v[None] for k, v in targets.items()}
    return tuple(t[None] for t in targets)

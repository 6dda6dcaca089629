"""The public step plan (`ddpkit.parallel.steps`): a hand-written loop over shards of
unequal length steps with every rank and ends with bit-identical ranks, as the Trainer
does (which trains from the same plan). 2 real gloo ranks; every rank's parameters,
buffers, optimizer and scheduler state are compared, not rank 0's alone."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Sampler, TensorDataset

import ddpkit
from ddpkit.errors import ConfigError
from ddpkit.parallel.steps import StepPlan
from ddpkit.parallel.sync import no_backward_sync
from ddpkit.seed import rank_seed, seed_everything
from ddpkit.training.config import TrainConfig
from ddpkit.training.trainer import Trainer
from tests.matrix_jobs import differences, held_state

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


class _Unequal(Sampler[int]):
    """Shards 40 samples unequally and in an order of its own: rank 0 takes 11 (3
    batches of 4, the last short), rank 1 takes 29 (8 batches)."""

    def __init__(self, rank: int) -> None:
        self.indices = list(range(0, 22, 2)) if rank == 0 else [*range(1, 22, 2), *range(22, 40)]
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        shuffle = torch.Generator().manual_seed(self.epoch)
        order = torch.randperm(len(self.indices), generator=shuffle)
        return (self.indices[i] for i in order.tolist())

    def __len__(self) -> int:
        return len(self.indices)


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(40, 6, generator=g)
    return TensorDataset(x, x.pow(2).sum(dim=1, keepdim=True))


def _model() -> nn.Module:
    seed_everything(0)  # the same initial weights on every rank
    return nn.Sequential(nn.Linear(6, 12), nn.Dropout(0.2), nn.ReLU(), nn.Linear(12, 1))


def _optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.05)


def _scheduler(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.7)


def _hand_loop(
    ctx: ddpkit.DistContext, folder: str | None = None, stop: int | None = None
) -> dict[str, Any]:
    """The job as a hand-written loop over the step plan; with `folder`, it saves after
    every step, resumes from the newest save, and returns after step `stop` (a crash)."""
    model = ddpkit.prepare_model(_model(), ctx)
    opt = _optimizer(model.parameters())
    sched = _scheduler(opt)
    loader = ddpkit.prepare_loader(_data(), ctx, 4, sampler=_Unequal(ctx.rank))
    plan = StepPlan(loader, model, accumulate=2)
    seed_everything(rank_seed(0, ctx.rank))  # each rank's own dropout, as the Trainer's
    steps = samples = first_epoch = 0
    if folder is not None:
        saved = ddpkit.load_state(
            folder, model=model, optimizer=opt, scheduler=sched, loader=loader
        )
        if saved is not None:  # the loader's next pass starts after the saved batches
            first_epoch, steps = saved["epoch"], saved["step"]
    for epoch in range(first_epoch, 2):
        loader.set_epoch(epoch)
        model.train()
        for micro in plan:
            x, y = micro.batch
            if micro.stand_in:
                model.eval()  # an earlier batch, weighted 0: only its collectives count
            with no_backward_sync(model, not micro.ends_step):
                loss = nn.functional.mse_loss(model(x), y)
                micro.weighted(loss).backward()  # type: ignore[no-untyped-call]
            if micro.stand_in:
                model.train()
            else:
                samples += len(x)
            if micro.ends_step:
                opt.step()
                opt.zero_grad(set_to_none=True)
                sched.step()
                steps += 1
                if folder is not None:
                    ddpkit.save_state(
                        folder,
                        model=model,
                        optimizer=opt,
                        scheduler=sched,
                        loader=loader,
                        epoch=epoch,
                        batch=micro.position,
                        step=steps,
                    )
                if steps == stop:
                    return {"steps": steps}
    return {"state": held_state(model, opt, sched), "steps": steps, "samples": samples}


def _trainer(ctx: ddpkit.DistContext) -> dict[str, Any]:
    config = TrainConfig(epochs=2, batch_size=4, accumulate=2, scheduler_interval="step")
    trainer = Trainer(
        _model(),
        _optimizer,
        _data(),
        ctx,
        config,
        loss_fn=nn.functional.mse_loss,
        scheduler=_scheduler,
        train_sampler=_Unequal(ctx.rank),
        log_fn=lambda s: None,
    )
    trainer.fit()
    state = held_state(trainer.model, trainer.optimizer, trainer.scheduler)
    return {"state": state, "steps": trainer.global_step}


def _both(ctx: ddpkit.DistContext) -> dict[str, Any]:
    """Every rank's hand-loop and Trainer states, compared on rank 0."""
    mine = {"hand": _hand_loop(ctx), "trainer": _trainer(ctx)}
    ranks: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(ranks, mine)
    hand = [r["hand"] for r in ranks]
    return {
        "ranks": [differences(hand[0]["state"], h["state"], rng=False) for h in hand[1:]],
        "trainer": [
            differences(h["state"], r["trainer"]["state"], rng=False)
            for h, r in zip(hand, ranks, strict=True)
        ],
        "steps": [h["steps"] for h in hand] + [r["trainer"]["steps"] for r in ranks],
        "samples": sum(h["samples"] for h in hand),
    }


def test_a_hand_loop_over_uneven_shards_ends_with_identical_ranks() -> None:
    out = ddpkit.launch(_both, nprocs=2, hang_timeout=60)
    # Every rank steps after rank 1's 8 batches in groups of 2, each epoch: 8 steps
    # (rank 0 stands in after its 3), and every sample of both shards is trained.
    assert out["steps"] == [8, 8, 8, 8]
    assert out["samples"] == 2 * 40
    assert out["ranks"] == [[]]  # parameters, buffers, AdamW and scheduler state
    assert out["trainer"] == [[], []]  # and bit for bit the Trainer's, on each rank


def test_a_plan_needs_ddpkits_loader() -> None:
    loader = torch.utils.data.DataLoader(_data(), batch_size=4)
    with pytest.raises(ConfigError, match="prepare_loader"):
        StepPlan(loader, nn.Linear(6, 1))  # type: ignore[arg-type]


def _resumed(ctx: ddpkit.DistContext, folder: str) -> list[str]:
    """A hand loop stopped after step 3 (rank 0's shard ran out at step 2: it stands
    in from then on) and resumed, against the straight loop, on every rank."""
    straight = _hand_loop(ctx)
    assert _hand_loop(ctx, folder, stop=3) == {"steps": 3}
    resumed = _hand_loop(ctx, folder)
    ranks: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(ranks, differences(straight["state"], resumed["state"]))
    return [f"rank {r}: {d}" for r, diffs in enumerate(ranks) for d in diffs]


def test_a_hand_loop_resumed_mid_epoch_over_uneven_shards_is_the_straight_one(
    tmp_path: Path,
) -> None:
    # Parameters, buffers, AdamW, the scheduler and each rank's random streams.
    assert ddpkit.launch(_resumed, str(tmp_path), nprocs=2, hang_timeout=60) == []


class _Stream(torch.utils.data.IterableDataset[tuple[torch.Tensor, torch.Tensor]]):
    """9 samples of unknown length."""

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        data = _data()
        return (data[i] for i in range(9))


def test_a_plan_over_a_stream_on_one_process_needs_no_process_group() -> None:
    ctx = ddpkit.DistContext.current()
    assert not ctx.distributed
    plan = StepPlan(ddpkit.prepare_loader(_Stream(), ctx, 2), nn.Linear(6, 1), accumulate=2)
    micro = list(plan)
    # Batches of 2, 2, 2, 2, 1 in groups of two, each micro-batch's share of its group.
    assert [m.ends_step for m in micro] == [False, True, False, True, True]
    assert [m.weight for m in micro] == [0.5, 0.5, 0.5, 0.5, 1.0]
    assert [m.step_samples for m in micro] == [4, 4, 4, 4, 1]
    assert not any(m.stand_in for m in micro)

"""save_state / load_state with a model sharded by strategy "fsdp" (FSDP2): every rank
writes its own shards into a `ckpt-<step>.dcp` folder, and a resumed hand-written loop
ends bit-identical to the uninterrupted one, on every rank, for the model and for the
optimizer's state. The same folder loads on one process (DCP reshards).

Each rank's own shards are compared too, not only the gathered whole. Real processes:
2 gloo ranks.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from ddpkit import (
    DistContext,
    launch,
    load_state,
    prepare_loader,
    prepare_model,
    reduce_mean,
    save_state,
)
from ddpkit.checkpoint.digest import model_digest, state_digest
from ddpkit.checkpoint.pt import list_checkpoints, load_checkpoint
from ddpkit.errors import CheckpointError, WorkerError
from ddpkit.parallel.fsdp import as_sharded, cpu_supported
from ddpkit.seed import rank_seed, seed_everything
from tests.test_state import BATCH, EPOCHS, SAVE_EVERY, _all_ranks, _Augmented, _net

pytestmark = pytest.mark.skipif(not cpu_supported(), reason="FSDP2 on CPU ranks needs torch >= 2.7")

CTX = DistContext()
# Linear(8, 32) (288 parameters) is a block of its own; the rest gathers with the root.
FSDP = {"min_params": 200}


def _local(value: Any) -> Any:
    """`value` with every shard replaced by this rank's own part of it (no collective)."""
    if isinstance(value, dict):
        return {k: _local(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_local(v) for v in value]
    to_local = getattr(value, "to_local", None)
    return to_local() if callable(to_local) else value


def _digests(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, str]:
    """The whole model and optimizer state (gathered: a collective), and this rank's
    own shards of them."""
    return {
        "model": model_digest(model),
        "optimizer": state_digest(opt.state_dict()),
        "model_shard": state_digest(_local(model.state_dict())),
        "optimizer_shard": state_digest(_local(opt.state_dict())),
    }


def _build(ctx: DistContext) -> tuple[nn.Module, torch.optim.Optimizer, Any, Any]:
    seed_everything(0)  # the same model on every rank
    model = prepare_model(_net(), ctx, strategy="fsdp", fsdp=FSDP)  # one process: bare
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=EPOCHS * 8)
    loader = prepare_loader(_Augmented(), ctx, BATCH, seed=7)
    seed_everything(rank_seed(0, ctx.rank))  # each rank its own stream
    return model, opt, sched, loader


def _loop(ctx: DistContext, folder: str, stop_at: int | None) -> list[Any]:
    """The loop of tests/test_state.py with the model sharded. With `stop_at`, it ends
    after that step, as a run killed there (two steps after the last save)."""
    model, opt, sched, loader = _build(ctx)
    parts: dict[str, Any] = {"model": model, "optimizer": opt, "scheduler": sched}
    start = load_state(folder, ctx, **parts, loader=loader)
    loaded = None if start is None else _digests(model, opt)
    resumed_at = None if start is None else (start["epoch"], start["batch"], start["step"])
    if start is None:
        start = {"epoch": 0, "batch": 0, "step": 0, "losses": []}
    step, losses = start["step"], list(start["losses"])
    saved: dict[int, Any] = {}
    for epoch in range(start["epoch"], EPOCHS):
        loader.set_epoch(epoch)
        first = start["batch"] if epoch == start["epoch"] else 0
        for batch, (x, y) in enumerate(loader, start=first + 1):
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()  # type: ignore[no-untyped-call]
            opt.step()
            sched.step()
            step += 1
            losses.append(reduce_mean(loss.detach(), ctx))
            if step % SAVE_EVERY == 0:
                path = save_state(
                    folder,
                    ctx,
                    **parts,
                    loader=loader,
                    epoch=epoch,
                    batch=batch,
                    step=step,
                    extra={"losses": losses},
                )
                saved[step] = {**_digests(model, opt), "path": path.name}
            if step == stop_at:
                break
        if step == stop_at:
            break
    return _all_ranks(
        ctx,
        {
            **_digests(model, opt),
            "scheduler": state_digest(sched.state_dict()),
            "losses": losses,
            "resumed_at": resumed_at,
            "loaded": loaded,
            "saved": saved,
            "sharded": as_sharded(model) is not None,
        },
    )


@pytest.fixture(scope="module")
def stopped(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Any]]:
    """A 2-rank sharded run that saved after steps 5 and 10 and ended after step 12."""
    folder = tmp_path_factory.mktemp("stopped") / "ckpt"
    return folder, launch(_loop, str(folder), 12, nprocs=2)


def test_a_sharded_hand_loop_resumes_bit_identical_on_every_rank(
    tmp_path: Path, stopped: tuple[Path, list[Any]]
) -> None:
    folder, before = stopped
    work = tmp_path / "ckpt"
    shutil.copytree(folder, work)  # the other tests read the stopped run's folder as it was
    straight = launch(_loop, str(tmp_path / "straight"), None, nprocs=2)
    resumed = launch(_loop, str(work), None, nprocs=2)

    assert [r["sharded"] for r in resumed] == [True, True]
    assert [r["resumed_at"] for r in resumed] == [(1, 2, 10)] * 2  # mid-epoch, every rank
    # What each rank loaded is what it saved: the whole and its own shards.
    assert [r["loaded"] for r in resumed] == [
        {k: v for k, v in r["saved"][10].items() if k != "path"} for r in before
    ]
    assert [r["saved"][10]["path"] for r in before] == ["ckpt-000000010.dcp"] * 2
    names = [p.name for p in list_checkpoints(folder)]
    assert names == ["ckpt-000000005.dcp", "ckpt-000000010.dcp"]
    meta = load_checkpoint(folder / names[-1], CTX)  # the rest of the state, beside the shards
    assert meta["sharded"] and "model" not in meta and "optimizer" not in meta
    assert meta["model_class"] == "torch.nn.Sequential"  # the class it was built as
    assert len(meta["rng"]) == 2 and meta["batch"] == 2
    assert straight[0]["model_shard"] != straight[1]["model_shard"]  # really two halves
    assert straight[0]["model"] == straight[1]["model"]
    for key in ("model", "optimizer", "model_shard", "optimizer_shard", "scheduler", "losses"):
        assert [r[key] for r in resumed] == [r[key] for r in straight], key
    assert len(straight[0]["losses"]) == EPOCHS * 8


# -- 2 ranks -> 1 process ---------------------------------------------------------------
def _one_process(ctx: DistContext, folder: str, named: str) -> dict[str, Any]:
    """Load the sharded state `named` on one process, then save it at a step before and
    one after it: load_state(folder) takes the newest."""
    model, opt, sched, loader = _build(ctx)
    parts: dict[str, Any] = {"model": model, "optimizer": opt, "scheduler": sched}
    start = load_state(named, ctx, **parts, loader=loader)
    assert start is not None
    out: dict[str, Any] = {"named": {**_digests(model, opt), "step": start["step"]}}
    for step in (7, 11):
        save_state(folder, ctx, **parts, loader=loader, epoch=1, batch=2, step=step)
        model, opt, sched, loader = _build(ctx)  # afresh, so the load has to restore it
        parts = {"model": model, "optimizer": opt, "scheduler": sched}
        again = load_state(folder, ctx, **parts, loader=loader)
        assert again is not None
        out[f"after {step}"] = {**_digests(model, opt), "path": again["path"].name}
    return out


def _save_whole(ctx: DistContext, folder: str) -> None:
    model = prepare_model(_net(), ctx)  # strategy ddp: one .pt file
    opt = torch.optim.AdamW(model.parameters())
    save_state(folder, ctx, model=model, optimizer=opt, epoch=1, step=12)


def test_a_sharded_state_loads_on_one_process_by_its_folder_name(
    tmp_path: Path, stopped: tuple[Path, list[Any]]
) -> None:
    folder, before = stopped
    work = tmp_path / "mixed"
    work.mkdir()
    named = shutil.copytree(folder / "ckpt-000000010.dcp", work / "ckpt-000000010.dcp")
    one = launch(_one_process, str(work), str(named), nprocs=1)
    saved = before[0]["saved"][10]
    assert one["named"]["step"] == 10
    assert (one["named"]["model"], one["named"]["optimizer"]) == (
        saved["model"],
        saved["optimizer"],
    )
    # Saved at an older step, the named state stays the newest; at a newer one, that is.
    # Strategy fsdp saves sharded states on one process too (as Trainer does), so that
    # the run can go on on any number of ranks.
    assert one["after 7"]["path"] == "ckpt-000000010.dcp"
    assert one["after 11"]["path"] == "ckpt-000000011.dcp"
    for key in ("after 7", "after 11"):
        assert one[key]["model"] == saved["model"], key
        assert one[key]["optimizer"] == saved["optimizer"], key

    # A whole model's file (strategy ddp), the newest now, which 2 sharded ranks do not
    # split up.
    launch(_save_whole, str(work), nprocs=1)
    with pytest.raises(WorkerError, match=r"ckpt-000000012.pt holds the whole state") as info:
        launch(_loop, str(work), None, nprocs=2)
    assert "resume it as it was saved" in str(info.value).splitlines()[0]


def test_a_sharded_state_of_another_model_is_one_clear_error(
    stopped: tuple[Path, list[Any]],
) -> None:
    folder, _ = stopped
    small = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 1))
    opt = torch.optim.AdamW(small.parameters())
    with pytest.raises(CheckpointError, match="does not fit this job's model") as info:
        load_state(folder / "ckpt-000000010.dcp", CTX, model=small, optimizer=opt)
    assert "\n" not in str(info.value)

"""save_state / load_state: a hand-written loop killed mid-epoch and resumed ends
bit-identical to the loop that was never interrupted, on every rank.

The loop has what makes a resume hard: dropout, noise drawn in the dataset's
`__getitem__` (each rank its own stream), a shuffled sampler, AdamW, and an LR
scheduler stepped per batch. Every rank's model and optimizer state is gathered and
compared, not rank 0's alone. Real processes: 2 gloo ranks, and a run killed with
SIGKILL on its whole process group.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset
from torch.utils.data.distributed import DistributedSampler

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
from ddpkit.errors import CheckpointError, ConfigError, WorkerError
from ddpkit.seed import rank_seed, seed_everything
from tests.conftest import ROOT

CTX = DistContext()
EPOCHS = 2
SAMPLES, BATCH = 64, 4  # 2 ranks: 8 batches per rank and epoch, 16 steps in all
SAVE_EVERY = 5  # steps 5, 10 and 15: 10 is batch 2 of epoch 1


class _Augmented(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Fresh noise on every sample it returns, as a random augmentation does."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(3)
        self.x = torch.randn(SAMPLES, 8, generator=g)
        self.y = self.x.sum(dim=1, keepdim=True)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i] + 0.1 * torch.randn(8), self.y[i]


class _AugmentedStream(IterableDataset[tuple[torch.Tensor, torch.Tensor]]):
    """The same samples as a stream: batches can only be skipped by reading them."""

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        data = _Augmented()
        return (data[i] for i in range(SAMPLES))


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 1))


def _all_ranks(ctx: DistContext, value: Any) -> list[Any]:
    """Every rank's `value`, in rank order (a collective: every rank calls it)."""
    if not ctx.distributed:
        return [value]
    out: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(out, value)
    return out


def _loop(ctx: DistContext, folder: str, stop_at: int | None, marker: str | None) -> list[Any]:
    """The loop as a user writes it. With `stop_at`, it hangs after that step (rank 0
    first writes `marker`), to be killed there."""
    seed_everything(0)  # the same model on every rank
    net = _net()
    opt = torch.optim.AdamW(net.parameters(), lr=0.01, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=EPOCHS * 8)
    model = prepare_model(net, ctx)
    loader = prepare_loader(_Augmented(), ctx, BATCH, seed=7)
    seed_everything(rank_seed(0, ctx.rank))  # each rank its own stream
    parts: dict[str, Any] = {"model": model, "optimizer": opt, "scheduler": sched}

    start = load_state(folder, ctx, **parts, loader=loader)
    resumed_at = None if start is None else (start["epoch"], start["batch"], start["step"])
    if start is None:
        start = {"epoch": 0, "batch": 0, "step": 0, "losses": []}
    step, losses = start["step"], list(start["losses"])
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
                extra = {"losses": losses}
                save_state(
                    folder,
                    ctx,
                    **parts,
                    loader=loader,
                    epoch=epoch,
                    batch=batch,
                    step=step,
                    extra=extra,
                )
            if step == stop_at:
                if ctx.is_main and marker:
                    Path(marker).write_text(str(step))
                time.sleep(600)  # killed here, two steps after the last save
    return _all_ranks(
        ctx,
        {
            "model": model_digest(model),
            "optimizer": state_digest(opt.state_dict()),
            "scheduler": state_digest(sched.state_dict()),
            "losses": losses,
            "resumed_at": resumed_at,
        },
    )


_SCRIPT = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {root!r})
    from ddpkit import launch
    from tests.test_state import _loop

    if __name__ == "__main__":
        launch(_loop, sys.argv[1], int(sys.argv[2]), sys.argv[3], nprocs=2)
    """
)


def _wait_for(marker: Path, proc: subprocess.Popen[bytes], log: Path, within: float = 120) -> None:
    deadline = time.monotonic() + within
    while not (marker.exists() and marker.stat().st_size):
        if proc.poll() is not None:
            pytest.fail(f"the run ended ({proc.returncode}) before step 12:\n{log.read_text()}")
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {marker}:\n{log.read_text()}")
        time.sleep(0.05)


def test_a_loop_killed_mid_epoch_resumes_bit_identical_on_every_rank(tmp_path: Path) -> None:
    straight = launch(_loop, str(tmp_path / "straight"), None, None, nprocs=2)

    folder, marker, log = tmp_path / "killed", tmp_path / "step12", tmp_path / "run.log"
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT.format(root=str(ROOT)))
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, str(script), str(folder), "12", str(marker)],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: the launcher and both ranks
        )
        try:
            _wait_for(marker, proc, log)
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    newest = list_checkpoints(folder)[-1]
    assert newest.name == "ckpt-000000010.pt"  # steps 11 and 12 were trained, then lost
    saved = load_checkpoint(newest, CTX)
    assert not any(k.startswith("module.") for k in saved["model"])  # the bare model
    assert len(saved["rng"]) == 2
    assert not torch.equal(saved["rng"][0]["torch"], saved["rng"][1]["torch"])

    resumed = launch(_loop, str(folder), None, None, nprocs=2)
    assert [r["resumed_at"] for r in resumed] == [(1, 2, 10)] * 2  # mid-epoch, every rank
    assert [r["resumed_at"] for r in straight] == [None] * 2  # an empty folder: a fresh start
    assert straight[0]["model"] == straight[1]["model"]
    for key in ("model", "optimizer", "scheduler", "losses"):
        assert [r[key] for r in resumed] == [r[key] for r in straight], key
    assert len(straight[0]["losses"]) == EPOCHS * 8


# -- one process ------------------------------------------------------------------------
def _one_process(ctx: DistContext, folder: str, stream: bool, resume_from: str | None) -> Any:
    """Trains 2 epochs with a GradScaler, saving after step 3 (batch 3 of epoch 0);
    with `resume_from`, continues from that file instead."""
    seed_everything(0)
    model = _net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    data = _AugmentedStream() if stream else _Augmented()
    loader = prepare_loader(data, ctx, 8, seed=7)
    seed_everything(rank_seed(0, ctx.rank))
    parts: dict[str, Any] = {"model": model, "optimizer": opt, "scheduler": sched, "scaler": scaler}
    start = {"epoch": 0, "batch": 0, "step": 0}
    if resume_from is not None:
        resumed = load_state(resume_from, ctx, **parts, loader=loader)
        assert resumed is not None
        start = resumed
    step = start["step"]
    for epoch in range(start["epoch"], 2):
        loader.set_epoch(epoch)
        first = start["batch"] if epoch == start["epoch"] else 0
        for batch, (x, y) in enumerate(loader, start=first + 1):
            opt.zero_grad()
            scaler.scale(nn.functional.mse_loss(model(x), y)).backward()  # type: ignore[no-untyped-call]
            scaler.step(opt)
            scaler.update()
            sched.step()
            step += 1
            if step == 3 and resume_from is None:
                save_state(
                    folder,
                    ctx,
                    **parts,
                    loader=loader,
                    epoch=epoch,
                    batch=batch,
                    step=step,
                    extra={"note": "hi", "t": torch.ones(2)},
                )
    return {
        "model": model_digest(model),
        "optimizer": state_digest(opt.state_dict()),
        "scheduler": state_digest(sched.state_dict()),
        "scaler": state_digest(scaler.state_dict()),
        "step": step,
        "start": {k: v for k, v in start.items() if k != "t"},
        "t": start.get("t"),
    }


@pytest.mark.parametrize("stream", [False, True], ids=["skips-indices", "iterable-reads-past"])
def test_one_process_round_trip_from_a_named_file(tmp_path: Path, stream: bool) -> None:
    straight = launch(_one_process, str(tmp_path), stream, None, nprocs=1)
    path = tmp_path / "ckpt-000000003.pt"
    again = launch(_one_process, str(tmp_path), stream, str(path), nprocs=1)
    assert again["start"] == {"note": "hi", "epoch": 0, "batch": 3, "step": 3, "path": path}
    assert torch.equal(again["t"], torch.ones(2))
    for key in ("model", "optimizer", "scheduler", "scaler", "step"):
        assert again[key] == straight[key], key


# -- nothing to resume, broken files, bad arguments ----------------------------------------
def _parts() -> dict[str, Any]:
    model: nn.Module = nn.Linear(8, 1)
    return {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1)}


def test_nothing_to_resume_is_none_and_a_broken_file_is_one_clear_error(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    assert load_state(empty, CTX, **_parts()) is None
    assert load_state(tmp_path / "not-yet", CTX, **_parts()) is None  # a first run

    missing = tmp_path / "ckpt-000000007.pt"
    with pytest.raises(CheckpointError, match="does not exist") as info:
        load_state(missing, CTX, **_parts())
    assert "\n" not in str(info.value)

    odd = tmp_path / "state.ckpt"  # a file by another name is a file, not a folder
    odd.write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        load_state(odd, CTX, **_parts())

    folder = tmp_path / "corrupt"
    path = save_state(folder, CTX, **_parts(), epoch=0, step=1)
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(CheckpointError, match="truncated or corrupt") as info:
        load_state(path, CTX, **_parts())
    assert "\n" not in str(info.value)
    with pytest.raises(CheckpointError, match=r"no checkpoint in .* could be read"):
        load_state(folder, CTX, **_parts())

    other = save_state(tmp_path / "other", CTX, **_parts(), epoch=0, step=1)
    small = nn.Linear(4, 1)
    another = "holds another model.*this job's model is torch.nn.Linear"
    with pytest.raises(CheckpointError, match=another) as info:
        load_state(other, CTX, model=small, optimizer=torch.optim.SGD(small.parameters()))
    assert "\n" not in str(info.value)


def test_an_extra_that_could_not_be_resumed_is_refused_when_saving(tmp_path: Path) -> None:
    import numpy as np

    with pytest.raises(ConfigError, match=r"extra\['best'\] is a numpy.float64"):
        save_state(tmp_path, CTX, **_parts(), epoch=0, step=1, extra={"best": np.float64(1)})
    with pytest.raises(ConfigError, match="may not use the name 'step'"):
        save_state(tmp_path, CTX, **_parts(), epoch=0, step=1, extra={"step": 1})
    with pytest.raises(ConfigError, match="batch as an int >= 0"):
        save_state(tmp_path, CTX, **_parts(), epoch=0, batch=-1, step=1)
    assert list_checkpoints(tmp_path) == []


def test_a_plain_dataloader_resumed_mid_epoch_is_refused_with_the_fix(tmp_path: Path) -> None:
    data = TensorDataset(torch.randn(16, 8), torch.randn(16, 1))
    plain = DataLoader(data, batch_size=4)
    path = save_state(tmp_path, CTX, **_parts(), loader=plain, epoch=0, batch=2, step=2)
    with pytest.raises(ConfigError, match=r"prepare_loader\(loader, ctx\)"):
        load_state(path, CTX, **_parts(), loader=plain)
    rebuilt = prepare_loader(plain, CTX)  # the fix the message names
    load_state(path, CTX, **_parts(), loader=rebuilt)
    assert len(list(rebuilt)) == 2  # the two batches after the save


def _hand_loop_recording(ctx: DistContext, folder: str, record: str, stop: int | None) -> None:
    """2 epochs of 40 indexed samples, batch 4, a save after every step; each rank
    appends 'epoch index' lines to `record`; raises after saving step `stop`."""
    from tests.test_trainer_features import _Indexed

    seed_everything(0)
    model: nn.Module = nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model = prepare_model(model, ctx)
    loader = prepare_loader(_Indexed(), ctx, batch_size=4)
    start = load_state(folder, ctx, model=model, optimizer=opt, loader=loader)
    start = start or {"epoch": 0, "batch": 0, "step": 0}
    step = start["step"]
    for epoch in range(start["epoch"], 2):
        loader.set_epoch(epoch)
        first = start["batch"] if epoch == start["epoch"] else 0
        for batch, (x, y, index) in enumerate(loader, start=first + 1):
            with open(f"{record}.{ctx.rank}", "a") as f:
                f.writelines(f"{epoch} {i}\n" for i in index.tolist())
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()  # type: ignore[no-untyped-call]
            opt.step()
            step += 1
            save_state(folder, ctx, model=model, optimizer=opt, loader=loader, epoch=epoch,
                       batch=batch, step=step)  # fmt: skip
            if step == stop:
                raise RuntimeError(f"stopped after saving step {stop}")


@pytest.mark.parametrize(("before", "after"), [(2, 1), (1, 2)])
def test_a_hand_loop_resumed_on_another_world_size_trains_each_sample_once(
    tmp_path: Path, before: int, after: int
) -> None:
    from tests.test_trainer_features import _trained

    folder, record = str(tmp_path / "ck"), str(tmp_path / "record")
    with pytest.raises((WorkerError, RuntimeError), match="stopped after saving step 3"):
        launch(_hand_loop_recording, folder, record, 3, nprocs=before)
    launch(_hand_loop_recording, folder, record + "-resumed", None, nprocs=after)
    assert _trained(tmp_path) == [list(range(40)), list(range(40))]


def _bytes_read() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


def test_one_process_reads_a_named_state_file_once(tmp_path: Path) -> None:
    # Hashing the file after loading it (for ranks that compare what they read) read
    # it twice in one process, where there is no one to compare with.
    ctx = DistContext.single("cpu")
    model = nn.Linear(512, 1024)  # 2 MB of weights
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    save_state(tmp_path, ctx, model=model, optimizer=optimizer, epoch=0, step=0)
    (saved,) = list_checkpoints(tmp_path)
    size = saved.stat().st_size
    before = _bytes_read()
    load_state(saved, ctx, model=model, optimizer=optimizer)
    assert _bytes_read() - before < 1.5 * size


# -- a DistributedSampler subclass with its own order ----------------------------------------
class _Lengths(Dataset[tuple[torch.Tensor, torch.Tensor, int]]):
    """40 samples `(x, y, index)`, sample i being `i % 7 + 1` long (as token counts)."""

    def __len__(self) -> int:
        return 40

    def length(self, i: int) -> int:
        return i % 7 + 1

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        x = torch.full((8,), float(self.length(i))) + 0.1 * torch.randn(8)  # noise: an augmentation
        return x, x[:1].clone(), i


class _LengthBuckets(DistributedSampler[int]):
    """Orders the epoch by length (shuffled within each length), and gives rank r the
    r-th contiguous slice, so that each rank's batches hold samples of similar length:
    an order of its own, unlike DistributedSampler's every-W-th permutation."""

    def __iter__(self) -> Iterator[int]:
        data = cast(_Lengths, self.dataset)
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        tie = torch.randperm(len(data), generator=g).tolist()
        order = sorted(range(len(data)), key=lambda i: (data.length(i), tie[i]))
        order += order[: self.total_size - len(order)]
        return iter(order[self.rank * self.num_samples : (self.rank + 1) * self.num_samples])


def _bucket_loop(
    ctx: DistContext, folder: str, record: str, stop: int | None, batch: int
) -> list[Any]:
    """2 epochs over _Lengths by length buckets, a save after every step; each rank
    appends 'epoch index' lines to `record`; raises after saving step `stop`. Returns
    every rank's model and optimizer digests."""
    seed_everything(0)
    model: nn.Module = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.2), nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model = prepare_model(model, ctx)
    data = _Lengths()
    sampler = _LengthBuckets(data, ctx.world_size, ctx.rank, seed=3)
    loader = prepare_loader(data, ctx, batch_size=batch, sampler=sampler)
    seed_everything(rank_seed(0, ctx.rank))
    start = load_state(folder, ctx, model=model, optimizer=opt, loader=loader)
    start = start or {"epoch": 0, "batch": 0, "step": 0}
    step = start["step"]
    for epoch in range(start["epoch"], 2):
        loader.set_epoch(epoch)
        first = start["batch"] if epoch == start["epoch"] else 0
        for done, (x, y, index) in enumerate(loader, start=first + 1):
            with open(f"{record}.{ctx.rank}", "a") as f:
                f.writelines(f"{epoch} {i}\n" for i in index.tolist())
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()  # type: ignore[no-untyped-call]
            opt.step()
            step += 1
            save_state(folder, ctx, model=model, optimizer=opt, loader=loader, epoch=epoch,
                       batch=done, step=step)  # fmt: skip
            if step == stop:
                raise RuntimeError(f"stopped after saving step {stop}")
    return _all_ranks(ctx, (model_digest(model), state_digest(opt.state_dict())))


def _trained_by_epoch(folder: Path) -> list[list[int]]:
    """Per epoch, the sorted indices that every rank of every run trained."""
    seen: list[list[int]] = [[], []]
    for f in folder.glob("record*"):
        for line in f.read_text().splitlines():
            e, i = map(int, line.split())
            seen[e].append(i)
    return [sorted(s) for s in seen]


def test_a_sampler_subclass_resumed_with_another_batch_size_trains_each_sample_once(
    tmp_path: Path,
) -> None:
    folder, record = str(tmp_path / "ck"), str(tmp_path / "record")
    with pytest.raises((WorkerError, RuntimeError), match="stopped after saving step 3"):
        launch(_bucket_loop, folder, record, 3, 4, nprocs=2)  # 24 of 40 samples trained
    # Batches of 5 on 2 ranks: the 24 samples make no whole step of 10.
    digests = launch(_bucket_loop, folder, record + "-resumed", None, 5, nprocs=2)
    assert _trained_by_epoch(tmp_path) == [list(range(40)), list(range(40))]
    assert digests[0] == digests[1]  # every rank's parameters and optimizer state


def test_a_sampler_subclass_resumed_on_other_ranks_is_refused_in_one_line(
    tmp_path: Path,
) -> None:
    folder, record = str(tmp_path / "ck"), str(tmp_path / "record")
    with pytest.raises((WorkerError, RuntimeError), match="stopped after saving step 3"):
        launch(_bucket_loop, folder, record, 3, 4, nprocs=2)
    # Its order on 1 rank is not what the 2 ranks trained: ddpkit cannot share out the rest.
    with pytest.raises((WorkerError, ConfigError), match=r"on 2 rank.*_LengthBuckets") as info:
        launch(_bucket_loop, folder, record + "-resumed", None, 4, nprocs=1)
    line = next(t for t in str(info.value).splitlines() if "_LengthBuckets" in t)
    assert "resume with the number of ranks" in line

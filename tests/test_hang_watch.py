"""The hang watch on real processes: what counts as work (CPU in any thread or child
process, not a child's mere existence) and which waits it sees (FSDP's collectives, an
`async_op=True` collective up to its `wait()`). tests/test_hang_judge.py checks the
judge alone, on hand-made reports."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ddpkit
from ddpkit import DistContext, launch
from ddpkit.errors import HangError
from ddpkit.inrank.watchdog import _Activity
from ddpkit.parallel.fsdp import cpu_supported
from ddpkit.parallel.ranks import all_gather_object

HANG_TIMEOUT = 4.0
# The collective timeout of the jobs that must be stopped as hung: small, so that a
# watch that misses the hang fails the test (the collective fails: WorkerError) soon.
TIMEOUT = 15
# Start-up (fork, process group, DataLoader workers, FSDP's import) and sampling.
SLACK = 10.0


def _spin(seconds: float) -> None:
    """Work in Python, on the CPU, for `seconds`."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def _work_in_a_thread(ctx: DistContext) -> str:
    if ctx.rank == 0:
        worker = threading.Thread(target=_spin, args=(10,))
        worker.start()
        worker.join()  # the main thread waits, using no CPU, while its thread works
    dist.barrier()
    return "done"


def test_work_in_a_thread_that_the_main_thread_joins_is_not_stopped(
    capfd: pytest.CaptureFixture[str],
) -> None:
    assert launch(_work_in_a_thread, nprocs=2, hang_timeout=HANG_TIMEOUT) == "done"
    err = capfd.readouterr().err
    assert "rank 1 has waited" in err and "for rank 0: rank 0 is busy (using the CPU" in err
    assert "rank 1: in barrier" in err
    assert "work that rank 0 must do before the others" in err  # rank_zero_first, named


def _deadlock_beside_idle_loader_workers(ctx: DistContext) -> None:
    data = TensorDataset(torch.arange(64.0))
    batches = iter(DataLoader(data, batch_size=4, num_workers=2))
    next(batches)  # the workers live on, idle, holding batches for the next step
    if ctx.rank == 1:
        lock = threading.Lock()
        lock.acquire()
        lock.acquire()  # a deadlock: parked for good
    dist.barrier()


def test_a_hang_is_stopped_while_idle_dataloader_workers_live() -> None:
    start = time.monotonic()
    with pytest.raises(HangError) as info:
        launch(
            _deadlock_beside_idle_loader_workers,
            nprocs=2,
            hang_timeout=HANG_TIMEOUT,
            timeout=TIMEOUT,
        )
    assert time.monotonic() - start < HANG_TIMEOUT + SLACK
    assert "rank 0: in barrier" in info.value.summary
    assert "rank 1 stayed at one line" in info.value.summary
    assert "lock.acquire()" in info.value.stacks


def _async_wait(ctx: DistContext) -> None:
    if ctx.rank == 0:
        work = dist.all_reduce(torch.ones(1), async_op=True)
        work.wait()  # rank 0 blocks here, not in all_reduce, which returned at once
    else:
        time.sleep(10**6)


def test_a_rank_blocked_in_an_async_collectives_wait_is_in_that_collective() -> None:
    with pytest.raises(HangError) as info:
        launch(_async_wait, nprocs=2, hang_timeout=HANG_TIMEOUT, timeout=TIMEOUT)
    assert "rank 0: in all_reduce (collective #1) at" in info.value.summary
    assert "work.wait()" in info.value.stacks


def _fsdp_one_rank_goes_on(ctx: DistContext, how: str) -> None:
    ddpkit.seed_everything(0)
    net = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1))
    model = ddpkit.prepare_model(
        net,
        ctx,
        strategy="fsdp",
        # each Linear(16, 16) a block of its own; kept gathered after the forward for
        # "backward", so that its first collective is the gradients' reduce-scatter
        fsdp={"min_params": 100, "reshard_after_forward": how != "backward"},
    )
    x = torch.randn(8, 16)
    model(x).sum().backward()  # one step together
    loss = model(x).sum()  # and a forward
    if ctx.rank == 1:
        time.sleep(10**6)  # rank 1 goes no further
    if how == "forward":
        model(x)  # a forward too many: gathers a block's parameters
    elif how == "unshard":
        model.unshard(async_op=True).wait()  # type: ignore[operator]
    else:
        loss.backward()


@pytest.mark.skipif(not cpu_supported(), reason="FSDP2 on CPU ranks needs torch >= 2.7")
@pytest.mark.parametrize(
    ("how", "collective"),
    [
        pytest.param("forward", "all_gather_(single|into_tensor)", marks=pytest.mark.slow),
        ("unshard", "all_gather_(single|into_tensor)"),  # async_op=True, then wait()
        pytest.param("backward", "reduce_scatter_(single|tensor)", marks=pytest.mark.slow),
    ],
)
def test_a_rank_waiting_in_an_fsdp_collective_is_seen_there(how: str, collective: str) -> None:
    start = time.monotonic()
    with pytest.raises(HangError) as info:
        launch(_fsdp_one_rank_goes_on, how, nprocs=2, hang_timeout=HANG_TIMEOUT, timeout=TIMEOUT)
    assert time.monotonic() - start < HANG_TIMEOUT + SLACK
    summary = info.value.summary
    assert re.search(
        rf"rank 0: in {collective} \(collective #\d+\) at .*_fsdp_one_rank", summary
    ), summary
    assert "rank 1 stayed at one line" in summary


_BUSY_CHILD = "import time\nend = time.monotonic() + 6\nwhile time.monotonic() < end: pass"


def _children_then_barrier(ctx: DistContext) -> str:
    if ctx.rank == 0:
        subprocess.run([sys.executable, "-c", _BUSY_CHILD], check=True)
        subprocess.run(["sleep", "10"], check=True)
    dist.barrier()
    return "done"


@pytest.mark.slow
def test_a_busy_child_is_work_and_an_idle_one_is_only_uncertain(
    capfd: pytest.CaptureFixture[str],
) -> None:
    # Neither is stopped: the busy child works; the idle one (a sleep, a download
    # stalled on the network) may still end, so the job goes on to the collective
    # timeout at most, with notices that say so.
    assert launch(_children_then_barrier, nprocs=2, hang_timeout=HANG_TIMEOUT) == "done"
    err = capfd.readouterr().err
    assert "rank 0 is busy (using the CPU or reading data) at" in err
    assert "rank 0 is waiting for a child process that uses no CPU at" in err
    assert "rank 1: in barrier" in err


# -- the evidence of work, in this process ------------------------------------------------
def _activity() -> _Activity:
    return _Activity(threading.main_thread().native_id)


def test_cpu_of_any_thread_is_work_but_not_the_watchs_own() -> None:
    activity = _activity()
    worker = threading.Thread(target=_spin, args=(0.5,))
    worker.start()
    worker.join()
    assert activity.working()

    seen: list[bool] = []

    def watch() -> None:
        activity.watch_thread = threading.get_ident()
        activity.working()
        _spin(0.5)  # as if sampling took long: the watch's own CPU is no work
        seen.append(activity.working())

    watcher = threading.Thread(target=watch)
    watcher.start()
    watcher.join()
    assert seen == [False]


def test_a_childs_cpu_is_work_and_its_mere_existence_is_not() -> None:
    activity = _activity()
    idle = subprocess.Popen(["sleep", "30"])
    try:
        time.sleep(0.2)
        activity.working()
        time.sleep(1.0)
        assert not activity.working()
        busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            time.sleep(0.5)
            activity.working()  # python's start-up was work too: from here on, the loop
            time.sleep(1.0)
            assert activity.working()
        finally:
            busy.kill()
            busy.wait()
    finally:
        idle.kill()
        idle.wait()


def test_reading_data_is_work_even_without_cpu(tmp_path: Path) -> None:
    # A download or a slow disk: bytes come in, the CPU idles. Its own reads of /proc
    # are no work.
    data = tmp_path / "shard.bin"
    data.write_bytes(os.urandom(1 << 16))
    activity = _activity()
    time.sleep(0.5)
    assert not activity.working()
    with data.open("rb") as f:
        f.read()
    time.sleep(0.5)
    assert activity.working()


def test_writing_is_work_but_the_watchs_own_reports_are_not(tmp_path: Path) -> None:
    # A checkpoint flushed to a slow disk: bytes go out, the CPU idles. The watch's own
    # writes (its report, once a second) are no work.
    activity = _activity()
    time.sleep(0.3)
    assert not activity.working()
    (tmp_path / "shard.bin").write_bytes(b"\1" * (1 << 16))
    assert activity.working()

    seen: list[bool] = []

    def watch() -> None:
        activity.watch_thread = threading.get_ident()
        activity.working()
        (tmp_path / "rank0.json").write_bytes(b"{}" * (1 << 15))  # as if its report
        # The watch samples once a second: over a millisecond, the CPU clocks' jitter
        # alone would pass for work.
        time.sleep(0.3)
        seen.append(activity.working())

    watcher = threading.Thread(target=watch)
    watcher.start()
    watcher.join()
    assert seen == [False]


class _DiskWait(_Activity):
    """Sees the threads of this process in uninterruptible sleep (state D) while `on`:
    an fsync blocked on a slow disk, which no test machine can be made to have."""

    on = False

    def _read(self, path: str) -> str:
        text = super()._read(path)
        if self.on and "/task/" in path and path.endswith("/stat"):
            head, tail = text.rsplit(") ", 1)
            text = f"{head}) D {tail.split(' ', 1)[1]}"
        return text


def test_a_thread_waiting_for_the_disk_is_work() -> None:
    activity = _DiskWait(threading.main_thread().native_id)
    time.sleep(0.3)
    assert not activity.working()
    activity.on = True
    assert activity.working()


# -- D02: a rank that flushes a checkpoint to a slow disk works --------------------------
_FLUSH_S = 3 * HANG_TIMEOUT


def _slow_fsync(real: Callable[[Any], None], scratch: str) -> Callable[[Any], None]:
    """`os.fsync` as a slow disk makes it for the checkpoint's flush: for `_FLUSH_S`
    seconds the flushing thread pushes bytes out (no CPU to speak of), then it returns.
    Other fsyncs, and the folder's after the file's, are the real ones."""
    slowed: list[Any] = []

    def fsync(fd: Any) -> None:
        if threading.current_thread().name == "ddpkit-durability" and not slowed:
            slowed.append(fd)
            end = time.monotonic() + _FLUSH_S
            with open(scratch, "wb") as out:
                while time.monotonic() < end:
                    out.write(b"\0" * (1 << 15))  # write-back, as the kernel flushes
                    out.flush()
                    time.sleep(0.05)
        real(fd)

    return fsync


def _fit_with_a_slow_flush(ctx: DistContext, folder: str) -> list[str]:
    from ddpkit.checkpoint.digest import model_digest, state_digest

    if ctx.rank == 0:  # the disk is slow where rank 0 writes the checkpoint
        os.fsync = _slow_fsync(os.fsync, os.path.join(folder, "..", "disk-busy"))  # type: ignore[assignment]
    ddpkit.seed_everything(7)
    model = nn.Sequential(nn.Linear(6, 16), nn.Dropout(0.2), nn.SiLU(), nn.Linear(16, 3))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(96, 6, generator=g)
    data = TensorDataset(x, (x[:, :3] > 0).long().sum(1).clamp(max=2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.5)
    trainer = ddpkit.Trainer(
        model,
        optimizer,
        data,
        ctx,
        ddpkit.TrainConfig(epochs=1, batch_size=8, checkpoint_dir=folder, progress=False),
        loss_fn=nn.functional.cross_entropy,
        scheduler=scheduler,
        log_fn=lambda s: None,
    )
    trainer.fit()  # rank 0 waits at its end for the flush; rank 1 then waits for rank 0
    digests = [model_digest(trainer.model), state_digest(optimizer.state_dict())]
    digests.append(state_digest(scheduler.state_dict()))
    gathered = all_gather_object(digests)
    assert all(d == gathered[0] for d in gathered), gathered
    return gathered[0]


@pytest.mark.slow
def test_a_rank_flushing_a_checkpoint_to_a_slow_disk_is_not_stopped(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    # Bytes written (and time in uninterruptible sleep, on a real disk) are work: rank 0
    # flushes, rank 1 waits for it in a collective; the job must not end as a hang.
    start = time.monotonic()
    launch(_fit_with_a_slow_flush, str(tmp_path / "ck"), nprocs=2, hang_timeout=HANG_TIMEOUT)
    assert time.monotonic() - start >= _FLUSH_S
    err = capfd.readouterr().err
    assert "rank 0 is busy" in err, err

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
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ddpkit
from ddpkit import DistContext, launch
from ddpkit.errors import HangError
from ddpkit.parallel.fsdp import cpu_supported
from ddpkit.processes.watchdog import _Activity

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

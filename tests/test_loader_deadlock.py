"""A DataLoader worker that can never run again (one thread, asleep for good on a lock of
its own: what a fork taken while another thread held a lock leaves, CPython gh-112275
among them) makes its rank parked, not polling: the hang watch stops the job within the
hang timeout and names the worker, instead of waiting for the collective timeout."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from ddpkit.inrank.deadlock import fork_deadlock_hint, stuck_for_good, waited_worker
from tests.conftest import run_cli

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/<pid>/syscall")

WAITS = {
    "own lock, one thread": "import threading; l = threading.Lock(); l.acquire(); l.acquire()",
    "sleep": "import time; time.sleep(60)",
    "timed wait": "import threading; threading.Event().wait(60)",
    "lock held by its other thread": (
        "import threading, time; l = threading.Lock(); l.acquire(); "
        "threading.Thread(target=time.sleep, args=(60,)).start(); l.acquire()"
    ),
}


@pytest.fixture
def children() -> Iterator[dict[str, subprocess.Popen[bytes]]]:
    procs = {name: subprocess.Popen([sys.executable, "-c", code]) for name, code in WAITS.items()}
    yield procs
    for proc in procs.values():
        proc.kill()
        proc.wait()


def test_only_a_single_thread_asleep_on_its_own_lock_is_stuck_for_good(
    children: dict[str, subprocess.Popen[bytes]],
) -> None:
    deadline = time.monotonic() + 20
    while not stuck_for_good(children["own lock, one thread"].pid):
        assert time.monotonic() < deadline, "the deadlocked child was never seen stuck"
        time.sleep(0.1)
    time.sleep(1.0)  # the others are asleep in their waits by now
    seen = {name: stuck_for_good(proc.pid) for name, proc in children.items()}
    assert seen == {
        "own lock, one thread": True,
        "sleep": False,  # it ends by itself
        "timed wait": False,
        "lock held by its other thread": False,  # that thread may release it
    }


class _Squares(Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((3,), float(i)) + torch.rand(3)  # augmented


def _second_worker_deadlocks(worker_id: int) -> None:
    if worker_id == 1:
        lock = threading.Lock()
        lock.acquire()
        lock.acquire()


def test_the_thread_iterating_a_dataloader_names_the_workers_it_waits_for() -> None:
    loader = DataLoader(
        _Squares(),
        batch_size=4,
        num_workers=2,
        worker_init_fn=_second_worker_deadlocks,
        multiprocessing_context="fork",
    )
    got: list[torch.Tensor] = []

    def read() -> None:
        with contextlib.suppress(RuntimeError):  # its workers are killed below
            got.extend(loader)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    deadline = time.monotonic() + 20
    pids: list[int] = []
    while len(pids) < 2 or not any(stuck_for_good(p) for p in pids):
        assert time.monotonic() < deadline, f"never saw a stuck worker among {pids}"
        time.sleep(0.1)
        pids = waited_worker(sys._current_frames().get(reader.ident or 0))
    assert len(got) <= 1  # the first batch came from the worker that runs
    assert waited_worker(sys._current_frames()[threading.main_thread().ident or 0]) == []
    for pid in pids:  # end the loader's wait: it reports its workers' death
        subprocess.run(["kill", "-9", str(pid)], check=False)
    reader.join(30)


def test_the_hint_names_the_cpython_fix_only_where_it_is_missing() -> None:
    hint = fork_deadlock_hint()
    affected = sys.version_info < (3, 12) and sys.version_info[:3] < {
        (3, 10): (3, 10, 15),
        (3, 11): (3, 11, 10),
    }.get(sys.version_info[:2], (3, 12, 0))
    assert (hint is not None) == affected
    if hint is not None:
        assert "gh-112275" in hint and 'multiprocessing_context="forkserver"' in hint


WORKER_DEADLOCKS = """
import os, sys, threading, time
from datetime import timedelta
import torch, torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class Noisy(Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        x = torch.randn(5)  # a random augmentation
        return {"x": x, "y": x.sum(0, keepdim=True)}


def second_worker_of_rank_1_deadlocks(worker_id):
    if os.environ["RANK"] == "1" and worker_id == 1:
        lock = threading.Lock()
        lock.acquire()
        open(sys.argv[1], "w").write(str(time.time()))
        lock.acquire()  # one thread, asleep for good


dist.init_process_group("gloo", timeout=timedelta(seconds=int(sys.argv[2])))
torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(5, 16), nn.Dropout(0.1), nn.Linear(16, 1)))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
data = Noisy()
loader = DataLoader(
    data, batch_size=4, sampler=DistributedSampler(data), num_workers=2,
    worker_init_fn=second_worker_of_rank_1_deadlocks,
)
for batch in loader:
    loss = nn.functional.mse_loss(model(batch["x"]), batch["y"])
    loss.backward()
    opt.step()
    opt.zero_grad()
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_a_rank_waiting_for_a_deadlocked_dataloader_worker_is_stopped_under_run(
    tmp_path: Path,
) -> None:
    script = tmp_path / "worker_deadlocks.py"
    script.write_text(WORKER_DEADLOCKS)
    marker = tmp_path / "deadlocked"
    # The script's collective timeout (60 s) bounds the test: without a watch that sees
    # the worker, rank 1 polled its loader until rank 0's all-reduce failed there.
    out = run_cli("run", "--nproc", "2", "--hang-timeout", "8", str(script), str(marker), "60")
    ended = time.time()
    assert out.returncode == 124, out.stderr
    assert ended - float(marker.read_text()) < 8 + 15
    summary = out.stderr[out.stderr.index("ddpkit: the job is hung") :]
    assert "rank 1 is waiting for its DataLoader worker (pid " in summary, summary
    assert "can never run again" in summary, summary

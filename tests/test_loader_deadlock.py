"""A DataLoader worker that can never run again (one thread, asleep for good on a lock of
its own: what a fork taken while another thread held a lock leaves, CPython gh-112275
among them) makes its rank parked, not polling: the hang watch stops the job within the
hang timeout and names the worker, instead of waiting for the collective timeout."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ddpkit.inrank.deadlock import fork_deadlock_hint, stuck_for_good
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


# In a fresh interpreter: a process that has run other jobs may have torch start a pool
# thread in each worker (then a lock held in the worker is no certain deadlock any more).
READS_A_LOADER = """
import json, subprocess, sys, threading, time
import torch
from torch.utils.data import DataLoader, Dataset
from ddpkit.inrank.deadlock import stuck_for_good, waited_worker


class Squares(Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        return torch.full((3,), float(i)) + torch.rand(3)  # augmented


def second_worker_deadlocks(worker_id):
    if worker_id == 1:
        lock = threading.Lock()
        lock.acquire()
        lock.acquire()


loader = DataLoader(Squares(), batch_size=4, num_workers=2,
                    worker_init_fn=second_worker_deadlocks, multiprocessing_context="fork")
got = []


def read():
    try:
        got.extend(loader)
    except RuntimeError:  # its workers are killed below
        pass


reader = threading.Thread(target=read, daemon=True)
reader.start()
deadline, pids, stuck = time.monotonic() + 30, [], []
while time.monotonic() < deadline and (len(pids) < 2 or not stuck):
    time.sleep(0.1)
    pids = waited_worker(sys._current_frames().get(reader.ident))
    stuck = [p for p in pids if stuck_for_good(p)]
mine = waited_worker(sys._current_frames()[threading.main_thread().ident])
for pid in pids:  # end the loader's wait: it reports its workers' death
    subprocess.run(["kill", "-9", str(pid)], check=False)
reader.join(30)
print(json.dumps({"pids": pids, "stuck": stuck, "batches": len(got), "main": mine}))
"""


def test_the_thread_iterating_a_dataloader_names_the_workers_it_waits_for() -> None:
    out = subprocess.run(
        [sys.executable, "-c", READS_A_LOADER], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(seen["pids"]) == 2, seen
    assert len(seen["stuck"]) == 1 and seen["stuck"][0] in seen["pids"], seen
    assert seen["batches"] <= 1  # the first batch came from the worker that runs
    assert seen["main"] == []  # the main thread waits for no loader


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

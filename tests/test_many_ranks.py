"""32 ranks on one machine (issue 46): far more than its cores, as a big job's
control plane sees many ranks. The job trains, every rank's lines stay whole, and a
rank parked among them is stopped within --hang-timeout + 30 s and named, in a report
that stays a few lines (ranks in the same place said once). Slow: each starts 32
interpreters with torch (about a minute on 2 cores)."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from tests.conftest import run_cli

RANKS = 32
# Rank PARK (argv[1]) stops at step 5 and never comes back; it says when first.
SCRIPT = """
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
model = nn.parallel.DistributedDataParallel(nn.Linear(8, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
park = int(sys.argv[1])
for step in range(20):
    if step == 5 and rank == park:
        Path(sys.argv[2]).write_text(str(time.time()))
        time.sleep(3600)
    model(torch.randn(4, 8)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
print(f"rank {rank} of {world} trained " + "x" * 300, flush=True)
dist.destroy_process_group()
"""

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _run(tmp_path: Path, park: int, *flags: str) -> tuple[int, str, str]:
    script = tmp_path / "many.py"
    script.write_text(SCRIPT)
    proc = run_cli(
        *("run", "--nproc", str(RANKS), "--allow-oversubscribe", *flags),
        *(str(script), str(park), str(tmp_path / "parked")),
        timeout=500,
        env={"OMP_NUM_THREADS": "1"},
        cwd=tmp_path,
    )
    return proc.returncode, proc.stdout, proc.stderr


def test_32_ranks_train_and_every_line_stays_whole(tmp_path: Path) -> None:
    code, out, err = _run(tmp_path, -1)
    assert code == 0, err[-3000:]
    lines = [line for line in out.splitlines() if " trained " in line]
    assert sorted(lines) == sorted(
        f"[rank {rank}] rank {rank} of {RANKS} trained " + "x" * 300 for rank in range(RANKS)
    )


def test_a_parked_rank_among_32_is_stopped_and_named(tmp_path: Path) -> None:
    code, _, err = _run(tmp_path, 7, "--hang-timeout", "20")
    ended = time.time()
    assert code == 124, err[-3000:]
    assert ended - float((tmp_path / "parked").read_text()) < 20 + 30
    said = [line for line in err.splitlines() if line.startswith("ddpkit: the job is hung")]
    assert len(said) == 1 and "while rank 7 stayed at one line" in said[0], said
    # The 31 ranks that wait in the same place are said once, not 31 times.
    assert re.search(r"ranks 0-6, 8-31: in DDP's gradient all-reduce in backward\(\)", err), err[
        :3000
    ]
    assert err.count("--- Python stack of") <= 3, err.count("--- Python stack of")

"""Seeds of the ranks and of their loader workers: on 2 real ranks, no two (rank, epoch,
position) share a stream and a rerun draws the same; launch's ranks draw unseeded randomness
of their own, as under `ddpkit run`, and a seed the script set reaches every rank."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, cast

import pytest
import torch
import torch.distributed as dist

from ddpkit import DistContext, launch, prepare_loader
from tests.conftest import ROOT, run_cli


class _Noisy(torch.utils.data.Dataset[tuple[int, torch.Tensor]]):
    """A random augmentation: each fetch draws fresh noise from torch's stream."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor]:
        return i, torch.rand(())


def _draws(ctx: DistContext) -> list[Any]:
    loader = prepare_loader(_Noisy(), ctx, batch_size=2, shuffle=False, num_workers=2)
    mine = []
    for epoch in range(2):
        loader.set_epoch(epoch)
        for index, noise in loader:
            mine += [
                (ctx.rank, epoch, i, x) for i, x in zip(index.tolist(), noise.tolist(), strict=True)
            ]
    ranks: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(ranks, mine)
    return [draw for rank in ranks for draw in rank]


@pytest.mark.slow
def test_no_two_samples_of_any_rank_or_epoch_draw_the_same_noise() -> None:
    draws = launch(_draws, nprocs=2)
    assert len(draws) == 2 * 16  # each rank 8 samples a epoch, 2 epochs
    noises = [x for *_, x in draws]
    # Before the seeds were mixed, position p of epoch 1 drew what p+1 of epoch 0 drew.
    assert len(set(noises)) == len(noises)
    assert launch(_draws, nprocs=2) == draws  # and a rerun draws exactly the same


# -- unseeded randomness on launch's ranks (issue 42, item 5) ------------------------------

# Shaped like the DDP tutorial's scripts: a synthetic dataset from unseeded torch.rand, a
# shuffle from Python's random and noise from NumPy, drawn in the function every rank runs.
# "once" launches one job (what `ddpkit run` allows); "seeded" seeds in the script's main
# block first, as imagenet's main.py does before it starts its workers.
_DRAWS_SCRIPT = textwrap.dedent(
    """
    import json
    import random
    import sys

    import torch
    import torch.distributed as dist
    import ddpkit

    try:
        import numpy as np
    except ImportError:  # then NumPy's stream is not drawn
        np = None


    def draw():
        return (torch.rand(()).item(), random.random(), float(np.random.rand()) if np else 0.0)


    def job(ctx, seed):
        if seed is not None:  # the user seeds inside the function
            random.seed(seed)
            torch.manual_seed(seed)
            if np:
                np.random.seed(seed)
        mine = (draw(), torch.rand(8, 3).sum().item())  # the draws, then a dataset
        every = [None] * ctx.world_size
        dist.all_gather_object(every, mine)
        return every


    def seed_here():
        random.seed(5)
        torch.manual_seed(5)
        if np:
            np.random.seed(5)


    if __name__ == "__main__":
        if "seeded" in sys.argv:
            seed_here()
        if "once" in sys.argv:
            out = {"once": ddpkit.launch(job, None, nprocs=2)}
        else:
            out = {
                "fork": ddpkit.launch(job, None, nprocs=2),
                "fork again": ddpkit.launch(job, None, nprocs=2),
                "forkserver": ddpkit.launch(job, None, nprocs=2, start="forkserver"),
                "spawn": ddpkit.launch(job, None, nprocs=2, start="spawn"),
                "inside": ddpkit.launch(job, 7, nprocs=2),
            }
        if "seeded" in sys.argv:
            seed_here()
            # what every rank draws when each runs this script itself (ddpkit run)
            out["next"] = [(draw(), torch.rand(8, 3).sum().item())] * 2
        print("DRAWS " + json.dumps(out))
    """
)


def _draws_of(out: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert out.returncode == 0, out.stderr
    line = next(x for x in out.stdout.splitlines() if "DRAWS " in x)
    return cast(dict[str, Any], json.loads(line.split("DRAWS ", 1)[1]))


def _differ_on_every_stream(every: list[Any]) -> bool:
    (draw0, data0), (draw1, data1) = every
    streams = [0, 1, 2] if draw0[2] else [0, 1]  # NumPy's, where it is installed
    return data0 != data1 and all(draw0[s] != draw1[s] for s in streams)


@pytest.mark.slow
def test_unseeded_randomness_is_each_ranks_own_under_launch_as_under_run(
    tmp_path: Path,
) -> None:
    script = tmp_path / "synthetic.py"
    script.write_text(_DRAWS_SCRIPT)
    launched = _draws_of(
        subprocess.run(
            [sys.executable, str(script)], capture_output=True, text=True, timeout=240, cwd=ROOT
        )
    )
    for start in ("fork", "fork again", "forkserver", "spawn"):
        # Forked ranks drew the parent's (or the forkserver's) stream: the same dataset
        # and the same draws on every rank, unlike the same script under ddpkit run.
        assert _differ_on_every_stream(launched[start]), (start, launched[start])
    assert launched["fork"] != launched["fork again"]  # and each launch its own
    inside = launched["inside"]
    assert inside[0] == inside[1]  # seeded in the function: every rank alike

    run = _draws_of(run_cli("run", "--nproc", "2", str(script), "once", cwd=ROOT))
    assert _differ_on_every_stream(run["once"])  # what launch now matches


@pytest.mark.slow
def test_a_seed_set_before_launch_reaches_every_rank_as_under_run(tmp_path: Path) -> None:
    script = tmp_path / "seeded.py"
    script.write_text(_DRAWS_SCRIPT)
    launched = _draws_of(
        subprocess.run(
            [sys.executable, str(script), "seeded"],
            capture_output=True,
            text=True,
            timeout=240,
            cwd=ROOT,
        )
    )
    for start in ("fork", "forkserver", "spawn"):
        # Every rank starts from the script's seed, as each does under ddpkit run.
        assert launched[start] == launched["next"], start
    run = _draws_of(run_cli("run", "--nproc", "2", str(script), "once", "seeded", cwd=ROOT))
    assert run["once"] == run["next"] == launched["next"]

"""The matrix's `ddpkit run` column (issue 43): a script written for torchrun (its own
`init_process_group`, the Trainer on `DistContext.current()`), run by `ddpkit run` with
`--max-restarts` or `--audit=strict`, and stopped by preemption or a crash.

A preempted job (a SIGTERM to one worker: every rank saves after the same step and
exits 75) must end the whole run with 75, for the scheduler's requeue: never restarted
by `--max-restarts`, never made 3 by `--audit=strict`. A crash stays 1 under the strict
audit. Slow: each is a whole `ddpkit run` of 2 ranks (about 10 s).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from ddpkit.errors import PREEMPTED_EXIT
from tests.conftest import run_cli

# Ends as `sys.argv[2]` says: "preempted" (a SIGTERM reaches rank 1 after step 3 of the
# first attempt: a marker file says it came) or "crash" (rank 1 raises after step 3).
# A run that is restarted and trains to its end prints "trained to the end".
TORCHRUN_JOB = """
import os
import signal
import sys

import torch
import torch.distributed as dist
from torch import nn

import ddpkit


class Ending(ddpkit.Callback):
    def __init__(self, mark, ending):
        self.mark, self.ending = mark, ending

    def on_step_end(self, trainer, step):
        if step != 3 or trainer.ctx.rank != 1 or os.path.exists(self.mark):
            return
        open(self.mark, "w").close()
        if self.ending == "preempted":
            os.kill(os.getpid(), signal.SIGTERM)
        else:
            raise ValueError("a bad batch")


if __name__ == "__main__":
    folder, ending = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    ctx = ddpkit.DistContext.current()
    ddpkit.seed_everything(3)
    model = nn.Sequential(nn.Linear(6, 12), nn.Dropout(0.1), nn.Tanh(), nn.Linear(12, 2))
    x = torch.randn(96, 6, generator=torch.Generator().manual_seed(8))
    data = torch.utils.data.TensorDataset(x, (x[:, 0] > x[:, 1]).long())
    config = ddpkit.TrainConfig(epochs=30, batch_size=4, checkpoint_dir=folder, progress=False)
    trainer = ddpkit.Trainer(
        model, lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9), data, ctx, config,
        callbacks=[Ending(folder + ".mark", ending)], log_fn=lambda s: None,
    )
    try:
        trainer.fit()
    finally:
        dist.destroy_process_group()
    ddpkit.print("trained to the end")
"""

# Cells that fail on a known defect: xfail(strict=True) until its fix lands (as
# test_matrix.KNOWN_DEFECTS). None now: the preempted cells failed until the Trainer's
# fit routed the stop signals to its save where no launch worker had (a torchrun-style
# script's rank 1 died unsaved on the SIGTERM: --max-restarts restarted it, 0 != 75).
KNOWN_DEFECTS: dict[str, str] = {}


def _cell(flags: tuple[str, ...], ending: str, code: int, name: str) -> Any:
    reason = KNOWN_DEFECTS.get(name)
    marks = [] if reason is None else [pytest.mark.xfail(strict=True, reason=reason)]
    return pytest.param(flags, ending, code, marks=marks, id=name)


CELLS = [
    _cell(("--max-restarts", "2"), "preempted", PREEMPTED_EXIT, "restarts-preempted"),
    _cell(("--audit=strict",), "preempted", PREEMPTED_EXIT, "strict-preempted"),
    _cell(("--audit=strict",), "crash", 1, "strict-crash"),
    # --profile (issue 47): the verdict is said however the job ends.
    _cell(("--profile",), "preempted", PREEMPTED_EXIT, "profile-preempted"),
    _cell(("--profile",), "crash", 1, "profile-crash"),
]


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize(("flags", "ending", "code"), CELLS)
def test_run_ends_as_the_job_did(
    tmp_path: Path, flags: tuple[str, ...], ending: str, code: int
) -> None:
    script = tmp_path / "train.py"
    script.write_text(TORCHRUN_JOB)
    folder = tmp_path / "ck"
    out = run_cli(
        *("run", "--nproc", "2", *flags, str(script), str(folder), ending),
        timeout=120,
        env={"OMP_NUM_THREADS": "1"},
        cwd=tmp_path,
    )
    said = out.stdout + out.stderr
    assert (tmp_path / "ck.mark").exists(), said[-3000:]
    assert out.returncode == code, said[-3000:]
    assert "trained to the end" not in out.stdout, "the job was restarted and trained on"
    if ending == "preempted":
        assert list(folder.glob("ckpt-*")), f"no checkpoint saved in {folder}"
    if "--profile" in flags:
        # After a crash, the rank stopped before its first write is named, not measured.
        profiled = re.search(r"ddpkit profile: (\d) ranks?, ", out.stderr)
        assert profiled is not None, said[-3000:]
        if profiled.group(1) == "1":
            assert re.search(r"rank \d stopped before writing what it measured", out.stderr)

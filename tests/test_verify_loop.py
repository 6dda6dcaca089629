"""`ddpkit verify --loop`: a training loop written by hand with `prepare_model` and
`prepare_loader` (the README's and the port guide's path) is checked as a Job is: N
ranks against one process with N times the batch, on the samples the ranks fetched."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from ddpkit.errors import ConfigError
from ddpkit.verification import verify
from tests.conftest import ROOT

# The README's loop, as written there (its `if __name__` block runs nothing here).
README_LOOP = (ROOT / "README.md").read_text().split("```python\n", 1)[1].split("```", 1)[0]

# The port guide's script, after the port (the "+" side of its diff).
PORT_DIFF = (ROOT / "docs/port.md").read_text().split("```diff\n", 1)[1].split("```", 1)[0]
PORTED = "\n".join(line[1:] for line in PORT_DIFF.splitlines() if not line.startswith("-"))

# A loop an outsider writes: dict batches, random augmentation in __getitem__, a worker
# process per rank, dropout, AdamW with a per-step schedule, an eval loader.
OUTSIDER = """
import torch
from torch import nn
from torch.utils.data import Dataset

import ddpkit


class Noisy(Dataset):
    def __init__(self):
        self.x = torch.randn(96, 6)  # from the global RNG: seeded alike on every rank

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        x = self.x[i] + 0.1 * torch.randn(6)  # augmentation: each rank's own stream
        return {"x": x, "y": x.sum(0, keepdim=True)}


def main(ctx, epochs):
    ddpkit.seed_everything(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Dropout(0.1), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + 0.1 * s))
    model = ddpkit.prepare_model(model, ctx)
    SEED_PER_RANK
    data = Noisy()
    loader = ddpkit.prepare_loader(data, ctx, batch_size=8, num_workers=1)
    evals = ddpkit.prepare_loader(data, ctx, batch_size=8, evaluation=True)
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        for batch in loader:
            loss = nn.functional.mse_loss(model(batch["x"]), batch["y"])
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
    return len(evals)
"""


def _script(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def _verify_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ddpkit", "verify", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=300,
    )


def test_the_readme_loop_passes(tmp_path: Path) -> None:
    out = _verify_cli(
        "--loop", _script(tmp_path, "readme.py", README_LOOP) + ":main", "3", cwd=tmp_path
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.startswith(
        "PASS  equivalence: 2 processes x batch 32 vs 1 process x batch 64, 8 steps"
    )


def test_the_ported_tutorial_passes_and_a_per_rank_seed_fails(tmp_path: Path) -> None:
    good = _script(tmp_path, "ported.py", PORTED)
    out = _verify_cli("--loop", f"{good}:main", "10", "5", "32", cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "PASS  equivalence" in out.stdout
    # The planted bug: each rank seeds with its rank before making its random data.
    planted = PORTED.replace(
        "def load_train_objs():\n    torch.manual_seed(0)",
        "def load_train_objs(rank):\n    torch.manual_seed(rank)",
    )
    planted = planted.replace("load_train_objs()", "load_train_objs(ctx.rank)")
    assert planted.count("manual_seed(rank)") == 1 and "load_train_objs(ctx.rank)" in planted
    bad = _script(tmp_path, "planted.py", planted)
    out = _verify_cli("--loop", f"{bad}:main", "10", "5", "32", cwd=tmp_path)
    assert out.returncode == 1, out.stdout + out.stderr
    assert out.stdout.startswith("FAIL  equivalence")
    assert "the ranks build different datasets" in out.stdout
    assert "so the loop makes data that depends on the rank" in out.stdout


def test_an_outsiders_loop_passes_in_python_and_a_per_rank_seed_fails(tmp_path: Path) -> None:
    sys.path.insert(0, str(tmp_path))
    try:
        (tmp_path / "outsider_good.py").write_text(OUTSIDER.replace("SEED_PER_RANK", "pass"))
        report = verify(loop="outsider_good:main", loop_args=(50,), nproc=2, steps=6)
        assert report.passed, str(report)
        assert report.batch_size == 8 and report.steps == 6
        assert any("Dropout" in note for note in report.notes)
        bad = OUTSIDER.replace("SEED_PER_RANK", "torch.manual_seed(ctx.rank)")
        (tmp_path / "outsider_bad.py").write_text(bad)
        report = verify(loop="outsider_bad:main", loop_args=(50,), nproc=2, steps=6)
        assert not report.passed
        assert any("so the loop makes data that depends on the rank" in c for c in report.causes), (
            report.causes
        )
    finally:
        sys.path.remove(str(tmp_path))


def test_bad_loop_arguments_name_the_fix(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="verify checks a job or a loop"):
        verify()
    with pytest.raises(ConfigError, match="drop resume=True"):
        verify(loop="x.py:main", resume=True)
    out = _verify_cli("10", cwd=tmp_path)
    assert out.returncode == 2 and re.search("pass --loop FILE.py:main before them", out.stderr), (
        out.stderr
    )
    no_model = _script(tmp_path, "no_model.py", "def main(ctx):\n    pass\n")
    out = _verify_cli("--loop", f"{no_model}:main", cwd=tmp_path)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "builds one model with ddpkit.prepare_model" in out.stderr

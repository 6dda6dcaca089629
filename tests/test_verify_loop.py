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
from tests.test_readme import port_versions

# The README's loop, as written there (its `if __name__` block runs nothing here).
README_LOOP = (ROOT / "README.md").read_text().split("```python\n", 1)[1].split("```", 1)[0]


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


@pytest.mark.slow
def test_the_ported_tutorial_passes_and_a_per_rank_seed_fails(tmp_path: Path) -> None:
    # docs/port.md's diff applied to a script shaped like the tutorial's single_gpu.py:
    # its one-batch peek before set_epoch, main's arguments from its argparse block.
    _, ported, _ = port_versions(tmp_path)
    out = _verify_cli("--loop", "ported.py:main", "--", "10", "5", cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    # The script's own print of each pass, each rank's first, then verify's report.
    printed = out.stdout.splitlines()
    assert printed[0] == "[GPUcpu] Epoch 0 | Batchsize: 32 | Steps: 32"
    report = next(line for line in printed if not line.startswith("[GPU"))
    assert report.startswith(
        "PASS  equivalence: 2 processes x batch 32 vs 1 process x batch 64, 8 steps"
    )
    # The planted bug: each rank seeds with its rank before drawing the tutorial's
    # random dataset.
    planted = ported.replace(
        "def load_train_objs():\n    ddpkit.seed_everything(0)",
        "def load_train_objs(rank):\n    ddpkit.seed_everything(rank)",
    )
    planted = planted.replace("load_train_objs()", "load_train_objs(ctx.rank)")
    assert planted.count("seed_everything(rank)") == 1 and "load_train_objs(ctx.rank)" in planted
    (tmp_path / "planted.py").write_text(planted)
    out = _verify_cli("--loop", "planted.py:main", "--", "10", "5", cwd=tmp_path)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "\nFAIL  equivalence" in out.stdout
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


# -- loops as the DDP tutorial's scripts are written (issue 42) -------------------------
# Shaped like pytorch/examples' distributed/ddp-tutorial-series (written here): a Trainer
# class whose epoch first peeks at one batch for its size, a dataset module of its own,
# main's arguments from argparse in the `__main__` block.
TUTORIAL_DATA = """
import torch
from torch.utils.data import Dataset


class Pairs(Dataset):
    def __init__(self, size):
        self.size = size
        self.data = [(torch.rand(12), torch.rand(3)) for _ in range(size)]

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        x, y = self.data[index]
        return x + 0.05 * torch.randn(12), y  # augmentation: each rank's own stream
"""

TUTORIAL_LOOP = """
import argparse

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import ddpkit
from pairs import Pairs


class Trainer:
    def __init__(self, model, train_data, optimizer, ctx):
        self.gpu_id = ctx.device
        self.model = ddpkit.prepare_model(model, ctx)
        self.train_data = ddpkit.prepare_loader(train_data, ctx)
        self.optimizer = optimizer
        self.sched = torch.optim.lr_scheduler.StepLR(optimizer, 3, 0.5)

    def _run_batch(self, source, targets):
        self.optimizer.zero_grad()
        loss = LOSS
        loss.backward()
        self.optimizer.step()
        self.sched.step()

    def _run_epoch(self, epoch):
        b_sz = len(next(iter(self.train_data))[0])
        steps = len(self.train_data)
        print(f"[GPU{self.gpu_id}] Epoch {epoch} | Batchsize: {b_sz} | Steps: {steps}")
        self.train_data.set_epoch(epoch)
        for source, targets in self.train_data:
            self._run_batch(source.to(self.gpu_id), targets.to(self.gpu_id))

    def train(self, max_epochs):
        for epoch in range(max_epochs):
            self._run_epoch(epoch)


def main(ctx, ARGS):
    ddpkit.seed_everything(0)
    dataset = Pairs(40)
    layers = [torch.nn.Linear(12, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 3)]
    model = torch.nn.Sequential(*layers)
    optimizer = OPTIM
    loader = DataLoader(dataset, batch_size=BATCH, pin_memory=True, shuffle=True)
    Trainer(model, loader, optimizer, ctx).train(EPOCHS)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="simple distributed training job")
    parser.add_argument("total_epochs", type=int, help="Total epochs to train the model")
    parser.add_argument("save_every", type=int, help="How often to save a snapshot")
    parser.add_argument("--batch_size", default=32, type=int, help="Input batch size")
    args = parser.parse_args()
    LAUNCH
"""

MSE = "F.mse_loss(self.model(source), targets)"


def _tutorial(tmp_path: Path, name: str, **parts: str) -> str:
    (tmp_path / "pairs.py").write_text(TUTORIAL_DATA)
    text = TUTORIAL_LOOP
    defaults = {"LOSS": MSE, "OPTIM": "torch.optim.AdamW(model.parameters(), lr=1e-2)"}
    for key, value in {**defaults, **parts}.items():
        text = text.replace(key, value)
    return _script(tmp_path, name, text)


@pytest.mark.slow
def test_a_loop_that_peeks_at_a_batch_before_set_epoch_passes(tmp_path: Path) -> None:
    # The tutorial's `b_sz = len(next(iter(self.train_data))[0])` starts a pass it drops
    # after one batch; before, the samples of the pass after it were looked up under the
    # wrong occurrence (FileNotFoundError 'verify recorded no sample ...').
    script = _tutorial(
        tmp_path,
        "peek.py",
        ARGS="total_epochs, batch_size",
        BATCH="batch_size",
        EPOCHS="total_epochs",
        LAUNCH="ddpkit.launch(main, args.total_epochs, args.batch_size)",
    )
    sys.path.insert(0, str(tmp_path))
    try:
        report = verify(loop=f"{script}:main", loop_args=(4, 6), steps=9)  # 4 steps an epoch
    finally:
        sys.path.remove(str(tmp_path))
    assert report.passed, str(report)
    assert report.batch_size == 6 and report.steps == 9


@pytest.mark.slow
def test_a_main_that_takes_the_argparse_namespace_gets_it_from_the_main_block(
    tmp_path: Path,
) -> None:
    # `python peek.py 3 1 --batch_size 5` calls ddpkit.launch(main, args): verify runs the
    # script's __main__ block with those arguments to learn what main takes. Before, the
    # arguments went to main(ctx, 3, 1, ...) as literals (TypeError: main() takes 2
    # positional arguments but ...).
    script = _tutorial(
        tmp_path,
        "namespace.py",
        ARGS="args",
        BATCH="args.batch_size",
        EPOCHS="args.total_epochs",
        LAUNCH="ddpkit.launch(main, args)",
    )
    out = _verify_cli(
        "--loop",
        f"{script}:main",
        "--steps",
        "5",
        "--",
        "3",
        "1",
        "--batch_size",
        "5",
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "\nPASS  equivalence: 2 processes x batch 5 vs 1 process x batch 10, 5 steps" in (
        out.stdout
    ), out.stdout
    assert "Batchsize: 10" in out.stdout  # the one process's peek: twice the batch
    # The script's own parser refuses what it cannot take, in its words, then ddpkit's line.
    out = _verify_cli("--loop", f"{script}:main", "three", cwd=tmp_path)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "invalid int value: 'three'" in out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith("ddpkit: error: ")
    assert "Traceback" not in out.stderr


def test_a_main_block_that_calls_main_itself_is_refused_naming_its_line(tmp_path: Path) -> None:
    # The one-GPU script, not yet ported: its __main__ block calls main(device, ...).
    script = _tutorial(
        tmp_path,
        "unported.py",
        ARGS="args",
        BATCH="args.batch_size",
        EPOCHS="args.total_epochs",
        LAUNCH="main(0, args)",
    )
    line = TUTORIAL_LOOP.replace("LOSS", MSE).splitlines().index("    LAUNCH") + 1
    out = _verify_cli("--loop", f"{script}:main", "3", "1", cwd=tmp_path)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    assert f"unported.py:{line} calls main(...) itself" in out.stderr, out.stderr
    assert "ddpkit.launch(main, ...)" in out.stderr


OWN_LOADER = """
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

import ddpkit
from pairs import Pairs


def prepare_dataloader(dataset, batch_size):
    return DataLoader(
        dataset, batch_size=batch_size, pin_memory=True, ORDER
    )


def main(ctx, epochs):
    ddpkit.seed_everything(0)
    dataset = Pairs(36)
    model = ddpkit.prepare_model(torch.nn.Linear(12, 3), ctx)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    train_data = prepare_dataloader(dataset, 6)
    for epoch in range(epochs):
        getattr(train_data.sampler, "set_epoch", print)(epoch)
        for source, targets in train_data:
            optimizer.zero_grad()
            F.smooth_l1_loss(model(source), targets).backward()
            optimizer.step()
"""


@pytest.mark.slow
def test_a_loop_with_its_own_distributed_sampler_and_dataloader_passes(tmp_path: Path) -> None:
    # The tutorial's multigpu.py builds DataLoader(..., sampler=DistributedSampler(dataset)):
    # verify takes it as the training loader. Before: 'mat1 and mat2 must have the same
    # dtype, but got Float and Double' from the model's forward.
    (tmp_path / "pairs.py").write_text(TUTORIAL_DATA)
    script = _script(
        tmp_path,
        "own.py",
        OWN_LOADER.replace("ORDER", "shuffle=False, sampler=DistributedSampler(dataset)"),
    )
    out = _verify_cli("--loop", f"{script}:main", "3", "--steps", "7", cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.startswith(
        "PASS  equivalence: 2 processes x batch 6 vs 1 process x batch 12, 7 steps"
    ), out.stdout


@pytest.mark.slow
def test_a_loop_with_a_dataloader_that_verify_cannot_see_is_refused_naming_its_line(
    tmp_path: Path,
) -> None:
    # Without a DistributedSampler every rank reads all of the data: nothing to replay.
    (tmp_path / "pairs.py").write_text(TUTORIAL_DATA)
    script = _script(tmp_path, "whole.py", OWN_LOADER.replace("ORDER", "shuffle=True"))
    line = OWN_LOADER.splitlines().index("    return DataLoader(") + 1
    for dtype in ("float64", "float32"):
        out = _verify_cli("--loop", f"{script}:main", "3", "--dtype", dtype, cwd=tmp_path)
        assert out.returncode == 2, out.stdout + out.stderr
        assert "Traceback" not in out.stderr, out.stderr
        assert f"whole.py:{line}" in out.stderr, out.stderr
        assert "ddpkit.prepare_loader(loader, ctx)" in out.stderr, out.stderr


# -- a run in which nothing trained proves nothing ----------------------------------------


@pytest.mark.slow
def test_a_loop_whose_loss_is_always_zero_proves_nothing(tmp_path: Path) -> None:
    # The tutorial's loss: cross entropy over one logit is 0 whatever the model does.
    # Before: 'PASS ... largest difference: 0 after step 0', exit 0.
    script = _tutorial(
        tmp_path,
        "zero.py",
        ARGS="total_epochs, batch_size",
        BATCH="batch_size",
        EPOCHS="total_epochs",
        LAUNCH="ddpkit.launch(main, args.total_epochs, args.batch_size)",
        LOSS="F.cross_entropy(self.model(source)[:, :1], targets[:, 0].long())",
        OPTIM="torch.optim.SGD(model.parameters(), lr=1e-3)",  # no weight decay
    )
    out = _verify_cli(
        "--loop",
        f"{script}:main",
        "--steps",
        "3",
        "--",
        "2",
        "1",
        "--batch_size",
        "8",
        cwd=tmp_path,
    )
    from ddpkit.cli.verify import NOTHING_TRAINED_EXIT

    assert out.returncode == NOTHING_TRAINED_EXIT, out.stdout + out.stderr
    assert NOTHING_TRAINED_EXIT not in (0, 1, 2)
    assert "\nNO PROOF  equivalence: 2 processes x batch 8" in out.stdout, out.stdout
    assert "no parameter changed in 3 steps" in out.stdout, out.stdout

"""Preemption: SIGTERM at random moments of a 2-rank `ddpkit train` job, sent to the
launcher or to one worker. Every resumed run must end with the uninterrupted run's
model, with no orphan process and no partial checkpoint."""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

import pytest
import torch
from torch import nn

import ddpkit
from ddpkit import DistContext, TrainConfig, Trainer, launch
from ddpkit.errors import PREEMPTED_EXIT, Preempted, WorkerError
from tests.conftest import run_cli, wait_for_files, wait_gone

EPOCHS = 24
LINEAR_JOB = ("train", "--example", "linear", "--nproc", "2", "--epochs", str(EPOCHS), "--json")
TRIALS = 6


def _bare(line: str) -> str:
    """`line` without the `[rank N] ` that `ddpkit run` puts before each rank's line."""
    return re.sub(r"^\[rank \d+\] ", "", line)


def _digest(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 0, proc.stderr
    return str(json.loads(_bare(proc.stdout.strip().splitlines()[-1]))["model_digest"])


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> str:
    folder = tmp_path_factory.mktemp("straight")
    return _digest(run_cli(*LINEAR_JOB, "--checkpoint-dir", str(folder)))


def _workers(parent: int) -> list[int]:
    """The ranks of `parent`, forked or spawned (not multiprocessing's resource tracker)."""
    found = subprocess.run(["pgrep", "-P", str(parent)], capture_output=True, text=True)
    pids = [int(p) for p in found.stdout.split()]
    return [p for p in pids if b"resource_tracker" not in Path(f"/proc/{p}/cmdline").read_bytes()]


def _line_after_start(stdout: IO[str]) -> str:
    """The line after the Trainer's start line ("training: 2 processes ...")."""
    line = _bare(stdout.readline())
    assert line.startswith("training: "), line
    return _bare(stdout.readline())


def _interrupt(folder: Path, rng: random.Random, target: str) -> tuple[int, bool]:
    """Start the job, SIGTERM its launcher, one worker or every process (as SLURM does)
    at a random moment of training; once every process of it is gone, return its exit
    status and whether its last epoch had ended."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "ddpkit", *LINEAR_JOB, "--checkpoint-dir", str(folder)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    first = _line_after_start(proc.stdout)  # the first epoch line: training has started
    assert first.startswith("epoch 1/"), first + proc.communicate()[1]
    started = time.monotonic()
    second = proc.stdout.readline()
    assert second.startswith("epoch 2/"), second + proc.communicate()[1]
    workers = _workers(proc.pid)
    assert len(workers) == 2
    # A moment inside the training that is left, measured on this machine from one
    # epoch's time rather than assumed: a fast machine must not finish before the signal.
    left = (EPOCHS - 2) * (time.monotonic() - started)
    time.sleep(rng.uniform(0.0, 0.8 * left))
    with contextlib.suppress(ProcessLookupError):  # it may have finished
        if target == "every-process":  # as SLURM signals every process of the job
            for pid in [proc.pid, *workers]:
                os.kill(pid, signal.SIGTERM)
        else:
            os.kill(rng.choice(workers) if target == "one-worker" else proc.pid, signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert wait_gone(workers) == [], "orphan worker"
    if proc.returncode == PREEMPTED_EXIT:
        assert "--resume" in err and "saved" in err, err
    return proc.returncode, f"epoch {EPOCHS}/{EPOCHS}" in out


@pytest.mark.slow
@pytest.mark.timeout(900)  # ten interrupted runs and ten resumed ones
@pytest.mark.parametrize(
    ("target", "trials"), [("launcher", TRIALS), ("one-worker", TRIALS), ("every-process", 3)]
)
def test_sigterm_at_random_moments_resumes_to_the_uninterrupted_model(
    straight: str, tmp_path: Path, target: str, trials: int
) -> None:
    rng = random.Random(target)
    codes = []
    for trial in range(trials):
        folder = tmp_path / f"trial{trial}"
        code, finished = _interrupt(folder, rng, target)
        codes.append(code)
        # A signal while the ranks still train must save and exit 75, whichever
        # process it reached.
        assert code == PREEMPTED_EXIT or finished, (trial, code)
        names = [p.name for p in folder.iterdir()] if folder.exists() else []
        assert all(n.startswith("ckpt-") and n.endswith(".pt") for n in names if n != "ddpkit.lock")
        for name in names:
            if name.endswith(".pt"):  # every checkpoint is whole
                torch.load(folder / name, weights_only=True)
        resumed = run_cli(*LINEAR_JOB, "--checkpoint-dir", str(folder), "--resume")
        assert _digest(resumed) == straight, (trial, codes)
    # After the last epoch, once the ranks no longer listen: 0 (nothing left to stop),
    # 143, 1 (a worker that got it exits 143, a failed rank to the launcher) or -15 (in
    # the last moments of the interpreter's exit, which restores the default handlers).
    # Whatever the moment, the resume above matched.
    assert set(codes) <= {0, PREEMPTED_EXIT, 1, 143, -signal.SIGTERM}, codes
    assert codes.count(PREEMPTED_EXIT) >= trials // 2, codes  # most stopped mid-training


# -- in Python: launch() raises Preempted ----------------------------------------------
class _SignalAtStep(ddpkit.Callback):
    """The rank given sends itself `signum` after step `step`."""

    def __init__(self, rank: int, signum: int, step: int = 5) -> None:
        self.rank, self.signum, self.step = rank, signum, step

    def on_step_end(self, trainer: Trainer, step: int) -> None:
        if step == self.step and trainer.ctx.rank == self.rank:
            os.kill(os.getpid(), self.signum)


def _fit_linear(
    ctx: DistContext,
    folder: str | None,
    callback: ddpkit.Callback,
    samples: int,
    epochs: int,
    resume: bool = False,
) -> int:
    """Fit a small regression with `callback`, checkpointing into `folder`; the steps."""
    ddpkit.seed_everything(0)
    model = nn.Linear(4, 1)
    x = torch.randn(samples, 4)
    trainer = Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.01),
        torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)),
        ctx,
        TrainConfig(
            epochs=epochs, batch_size=8, checkpoint_dir=folder, progress=False, resume=resume
        ),
        loss_fn=nn.functional.mse_loss,
        callbacks=[callback],
        log_fn=lambda s: None,
    )
    trainer.fit()
    return trainer.global_step


def _fit_signalled(ctx: DistContext, folder: str | None, rank: int, signum: int) -> int:
    # Epochs enough that the ranks' vote (every 0.1 s of steps) comes long before the end.
    return _fit_linear(ctx, folder, _SignalAtStep(rank, signum), samples=256, epochs=200)


@pytest.mark.parametrize(
    ("nprocs", "rank", "signum", "step"),
    [
        (1, 0, signal.SIGTERM, 5),  # one process: no vote to wait for
        (2, 1, signal.SIGUSR1, 6),  # the vote is read a vote later: after step 6 or more
        # Ctrl-C reaches the launcher alone (the workers have a process group of their
        # own): a SIGINT that reaches one worker was sent to it, and it saves too.
        (2, 1, signal.SIGINT, 6),
    ],
)
def test_launch_raises_preempted_after_every_rank_saved_the_same_step(
    tmp_path: Path, nprocs: int, rank: int, signum: int, step: int
) -> None:
    with pytest.raises(Preempted) as info:
        launch(_fit_signalled, str(tmp_path), rank, signum, nprocs=nprocs)
    err = info.value
    assert err.signum == signum
    assert err.step == step if nprocs == 1 else step <= err.step < 200 * 16
    assert err.checkpoint == tmp_path / f"ckpt-{err.step:09d}.pt"
    assert torch.load(err.checkpoint, weights_only=True)["global_step"] == err.step


def _fit_signalled_at_the_end(ctx: DistContext, folder: str, resume: bool) -> int:
    # 64 samples on 2 ranks in batches of 8: 4 steps an epoch, so step 8 ends the fit.
    return _fit_linear(ctx, folder, _SignalAtStep(1, signal.SIGTERM, 8), 64, 2, resume)


def test_a_signal_at_the_last_step_still_stops_the_job_to_be_requeued(tmp_path: Path) -> None:
    # The ranks vote on a signal a vote later, and the last step leaves no later vote: the
    # end of fit votes once more. Without it the signal was forgotten, fit returned, and
    # the job went on (a script's next phase) until the scheduler's SIGKILL, never requeued.
    with pytest.raises(Preempted) as info:
        launch(_fit_signalled_at_the_end, str(tmp_path), False, nprocs=2)
    assert (info.value.signum, info.value.step) == (signal.SIGTERM, 8)
    assert info.value.checkpoint == tmp_path / "ckpt-000000008.pt"
    assert torch.load(info.value.checkpoint, weights_only=True)["global_step"] == 8
    # Requeued, it resumes with nothing left to train.
    assert launch(_fit_signalled_at_the_end, str(tmp_path), True, nprocs=2) == 8


SCRIPT_JOB = """
import os
import signal
import sys

import torch
from torch import nn

import ddpkit


class SignalTheJob(ddpkit.Callback):
    def on_step_end(self, trainer, step):
        if step == 5 and trainer.ctx.rank == 0:  # as a scheduler would: to the job's process
            signum = getattr(signal, sys.argv[3])
            os.kill(os.getppid() if trainer.ctx.world_size > 1 else os.getpid(), signum)


def main(ctx, folder):
    ddpkit.seed_everything(0)
    model = nn.Linear(4, 1)
    x = torch.randn(256, 4)
    # Epochs enough that the signal, passed on by the launcher, comes long before the end.
    config = ddpkit.TrainConfig(epochs=50, batch_size=8, checkpoint_dir=folder, progress=False)
    data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    trainer = ddpkit.Trainer(
        model, optimizer, data, ctx, config, loss_fn=nn.functional.mse_loss,
        callbacks=[SignalTheJob()], log_fn=lambda s: None,
    )
    trainer.fit()


if __name__ == "__main__":
    ddpkit.launch(main, sys.argv[1], nprocs=int(sys.argv[2]))
    print("the job went on after launch")
"""


@pytest.mark.parametrize(
    ("nprocs", "name"),
    [(1, "SIGTERM"), (2, "SIGTERM"), (2, "SIGUSR1"), (1, "SIGINT"), (2, "SIGINT")],
)
def test_a_preempted_script_exits_75_with_one_line(tmp_path: Path, nprocs: int, name: str) -> None:
    # `python script.py`, where nothing catches Preempted: SLURM's requeue needs 75.
    # The line names the signal that reached the launcher, which passes that one on.
    script = tmp_path / "job.py"
    script.write_text(SCRIPT_JOB)
    folder = tmp_path / "ck"
    proc = subprocess.run(
        [sys.executable, str(script), str(folder), str(nprocs), name],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == PREEMPTED_EXIT, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    said = [line for line in proc.stderr.splitlines() if line.startswith("ddpkit: ")]
    if name == "SIGINT":  # Ctrl-C: what it does is said once, by the process it reached
        notices = [line for line in said if "press Ctrl-C again to stop at once" in line]
        assert len(notices) == 1, proc.stderr
        said.remove(notices[0])
    assert len(said) == 1, proc.stderr
    # The launcher passes the signal on while the ranks train: the step may come later.
    found = re.fullmatch(
        rf"ddpkit: stopped by {name} after step (\d+); saved (.+): resume from it "
        r"\(with ddpkit train: the same command and --resume\)",
        said[0],
    )
    assert found, said
    step, saved = int(found[1]), Path(found[2])
    assert step >= 5 and saved == folder / f"ckpt-{step:09d}.pt"
    assert torch.load(saved, weights_only=True)["global_step"] == step
    assert "went on" not in proc.stdout


SIGNALS_AT_ONCE_JOB = """
import os
import signal
import sys
import time

import torch
from torch import nn

import ddpkit


class TermThenCtrlC(ddpkit.Callback):
    # After step 5 a SIGTERM reaches rank 1 alone (a scheduler's, say), and once rank 1
    # has it, the user presses Ctrl-C: it reaches the launching process.
    def __init__(self, folder):
        self.mark = os.path.join(folder + "-marks", "rank1-got-sigterm")

    def on_step_end(self, trainer, step):
        if step == 5 and trainer.ctx.rank == 1:
            os.kill(os.getpid(), signal.SIGTERM)
            open(self.mark, "w").close()
        if step == 5 and trainer.ctx.rank == 0:
            while not os.path.exists(self.mark):
                time.sleep(0.01)
            os.kill(os.getppid(), signal.SIGINT)


def main(ctx, folder):
    ddpkit.seed_everything(0)
    model = nn.Linear(4, 1)
    x = torch.randn(256, 4)
    config = ddpkit.TrainConfig(epochs=50, batch_size=8, checkpoint_dir=folder, progress=False)
    data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    trainer = ddpkit.Trainer(
        model, optimizer, data, ctx, config, loss_fn=nn.functional.mse_loss,
        callbacks=[TermThenCtrlC(folder)], log_fn=lambda s: None,
    )
    trainer.fit()


if __name__ == "__main__":
    os.makedirs(sys.argv[1] + "-marks")
    ddpkit.launch(main, sys.argv[1], nprocs=2)
"""


def test_the_stop_line_names_the_signal_that_reached_the_launching_process(
    tmp_path: Path,
) -> None:
    # Rank 1 already saves on its SIGTERM when the Ctrl-C that the launcher passes on
    # reaches it: that is the first Ctrl-C, not a second one (which stops at once). The
    # ranks then agree on one signal each (the largest number), and the line names the
    # Ctrl-C that the user pressed, which reached the launching process.
    script = tmp_path / "job.py"
    script.write_text(SIGNALS_AT_ONCE_JOB)
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "ck")],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == PREEMPTED_EXIT, proc.stderr
    stops = [line for line in proc.stderr.splitlines() if line.startswith("ddpkit: stopped by")]
    assert len(stops) == 1, proc.stderr
    assert stops[0].startswith("ddpkit: stopped by SIGINT after step "), proc.stderr


def test_without_a_checkpoint_folder_a_signal_stops_at_once() -> None:
    with pytest.raises(WorkerError, match="SystemExit: 143"):
        launch(_fit_signalled, None, 1, signal.SIGTERM, nprocs=2)


# -- ddpkit run: torchrun's agent --------------------------------------------------------
RUN_JOB = """
import sys

import ddpkit
from ddpkit.checkpoint.digest import model_digest
from ddpkit.training.job import build_job


def main(ctx, folder, resume):
    config = ddpkit.TrainConfig(epochs=30, checkpoint_dir=folder, resume=resume, progress=False)
    trainer = build_job(ctx, "linear", config).trainer(ctx, config)
    trainer.fit()
    ddpkit.print("digest", model_digest(trainer.model))


if __name__ == "__main__":
    ddpkit.launch(main, sys.argv[1], len(sys.argv) > 2)
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    ("signum", "to_worker"),
    [
        (signal.SIGUSR1, False),
        (signal.SIGTERM, True),
        (signal.SIGINT, False),
        (signal.SIGINT, True),
    ],
    ids=["usr1-agent", "term-worker", "int-agent", "int-worker"],
)
def test_ddpkit_run_saves_on_a_signal_and_resumes(
    tmp_path: Path, signum: int, to_worker: bool
) -> None:
    script = tmp_path / "job.py"
    script.write_text(RUN_JOB)
    folder = str(tmp_path / "ck")
    cmd = [sys.executable, "-m", "ddpkit", "run", "--nproc", "2", str(script), folder]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    assert _line_after_start(proc.stdout).startswith("epoch 1/")
    found = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True)
    workers = [int(p) for p in found.stdout.split()]
    assert len(workers) == 2
    os.kill(workers[1] if to_worker else proc.pid, signum)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == PREEMPTED_EXIT, err
    assert "saved" in err and "ckpt-" in err
    assert f"stopped by {signal.Signals(signum).name} after step" in err, err
    assert wait_gone(workers) == []
    resumed = subprocess.run([*cmd, "resume"], capture_output=True, text=True, timeout=240)
    straight = subprocess.run(
        [*cmd[:-1], str(tmp_path / "b")], capture_output=True, text=True, timeout=240
    )
    assert resumed.returncode == straight.returncode == 0, resumed.stderr + straight.stderr
    assert resumed.stdout.splitlines()[-1] == straight.stdout.splitlines()[-1]
    assert _bare(resumed.stdout.splitlines()[-1]).startswith("digest ")


@pytest.mark.slow
def test_ctrl_c_saves_and_says_how_to_continue(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "ddpkit", *LINEAR_JOB, "--checkpoint-dir", str(tmp_path)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    assert _line_after_start(proc.stdout).startswith("epoch 1/")
    workers = _workers(proc.pid)
    os.kill(proc.pid, signal.SIGINT)  # a terminal sends it to all; the workers ignore it
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == PREEMPTED_EXIT, err
    assert err.count("Ctrl-C again to stop at once") == 1, err  # said once, not per process
    assert err.count("ddpkit: stopped by SIGINT after step") == 1, err
    assert f"to continue: ddpkit {' '.join(LINEAR_JOB)} --checkpoint-dir {tmp_path} --resume" in err
    assert wait_gone(workers) == []
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


class _StuckAfterTheSignal(ddpkit.Callback):
    """A rank that never reaches its save once a stop signal has come."""

    def on_step_end(self, trainer: Trainer, step: int) -> None:
        from ddpkit.inrank.preemption import requested

        if requested():
            time.sleep(600)


def _fit_stuck(ctx: DistContext, folder: str) -> None:
    _fit_linear(ctx, folder, _StuckAfterTheSignal(), samples=4096, epochs=1000)


@pytest.mark.slow
def test_ranks_that_cannot_save_within_the_grace_are_stopped_and_the_last_checkpoint_stays(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    import threading

    def signal_once_saved() -> None:
        deadline = time.monotonic() + 120
        while not list(tmp_path.glob("ckpt-*.pt")) and time.monotonic() < deadline:
            time.sleep(0.1)
        os.kill(os.getpid(), signal.SIGTERM)  # to the launcher: this process

    threading.Thread(target=signal_once_saved, daemon=True).start()
    start = time.monotonic()
    with pytest.raises(SystemExit) as info:
        launch(_fit_stuck, str(tmp_path), nprocs=2, signal_grace=2)
    assert info.value.code == 128 + signal.SIGTERM
    assert time.monotonic() - start < 120
    assert "did not save and stop within 2 s" in capfd.readouterr().err
    names = sorted(p.name for p in tmp_path.iterdir() if p.name != "ddpkit.lock")
    assert names and all(n.startswith("ckpt-") and n.endswith(".pt") for n in names), names
    for name in names:  # the epoch checkpoints are whole; nothing half-written is left
        torch.load(tmp_path / name, weights_only=True)


def test_a_second_ctrl_c_stops_at_once(tmp_path: Path) -> None:
    import threading

    def press_twice() -> None:
        deadline = time.monotonic() + 120
        while not list(tmp_path.glob("ckpt-*.pt")) and time.monotonic() < deadline:
            time.sleep(0.1)
        for _ in range(2):  # the ranks are stuck after the first: they never save
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.5)

    threading.Thread(target=press_twice, daemon=True).start()
    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        launch(_fit_stuck, str(tmp_path), nprocs=2)  # signal_grace: the default 60 s
    assert time.monotonic() - start < 60


@pytest.mark.slow
def test_the_sbatch_command_saves_on_usr1_and_its_requeued_run_resumes(
    straight: str, tmp_path: Path
) -> None:
    # docs/slurm/train.sbatch runs `ddpkit run -m ddpkit train ... --resume` each time.
    train = [*LINEAR_JOB, "--checkpoint-dir", str(tmp_path), "--resume"]
    cmd = [sys.executable, "-m", "ddpkit", "run", "--nproc", "2", "-m", "ddpkit", *train]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    assert _bare(proc.stdout.readline()).startswith("no checkpoint in")  # the first run
    assert _line_after_start(proc.stdout).startswith("epoch 1/")
    os.kill(proc.pid, signal.SIGUSR1)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == PREEMPTED_EXIT, err
    assert err.count("ddpkit: stopped by SIGUSR1 after step") == 1, err  # said once
    requeued = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert _digest(requeued) == straight


@pytest.mark.slow
@pytest.mark.parametrize("checkpoints", [True, False], ids=["with-checkpoints", "without"])
def test_ctrl_c_that_stops_at_once_names_the_newest_checkpoint_or_says_none(
    tmp_path: Path, checkpoints: bool
) -> None:
    folder = tmp_path / "ck"
    cmd = [sys.executable, "-m", "ddpkit", *LINEAR_JOB, "--on-signal", "stop"]
    if checkpoints:
        cmd += ["--checkpoint-dir", str(folder)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    assert _line_after_start(proc.stdout).startswith("epoch 1/")
    assert proc.stdout.readline().startswith("epoch 2/")  # epoch 1's checkpoint is written
    os.kill(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    last = err.strip().splitlines()[-1]
    if checkpoints:
        newest = sorted(folder.glob("ckpt-*.pt"))[-1]
        assert last.startswith(f"ddpkit: interrupted; the newest checkpoint is {newest}; ")
        assert last.endswith(f"--checkpoint-dir {folder} --resume"), last
    else:
        assert last == (
            "ddpkit: interrupted; nothing was saved (no --checkpoint-dir): "
            "pass --checkpoint-dir DIR to resume later"
        )


# -- a stop signal while the job starts, before its first training step ------------------
STARTING_JOB = """
import os
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit


def build(ctx):
    # A job that reads its data for a long while: the test signals it meanwhile.
    Path(os.environ["MARKS"], f"rank{ctx.rank}").write_text(str(os.getpid()))
    time.sleep(120)
    model = nn.Linear(4, 1)
    x = torch.randn(64, 4)
    return ddpkit.Job(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.01),
        train_set=TensorDataset(x, x.sum(1, keepdim=True)),
        loss_fn=nn.functional.mse_loss,
    )


def main(ctx, folder):
    from ddpkit.training.job import build_job

    config = ddpkit.TrainConfig(epochs=2, batch_size=8, checkpoint_dir=folder, progress=False)
    build_job(ctx, build, config).trainer(ctx, config).fit()


if __name__ == "__main__":
    ddpkit.launch(main, sys.argv[1], nprocs=int(sys.argv[2]))
    print("the job went on after launch")
"""

STARTING_LINE = (
    "ddpkit: stopped by {name} while the job was starting, before its first training "
    "step: nothing was lost; start it again with the same command"
)


def _stop_while_starting(
    cmd: list[str], marks: Path, nprocs: int, signum: int, target: str
) -> tuple[subprocess.CompletedProcess[str], list[int]]:
    """Run `cmd`, and once every rank builds its job, send `signum` to the launching
    process, to every process of the job (as SLURM does) or to the last rank alone
    ("one-worker"); the finished process and the pids of its ranks."""
    marks.mkdir()
    env = {**os.environ, "MARKS": str(marks)}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    files = [marks / f"rank{r}" for r in range(nprocs)]
    try:
        wait_for_files(files, within=120)
    except BaseException:
        proc.kill()
        raise
    ranks = [int(f.read_text()) for f in files]
    pids = {"every-process": [proc.pid, *ranks], "one-worker": ranks[-1:]}.get(target, [proc.pid])
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)
    out, err = proc.communicate(timeout=60)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err), ranks


@pytest.mark.parametrize(
    ("signum", "target", "checkpoints"),
    [
        (signal.SIGTERM, "launcher", True),
        (signal.SIGTERM, "every-process", True),
        (signal.SIGUSR1, "launcher", False),
    ],
    ids=["term-launcher", "term-every-process", "usr1-no-checkpoints"],
)
def test_ddpkit_train_stopped_while_starting_exits_75_with_one_line(
    tmp_path: Path, signum: int, target: str, checkpoints: bool
) -> None:
    job = tmp_path / "slowjob.py"
    job.write_text(STARTING_JOB)
    cmd = [sys.executable, "-m", "ddpkit", "train", "--job", f"{job}:build", "--nproc", "2"]
    if checkpoints:
        cmd += ["--checkpoint-dir", str(tmp_path / "ck")]
    proc, ranks = _stop_while_starting(cmd, tmp_path / "marks", 2, signum, target)
    assert proc.returncode == PREEMPTED_EXIT, proc.stderr
    said = [line for line in proc.stderr.splitlines() if line.strip()]
    assert said == [STARTING_LINE.format(name=signal.Signals(signum).name)], proc.stderr
    assert wait_gone(ranks) == []
    if checkpoints:
        assert not list((tmp_path / "ck").glob("ckpt-*"))  # nothing to save: no step


@pytest.mark.parametrize("nprocs", [1, 2])
def test_a_script_stopped_while_starting_exits_75_with_one_line(
    tmp_path: Path, nprocs: int
) -> None:
    script = tmp_path / "job.py"
    script.write_text(STARTING_JOB)
    cmd = [sys.executable, str(script), str(tmp_path / "ck"), str(nprocs)]
    proc, ranks = _stop_while_starting(cmd, tmp_path / "marks", nprocs, signal.SIGTERM, "launcher")
    assert proc.returncode == PREEMPTED_EXIT, proc.stderr
    said = [line for line in proc.stderr.splitlines() if line.strip()]
    assert said == [STARTING_LINE.format(name="SIGTERM")], proc.stderr
    assert "went on" not in proc.stdout
    assert wait_gone(ranks) == []  # with one process, the rank is the launcher


def _raise_stopped_while_starting(ctx: DistContext, marks: str) -> None:
    Path(marks, f"rank{ctx.rank}").write_text(str(os.getpid()))
    time.sleep(120)


def test_launch_raises_stopped_at_start_which_a_caller_can_catch(tmp_path: Path) -> None:
    import threading

    from ddpkit.errors import StoppedAtStart

    marks = tmp_path / "marks"
    marks.mkdir()

    def signal_once_both_build() -> None:
        wait_for_files([marks / "rank0", marks / "rank1"], within=120)
        os.kill(os.getpid(), signal.SIGTERM)  # to the launcher: this process

    threading.Thread(target=signal_once_both_build, daemon=True).start()
    with pytest.raises(StoppedAtStart) as info:
        launch(_raise_stopped_while_starting, str(marks), nprocs=2)
    assert info.value.signum == signal.SIGTERM
    assert info.value.code == PREEMPTED_EXIT


# A script written for torchrun that uses ddpkit: its own process group, the Trainer on
# DistContext.current(). On the first attempt each rank reads its data for a long while
# (the test signals it meanwhile); a restarted attempt would train to the end.
OWN_GROUP_STARTING_JOB = """
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import ddpkit

dist.init_process_group("gloo")
ctx = ddpkit.DistContext.current()
if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    Path(os.environ["MARKS"], f"rank{ctx.rank}").write_text(str(os.getpid()))
    time.sleep(120)
ddpkit.seed_everything(7)
model = nn.Sequential(nn.Linear(3, 8), nn.Dropout(0.1), nn.ReLU(), nn.Linear(8, 1))
x = torch.randn(48, 3, generator=torch.Generator().manual_seed(1))
data = torch.utils.data.TensorDataset(x, x.pow(2).sum(1, keepdim=True))
config = ddpkit.TrainConfig(epochs=2, batch_size=4, checkpoint_dir=sys.argv[1], progress=False)
trainer = ddpkit.Trainer(
    model, lambda p: torch.optim.AdamW(p, lr=1e-3), data, ctx, config,
    loss_fn=nn.functional.mse_loss, log_fn=lambda s: None,
)
try:
    trainer.fit()
finally:
    dist.destroy_process_group()
print("the job went on to the end")
"""

# The same wait in a script with no ddpkit code.
PLAIN_STARTING_JOB = """
import os
import time
from pathlib import Path

import torch.distributed as dist

dist.init_process_group("gloo")
Path(os.environ["MARKS"], f"rank{dist.get_rank()}").write_text(str(os.getpid()))
time.sleep(120)
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    ("job", "signum", "target", "flags"),
    [
        ("launch", signal.SIGTERM, "one-worker", ()),
        ("launch", signal.SIGUSR1, "one-worker", ("--audit=strict",)),
        ("launch", signal.SIGTERM, "launcher", ()),
        ("own-group", signal.SIGTERM, "one-worker", ("--max-restarts", "1")),
        ("train", signal.SIGUSR1, "one-worker", ()),
    ],
    ids=[
        "launch-term-worker",
        "launch-usr1-worker-strict",
        "launch-term-agent",
        "own-group-restarts",
        "sbatch-train-usr1-worker",
    ],
)
def test_ddpkit_run_stopped_while_starting_exits_75_with_one_line(
    tmp_path: Path, job: str, signum: int, target: str, flags: tuple[str, ...]
) -> None:
    # As under launch: before any rank's first step, nothing is lost, and the requeue
    # (exit 75) starts the job again; never a restart, never a crash report.
    script = tmp_path / "job.py"
    script.write_text(OWN_GROUP_STARTING_JOB if job == "own-group" else STARTING_JOB)
    cmd = [sys.executable, "-m", "ddpkit", "run", "--nproc", "2", *flags]
    if job == "train":  # as docs/slurm/train.sbatch runs it
        cmd += ["-m", "ddpkit", "train", "--job", f"{script}:build"]
        cmd += ["--checkpoint-dir", str(tmp_path / "ck"), "--resume"]
    else:
        cmd += [str(script), str(tmp_path / "ck"), *(["2"] if job == "launch" else [])]
    proc, ranks = _stop_while_starting(cmd, tmp_path / "marks", 2, signum, target)
    assert proc.returncode == PREEMPTED_EXIT, proc.stdout + proc.stderr
    said = [
        ln for ln in proc.stderr.splitlines() if ln.strip() and ln != "ddpkit audit: no findings"
    ]
    assert said == [STARTING_LINE.format(name=signal.Signals(signum).name)], proc.stderr
    assert "went on" not in proc.stdout
    assert wait_gone(ranks) == []
    assert not list((tmp_path / "ck").glob("ckpt-*"))


@pytest.mark.slow
def test_a_plain_torchrun_script_stopped_while_starting_fails_naming_the_rank(
    tmp_path: Path,
) -> None:
    # No ddpkit code: nothing says that the script starts again without a loss (it may
    # train without an optimizer step, or not train at all), so the rank dies as under
    # torchrun and `ddpkit run` ends with 1, naming that rank and the signal.
    script = tmp_path / "job.py"
    script.write_text(PLAIN_STARTING_JOB)
    cmd = [sys.executable, "-m", "ddpkit", "run", "--nproc", "2", str(script)]
    proc, ranks = _stop_while_starting(cmd, tmp_path / "marks", 2, signal.SIGTERM, "one-worker")
    assert proc.returncode == 1, proc.stderr
    said = [line for line in proc.stderr.splitlines() if line.startswith("ddpkit: ")]
    assert (
        said[0]
        == "ddpkit: the job failed: rank 1 was killed by SIGTERM; the other ranks were stopped"
    ), proc.stderr
    assert wait_gone(ranks) == []


def test_a_signal_after_training_began_without_a_checkpoint_folder_still_stops_with_143(
    tmp_path: Path,
) -> None:
    # Steps were taken and nothing saves them: that is not a job that can simply start
    # again, so the exit status stays the signal's.
    script = tmp_path / "job.py"
    script.write_text(SCRIPT_JOB.replace("checkpoint_dir=folder", "checkpoint_dir=None"))
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "ck"), "2", "SIGTERM"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr
    assert "while the job was starting" not in proc.stderr


# A SIGTERM reaches rank 1 once (a marker file says it came), at step 3 of the first
# attempt; a restarted attempt trains to its end.
SIGNALLED_ONCE_JOB = """
import os
import signal
import sys

import torch
from torch import nn

import ddpkit


class TermOnce(ddpkit.Callback):
    def __init__(self, mark):
        self.mark = mark

    def on_step_end(self, trainer, step):
        if step == 3 and trainer.ctx.rank == 1 and not os.path.exists(self.mark):
            open(self.mark, "w").close()
            os.kill(os.getpid(), signal.SIGTERM)


def main(ctx, folder):
    ddpkit.seed_everything(2)
    model = nn.Sequential(nn.Linear(5, 10), nn.Dropout(0.1), nn.ReLU(), nn.Linear(10, 1))
    g = torch.Generator().manual_seed(4)
    x = torch.randn(160, 5, generator=g)
    data = torch.utils.data.TensorDataset(x, x.prod(1, keepdim=True))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    config = ddpkit.TrainConfig(epochs=3, batch_size=4, checkpoint_dir=folder, progress=False)
    ddpkit.Trainer(model, optimizer, data, ctx, config, loss_fn=nn.functional.mse_loss,
                   callbacks=[TermOnce(folder + ".signalled")], log_fn=lambda s: None).fit()
    ddpkit.print("trained to the end")


if __name__ == "__main__":
    ddpkit.launch(main, sys.argv[1])
"""


@pytest.mark.slow
def test_ddpkit_run_with_restarts_ends_a_preempted_job_with_75(tmp_path: Path) -> None:
    # Every rank saves and exits 75 so that the scheduler requeues the job: that is no
    # failure for torchrun's agent to restart, or the restarted group trains on, ends
    # with 0, and the requeue never comes.
    script = tmp_path / "job.py"
    script.write_text(SIGNALLED_ONCE_JOB)
    folder = tmp_path / "ck"
    proc = run_cli("run", "--nproc", "2", "--max-restarts", "2", str(script), str(folder))
    assert (tmp_path / "ck.signalled").exists(), proc.stderr
    assert proc.returncode == PREEMPTED_EXIT, proc.stdout + proc.stderr
    assert "trained to the end" not in proc.stdout
    said = [line for line in proc.stderr.splitlines() if line.startswith("ddpkit: ")]
    assert len(said) == 1 and re.match(r"ddpkit: stopped by SIGTERM after step \d+", said[0]), said


# A script written for torchrun: its own init_process_group, the Trainer on
# DistContext.current(). Dict batches with noise drawn per sample, dropout, AdamW and a
# per-step scheduler. With "signal", rank 1 sends itself a SIGTERM after step 5 of the
# first attempt; every rank writes the step it saved at (from Preempted), and a run that
# ends writes each rank's model, optimizer and scheduler state.
TORCHRUN_TRAINER_JOB = """
import json
import os
import signal
import sys

import torch
import torch.distributed as dist
from torch import nn

import ddpkit
from ddpkit.errors import Preempted


class Noisy(torch.utils.data.Dataset):
    def __init__(self):
        g = torch.Generator().manual_seed(11)
        self.x = torch.randn(80, 7, generator=g)
        self.y = torch.sin(self.x[:, :3].sum(1, keepdim=True))

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        # Augmentation from this rank's stream: a resume must restore it as it was.
        return {"x": self.x[i] + 0.05 * torch.randn(7), "y": self.y[i]}


def step(model, batch):
    return nn.functional.smooth_l1_loss(model(batch["x"]), batch["y"])


class TermOnce(ddpkit.Callback):
    def __init__(self, mark):
        self.mark = mark

    def on_step_end(self, trainer, step):
        if step == 5 and trainer.ctx.rank == 1 and not os.path.exists(self.mark):
            open(self.mark, "w").close()
            os.kill(os.getpid(), signal.SIGTERM)


if __name__ == "__main__":
    folder, out, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo")
    ctx = ddpkit.DistContext.current()
    ddpkit.seed_everything(5)
    model = nn.Sequential(nn.Linear(7, 16), nn.Dropout(0.2), nn.GELU(), nn.Linear(16, 1))
    config = ddpkit.TrainConfig(
        epochs=40, batch_size=4, checkpoint_dir=folder, resume=mode == "resume",
        scheduler_interval="step", progress=False,
    )
    trainer = ddpkit.Trainer(
        model,
        lambda p: torch.optim.AdamW(p, lr=3e-3, weight_decay=0.01),
        Noisy(),
        ctx,
        config,
        scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=7, gamma=0.9),
        training_step=step,
        callbacks=[TermOnce(folder + ".signalled")] if mode == "signal" else [],
        log_fn=lambda s: None,
    )
    try:
        trainer.fit()
    except Preempted as exc:
        with open(os.path.join(out, f"rank{ctx.rank}.preempted.json"), "w") as f:
            json.dump({"step": exc.step, "checkpoint": str(exc.checkpoint)}, f)
        raise
    finally:
        dist.destroy_process_group()
    torch.save(
        {
            "model": ddpkit.unwrap(trainer.model).state_dict(),
            "optimizer": trainer.optimizer.state_dict(),
            "scheduler": trainer.scheduler.state_dict(),
        },
        os.path.join(out, f"rank{ctx.rank}.pt"),
    )
"""


def _assert_same_state(a: object, b: object, where: str) -> None:
    """`a` and `b` (nested dicts and lists of tensors and plain values) are bit-identical."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for key in a:
            _assert_same_state(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same_state(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


@pytest.mark.slow
def test_a_torchrun_style_trainer_under_ddpkit_run_saves_on_sigterm_and_resumes(
    tmp_path: Path,
) -> None:
    # No launch: the script makes its own process group, so no worker of launch's has
    # installed the stop-signal handler; the Trainer's fit must save on the signal.
    script = tmp_path / "train.py"
    script.write_text(TORCHRUN_TRAINER_JOB)
    outs = {name: tmp_path / name for name in ("stopped", "straight")}
    for out in outs.values():
        out.mkdir()
    folder = tmp_path / "ck"

    def run(folder: Path, out: Path, mode: str) -> subprocess.CompletedProcess[str]:
        return run_cli(
            *("run", "--nproc", "2", str(script), str(folder), str(out), mode),
            timeout=120,
            env={"OMP_NUM_THREADS": "1"},
        )

    stopped = run(folder, outs["stopped"], "signal")
    assert (tmp_path / "ck.signalled").exists(), stopped.stderr
    assert stopped.returncode == PREEMPTED_EXIT, stopped.stdout + stopped.stderr
    said = [line for line in stopped.stderr.splitlines() if line.startswith("ddpkit: ")]
    assert len(said) == 1 and re.match(r"ddpkit: stopped by SIGTERM after step \d+", said[0]), said
    saved = [json.loads((outs["stopped"] / f"rank{r}.preempted.json").read_text()) for r in (0, 1)]
    assert saved[0] == saved[1], saved  # the same step, the same checkpoint
    assert Path(saved[0]["checkpoint"]).is_file()
    assert Path(saved[0]["checkpoint"]).name == f"ckpt-{saved[0]['step']:09d}.pt"
    resumed = run(folder, outs["stopped"], "resume")
    straight = run(tmp_path / "ck-straight", outs["straight"], "straight")
    assert resumed.returncode == straight.returncode == 0, resumed.stderr + straight.stderr
    finals = {
        name: [torch.load(out / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
        for name, out in outs.items()
    }
    for rank in (0, 1):
        _assert_same_state(finals["stopped"][rank], finals["straight"][rank], f"rank {rank}")
    _assert_same_state(finals["straight"][0], finals["straight"][1], "rank 0 against rank 1")


def test_a_saving_loop_routes_only_the_stop_signals_nobody_chose_and_puts_them_back() -> None:
    # A process no launch worker prepared (a script with its own process group): the
    # loop that saves routes the signals still at Python's defaults to its save, for
    # its time only; a handler of the script's own stays.
    from ddpkit.inrank import preemption

    def mine(signum: int, frame: object) -> None:
        pass

    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGUSR1, mine)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with preemption.saving_on_signal():
            assert signal.getsignal(signal.SIGTERM) is preemption._on_signal
            assert signal.getsignal(signal.SIGINT) is preemption._on_signal
            assert signal.getsignal(signal.SIGUSR1) is mine
            os.kill(os.getpid(), signal.SIGTERM)  # recorded, not the end of this process
            assert preemption.requested() == signal.SIGTERM
        assert preemption.requested() == 0
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        assert signal.getsignal(signal.SIGUSR1) is mine
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)

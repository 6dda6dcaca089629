"""Checkpoints when something else goes wrong: a full disk, a second job in the same
folder, another model's checkpoint, a corrupt or a finished run to resume.

Every test runs real processes on real files; nothing of torch.distributed is mocked."""

from __future__ import annotations

import json
import logging
import os
import resource
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from ddpkit import DistContext, launch
from ddpkit.checkpoint.pt import list_checkpoints, lock_folder, save_checkpoint
from ddpkit.errors import CheckpointError
from ddpkit.training.config import TrainConfig
from ddpkit.training.job import build_job
from tests.conftest import ROOT, run_cli, wait_for_files, wait_gone

CTX = DistContext()
DDPKIT = [sys.executable, "-m", "ddpkit"]
LINEAR_JOB = "train --example linear --nproc 2 --epochs 1"  # 32 steps, a 28 KiB checkpoint


def _one_line_error(proc: subprocess.CompletedProcess[str]) -> str:
    """The single `ddpkit: error:` line of a failed CLI run (exit status 2, no traceback)."""
    assert proc.returncode == 2, proc.stderr
    return _the_error_line(proc.stderr)


def _the_error_line(stderr: str) -> str:
    """The one error line, which ends stderr (info lines of the ranks may come before)."""
    assert "Traceback" not in stderr, stderr
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    errors = [ln for ln in lines if "error" in ln.lower()]
    assert errors == lines[-1:] and errors[0].startswith("ddpkit: error: "), stderr
    return errors[0]


def _temporaries(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".tmp"))


# -- a write that fails part way -------------------------------------------------------


def _big_state(value: float) -> dict[str, Any]:
    return {"model": {"w": torch.full((65536,), value)}, "epoch": 1, "global_step": 0}


def _save_past_a_file_size_limit(ctx: DistContext, folder: str) -> tuple[list[str], int]:
    first = save_checkpoint(_big_state(1.0), folder, ctx, step=1)
    size = first.stat().st_size
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    if ctx.is_main:
        # A real write(2) that fails part way, without mounting a small disk: rank 0 (the
        # writer) may not grow a file past 64 KiB, so the kernel fails its write with
        # EFBIG inside torch.save, just where a full disk fails with ENOSPC. Python
        # ignores SIGXFSZ, so the process gets the error instead of being killed.
        resource.setrlimit(resource.RLIMIT_FSIZE, (65536, hard))
    try:
        save_checkpoint(_big_state(2.0), folder, ctx, step=2)
        mine = "saved"
    except CheckpointError as exc:
        mine = str(exc)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    everyone: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(everyone, mine)
    return everyone, size


def test_a_failed_write_is_one_error_on_every_rank_and_leaves_nothing_behind(
    tmp_path: Path,
) -> None:
    messages, size = launch(_save_past_a_file_size_limit, str(tmp_path), nprocs=2)
    assert messages[0] == messages[1], messages  # every rank stops with rank 0's reason
    message = messages[0]
    assert message.startswith(f"cannot write checkpoint {tmp_path / 'ckpt-000000002.pt'}")
    assert "file size limit" in message and "ulimit -f" in message, message
    assert f"needs {size:,} bytes" in message, message  # the serialised size, exactly
    assert "free in" in message, message
    assert "ckpt-000000001.pt, the newest checkpoint, is intact" in message, message
    assert [p.name for p in list_checkpoints(tmp_path)] == ["ckpt-000000001.pt"]
    assert _temporaries(tmp_path) == []


def _can_mount_tmpfs() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    probe = "d=$(mktemp -d) && mount -t tmpfs -o size=4k tmpfs $d && umount $d; rmdir $d"
    return subprocess.run(["unshare", "-m", "sh", "-c", probe], capture_output=True).returncode == 0


@pytest.mark.skipif(not _can_mount_tmpfs(), reason="needs root and mount namespaces (unshare -m)")
def test_a_full_disk_is_named_in_one_line(tmp_path: Path) -> None:
    """The issue's case itself: a 40 KiB tmpfs holds one 28 KiB checkpoint, not two. It is
    mounted in a private mount namespace (unshare -m), so it vanishes with the test."""
    disk = tmp_path / "disk"
    disk.mkdir()
    train = f"{shlex.join(DDPKIT)} train --example linear --nproc 2"
    script = textwrap.dedent(
        f"""
        mount -t tmpfs -o size=40k tmpfs {disk} || exit 99
        {train} --epochs 1 --checkpoint-dir {disk} > /dev/null 2>&1 || exit 98
        {train} --epochs 2 --checkpoint-dir {disk} --resume > /dev/null
        echo "status $?"
        ls -A {disk}
        """
    )
    proc = subprocess.run(
        ["unshare", "-m", "sh", "-c", script], capture_output=True, text=True, timeout=240, cwd=ROOT
    )
    out = proc.stdout.split()
    assert out[:2] == ["status", "2"], (proc.stdout, proc.stderr)
    assert out[2:] == ["ckpt-000000032.pt"], out  # no temporary file, no lock left
    line = _the_error_line(proc.stderr)
    assert f"cannot write checkpoint {disk / 'ckpt-000000064.pt'}: no space left on device" in line
    assert "needs " in line and f"free in {disk}" in line, line
    assert "ckpt-000000032.pt, the newest checkpoint, is intact" in line, line
    assert "--checkpoint-dir" in line, line


def _limit_file_size(limit: int) -> Any:
    def apply() -> None:
        # See _save_past_a_file_size_limit: a real write that fails with EFBIG.
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))

    return apply


def test_a_run_folder_that_cannot_be_written_is_one_line(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [*DDPKIT, *LINEAR_JOB.split(), "--run-dir", str(run_dir), "--log-every", "1"],
        capture_output=True,
        text=True,
        timeout=240,
        preexec_fn=_limit_file_size(4096),  # metrics.jsonl outgrows 4 KiB in the first epoch
    )
    line = _one_line_error(proc)
    assert f"cannot write the run log {run_dir}" in line, line  # metrics.jsonl or tb/
    assert "file size limit" in line and "--run-dir" in line, line


# -- two jobs, one folder -------------------------------------------------------------

_PAUSED_JOB = textwrap.dedent(
    """
    import os, time
    from pathlib import Path
    from ddpkit.training.trainer import Callback
    from ddpkit.examples import linear

    class Pause(Callback):
        def on_step_end(self, trainer, step):
            if trainer.ctx.is_main:  # rank 1 waits in the next step's all-reduce
                Path(os.environ["PAUSED_MARK"]).write_text(str(os.getpid()))
                time.sleep(300)

    def build(ctx):
        job = linear.build(ctx)
        job.callbacks.append(Pause())
        return job
    """
)


def test_a_second_job_in_the_folder_is_refused_and_a_dead_ones_lock_is_taken_over(
    tmp_path: Path,
) -> None:
    folder = tmp_path / "ck"
    (tmp_path / "paused.py").write_text(_PAUSED_JOB)
    mark = tmp_path / "rank0.pid"
    paused = LINEAR_JOB.replace("--example linear", f"--job {tmp_path / 'paused.py'}:build")
    first = subprocess.Popen(
        [*DDPKIT, *paused.split(), "--checkpoint-dir", str(folder)],
        cwd=ROOT,
        env={**os.environ, "PAUSED_MARK": str(mark)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for_files([mark], within=120)
        owner = int(mark.read_text())
        second = run_cli(*LINEAR_JOB.split(), "--checkpoint-dir", str(folder))
        line = _one_line_error(second)
        assert f"checkpoint folder {folder} is in use by another job" in line, line
        assert f"pid {owner} on {socket.gethostname()}" in line, line
        assert "--checkpoint-dir" in line and "paused.py:build" in line, line
        assert list_checkpoints(folder) == []  # the second job wrote nothing
    finally:
        first.send_signal(signal.SIGKILL)  # its workers die with it, lock file and all
        first.wait()
    assert wait_gone([owner]) == []
    assert (folder / "ddpkit.lock").exists()
    third = run_cli(*LINEAR_JOB.split(), "--checkpoint-dir", str(folder), "--resume")
    assert third.returncode == 0, third.stderr
    assert f"took over the lock {folder / 'ddpkit.lock'} of pid {owner}" in third.stderr
    assert "no longer running" in third.stderr
    assert [p.name for p in list_checkpoints(folder)] == ["ckpt-000000032.pt"]
    assert not (folder / "ddpkit.lock").exists()  # released when the job ended


def _lock_of(folder: Path, pid: int, host: str, ticks: int | None) -> None:
    folder.mkdir(exist_ok=True)
    owner = {"pid": pid, "host": host, "since": "then", "command": "ddpkit train", "ticks": ticks}
    (folder / "ddpkit.lock").write_text(json.dumps(owner))


def test_a_lock_is_taken_over_only_when_its_process_is_gone_from_this_host(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    lock = tmp_path / "ddpkit.lock"
    # Another host's job cannot be checked from here: never taken, the message says how.
    _lock_of(tmp_path, os.getpid(), "elsewhere", None)
    with pytest.raises(
        CheckpointError, match=r"in use by another job \(pid \d+ on elsewhere"
    ) as info:
        lock_folder(tmp_path, CTX)
    assert f"if that job is gone, delete {lock}" in str(info.value)
    # A live pid of this host whose start time differs: the pid was reused, the job is gone.
    parent = os.getppid()
    _lock_of(tmp_path, parent, socket.gethostname(), 1)
    with caplog.at_level(logging.WARNING, logger="ddpkit"):
        taken = lock_folder(tmp_path, CTX)
    assert taken is not None and f"of pid {parent} on" in caplog.text
    assert json.loads(lock.read_text())["pid"] == os.getpid()
    taken.release()
    assert not lock.exists()


_WRITER = textwrap.dedent(
    """
    import sys, time, torch
    from pathlib import Path
    from ddpkit.checkpoint.pt import atomic_save

    folder = Path(sys.argv[1])
    real_save = torch.save
    def slow_save(obj, f, *a, **k):
        f.write(b"PK the first bytes of a big checkpoint")
        f.flush()
        (folder / "writing").write_text("1")
        while not (folder / "go").exists():  # a big checkpoint takes its time
            time.sleep(0.05)
        f.seek(0)
        real_save(obj, f, *a, **k)
    torch.save = slow_save
    atomic_save({"model": {"w": torch.ones(3)}}, folder / "ckpt-000000007.pt")
    """
)


def test_a_save_never_deletes_a_temporary_file_that_another_process_is_writing(
    tmp_path: Path,
) -> None:
    (tmp_path / "writer.py").write_text(_WRITER)
    folder = tmp_path / "ck"
    folder.mkdir()
    writer = subprocess.Popen(
        [sys.executable, str(tmp_path / "writer.py"), str(folder)],
        cwd=ROOT,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for_files([folder / "writing"])
        (being_written,) = _temporaries(folder)
        save_checkpoint({"model": {"w": torch.zeros(3)}}, folder, CTX, step=3)
        assert _temporaries(folder) == [being_written]  # the sweep left it alone
        (folder / "go").write_text("1")
        _, stderr = writer.communicate(timeout=60)
    finally:
        writer.kill()
        writer.wait()
    assert writer.returncode == 0, stderr  # its rename found its file
    assert [p.name for p in list_checkpoints(folder)] == [
        "ckpt-000000003.pt",
        "ckpt-000000007.pt",
    ]
    assert _temporaries(folder) == []


# -- another model's checkpoint -------------------------------------------------------


@pytest.mark.slow
def test_resuming_another_models_checkpoint_is_refused_in_one_line(tmp_path: Path) -> None:
    folder = tmp_path / "ck"
    linear = ("train", "--example", "linear", "--nproc", "2", "--checkpoint-dir", str(folder))
    assert run_cli(*linear, "--epochs", "1").returncode == 0
    (written,) = list_checkpoints(folder)
    digits = ("train", "--example", "digits", "--nproc", "2", "--epochs", "1")
    for form in ("new", "old"):
        if form == "old":  # a checkpoint from before these fields: compared by its tensors
            state = torch.load(written, weights_only=True)
            assert state["model_class"] == "torch.nn.Linear"
            assert len(state["model_fingerprint"]) == 64
            for key in ("model_class", "model_fingerprint", "writer"):
                del state[key]
            torch.save(state, written)
        line = _one_line_error(run_cli(*digits, "--checkpoint-dir", str(folder), "--resume"))
        assert f"checkpoint {written} holds another model" in line, (form, line)
        assert "this job's model is torch.nn.Sequential (fingerprint " in line, (form, line)
        if form == "new":
            assert "written for torch.nn.Linear (fingerprint " in line, line
            assert "by `python -m ddpkit train --example linear" in line, line
        assert "'weight'" in line and "--checkpoint-dir" in line, line
    resumed = run_cli(*linear, "--epochs", "2", "--resume")  # the right model: old format loads
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed from {written} at epoch 2" in resumed.stdout


# -- what a resume says -----------------------------------------------------------------


def _fit_and_listen(ctx: DistContext, config: TrainConfig) -> list[list[str]]:
    """Fit the linear example; every rank's printed lines and ddpkit log records, in order."""
    heard: list[str] = []

    class Listen(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            heard.append(record.getMessage())

    handler = Listen(logging.INFO)
    logging.getLogger("ddpkit").addHandler(handler)
    try:
        trainer = build_job(ctx, "linear", config).trainer(ctx, config, log_fn=heard.append)
        trainer.fit()
    finally:
        logging.getLogger("ddpkit").removeHandler(handler)
    everyone: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(everyone, heard)
    return everyone


def test_a_resume_says_once_what_it_skipped_and_when_there_is_nothing_to_do(
    tmp_path: Path,
) -> None:
    config = TrainConfig(epochs=2, checkpoint_dir=str(tmp_path), progress=False)
    launch(_fit_and_listen, config, nprocs=2)
    newest = tmp_path / "ckpt-000000064.pt"
    newest.write_bytes(newest.read_bytes()[:1000])

    resume = TrainConfig(epochs=2, checkpoint_dir=str(tmp_path), resume=True, progress=False)
    rank0, rank1 = launch(_fit_and_listen, resume, nprocs=2)
    assert rank1 == []
    about_it = [line for line in rank0 if "ckpt-000000064.pt" in line]
    assert about_it == [
        "skipped corrupt ckpt-000000064.pt: truncated or corrupt (RuntimeError); resumed from "
        f"{tmp_path / 'ckpt-000000032.pt'} at epoch 2 (step 32)"
    ], rank0

    rank0, rank1 = launch(_fit_and_listen, resume, nprocs=2)  # the run is complete now
    assert rank1 == []
    assert rank0 == [f"nothing to do: {newest} finished all 2 epochs"], rank0

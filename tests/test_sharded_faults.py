"""Sharded (FSDP) checkpoints when a job is killed or a checkpoint is damaged (issue 33).

A kill at any moment of a save leaves only whole checkpoints under their names, never
more than `keep_last`; a damaged `ckpt-*.dcp` is skipped by a resume and refused by
`ddpkit export` in one line. Every test runs real processes on real files; nothing of
torch.distributed is mocked (a kill is a real SIGKILL, at a chosen or a random moment).
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from ddpkit import DistContext
from ddpkit.checkpoint.pt import find_checkpoint, save_checkpoint, wait_for_checkpoints
from ddpkit.parallel.fsdp import cpu_supported
from tests.conftest import ROOT, run_cli

CTX = DistContext.single("cpu")
KEEP = 2
DDPKIT = [sys.executable, "-m", "ddpkit"]
DIGITS = ("train", "--example", "digits", "--strategy", "fsdp", "--nproc", "2")
# DCP says so on every save and load without a process group (one process, as meant here).
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
NEEDS_FSDP = pytest.mark.skipif(not cpu_supported(), reason="FSDP2 on CPU ranks needs torch >= 2.7")


def _visible(folder: Path) -> list[Path]:
    """The checkpoints under their final names, oldest first."""
    return sorted(p for p in folder.iterdir() if re.fullmatch(r"ckpt-\d+\.(pt|dcp)", p.name))


def _model_of(path: Path, scratch: Path) -> dict[str, Any]:
    """The model state a checkpoint holds, read as a user would (and as a resume does): a
    sharded one whole through DCP, so a shard missing or cut short fails here."""
    if path.suffix == ".pt":
        return dict(torch.load(path, weights_only=True)["model"])
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    assert torch.load(path / "meta.pt", weights_only=True)["sharded"] is True
    joined = scratch / f"joined-{path.name}.pt"
    dcp_to_torch_save(path, joined)
    state = torch.load(joined, weights_only=True)
    joined.unlink()
    return dict(state["model"])


def _assert_whole(path: Path, scratch: Path) -> dict[str, Any]:
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    try:
        return _model_of(path, scratch)
    except (Exception, CheckpointException) as exc:
        cause = exc.failures[0][0] if isinstance(exc, CheckpointException) else exc
        files = sorted(p.name for p in path.iterdir()) if path.is_dir() else []
        pytest.fail(f"{path} is damaged under its final name ({cause!r}); it holds {files}")


# -- a kill at every moment of one save ----------------------------------------------------

# One process forks a child per trial: trial n saves steps 1 and 2, then dies by SIGKILL
# just before its n-th rename or deletion of the third save (step 3, or step 2 again),
# until a trial's save completes. So every state the folder passes through is one that a
# kill can leave. (Forked, so torch is imported once; nothing has started threads.)
_KILL_AT_EVERY_STEP = textwrap.dedent(
    """
    import json, os, signal, sys, traceback
    from pathlib import Path

    import torch

    from ddpkit import DistContext
    from ddpkit.checkpoint.pt import save_checkpoint, wait_for_checkpoints

    root, kind = Path(sys.argv[1]), sys.argv[2]
    ctx = DistContext.single("cpu")

    def save(folder, step, value):
        w = torch.full((4096,), float(value))
        state = {"epoch": 0, "global_step": step}
        if kind == "file":
            save_checkpoint({**state, "model": {"w": w}}, folder, ctx, step=step, keep_last=2)
        else:
            shards = {"model": {"w": w}, "optimizer": {}}
            save_checkpoint(state, folder, ctx, step=step, keep_last=2, shards=shards)

    def die_before(n):
        count = 0
        def counted(fn):
            def call(*args, **kwargs):
                nonlocal count
                count += 1
                if count == n:
                    os.kill(os.getpid(), signal.SIGKILL)
                return fn(*args, **kwargs)
            return call
        for name in ("rename", "replace", "unlink", "rmdir"):
            setattr(os, name, counted(getattr(os, name)))

    step = 2 if kind == "same-step" else 3
    for n in range(1, 200):
        pid = os.fork()
        if pid == 0:
            try:
                folder = root / f"kill-{n:03d}"
                save(folder, 1, 1)
                save(folder, 2, 2)
                die_before(n)
                save(folder, step, step + 0.5)
                wait_for_checkpoints()  # as the end of fit or of the process does
            except BaseException:
                traceback.print_exc()
                os._exit(1)
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        if os.WIFSIGNALED(status):
            continue
        print(json.dumps({"trials": n, "status": os.waitstatus_to_exitcode(status)}))
        break
    """
)


@pytest.mark.parametrize("kind", ["sharded", "same-step", "file"])
def test_a_kill_at_any_moment_of_a_save_leaves_whole_checkpoints_no_more_than_keep_last(
    tmp_path: Path, kind: str
) -> None:
    root = tmp_path / "trials"
    root.mkdir()
    ran = subprocess.run(
        [sys.executable, "-c", _KILL_AT_EVERY_STEP, str(root), kind],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
    )
    assert ran.returncode == 0, ran.stderr
    outcome = json.loads(ran.stdout.strip().splitlines()[-1])
    assert outcome["status"] == 0, ran.stderr  # the last trial's save was not killed
    assert outcome["trials"] >= 3, outcome  # kills landed within the save
    for trial in sorted(root.iterdir()):
        visible = _visible(trial)
        names = [p.name for p in visible]
        # A new checkpoint file is renamed in at once and made durable on a thread,
        # and only then are the ones it outdates deleted: a kill in between leaves one
        # more (the next save removes it). A sharded one, or a file that replaces one of
        # its name, is on disk before its rename: never more than keep_last.
        most = KEEP + 1 if kind == "file" else KEEP
        assert 1 <= len(visible) <= most, (trial.name, sorted(os.listdir(trial)))
        for path in visible:
            w = _assert_whole(path, tmp_path)["w"]
            step = int(path.name[5:14])
            assert float(w[0]) in (step, step + 0.5) and bool((w == w[0]).all()), (trial, path)

        # The next job resumes from the newest, and its first save clears what the kill
        # left under hidden names.
        found = find_checkpoint(trial, CTX)
        assert found is not None and found.path == visible[-1] and not found.skipped, trial
        shards = None if kind == "file" else {"model": {"w": torch.zeros(4096)}, "optimizer": {}}
        model = {"model": {"w": torch.zeros(4096)}} if kind == "file" else {}
        save_checkpoint(
            {**model, "epoch": 0, "global_step": 4},
            trial,
            CTX,
            step=4,
            keep_last=KEEP,
            shards=shards,
        )
        wait_for_checkpoints()
        left = sorted(os.listdir(trial))
        assert left == [*names[-(KEEP - 1) :], _visible(trial)[-1].name], (trial.name, left)


# -- a damaged sharded checkpoint ----------------------------------------------------------


def _two_sharded(folder: Path) -> tuple[Path, Path]:
    for step in (1, 2):
        shards = {
            "model": {"w": torch.full((4096,), float(step)), "b": torch.ones(3)},
            "optimizer": {},
        }
        save_checkpoint({"epoch": 0, "global_step": step}, folder, CTX, step=step, shards=shards)
    older, newer = _visible(folder)
    return older, newer


def _damage(newest: Path, how: str) -> str:
    """Damage `newest` as a kill or a full disk could; the reason a skip should give."""
    shards = sorted(newest.glob("*.distcp"))
    if how == "missing shard":
        shards[-1].unlink()
        return f"shard {shards[-1].name} is missing"
    if how == "shard cut short":
        size = shards[0].stat().st_size
        os.truncate(shards[0], size // 2)
        return f"shard {shards[0].name} is cut short ({size // 2:,} of {size:,} bytes)"
    if how == "no .metadata":
        (newest / ".metadata").unlink()
        return "it has no .metadata"
    if how == ".metadata cut short":
        os.truncate(newest / ".metadata", 10)
        return "its .metadata cannot be read (UnpicklingError)"
    assert how == "no meta.pt"
    (newest / "meta.pt").unlink()
    return "it has no meta.pt"


@pytest.mark.parametrize(
    "how",
    ["missing shard", "shard cut short", "no .metadata", ".metadata cut short", "no meta.pt"],
)
def test_a_damaged_sharded_checkpoint_is_skipped_as_a_corrupt_file_is(
    tmp_path: Path, how: str
) -> None:
    older, newer = _two_sharded(tmp_path)
    reason = _damage(newer, how)
    found = find_checkpoint(tmp_path, CTX)
    assert found is not None and found.path == older, (how, found and found.path)
    assert found.skipped == [f"corrupt {newer.name}: truncated or corrupt ({reason})"]


@NEEDS_FSDP
@pytest.mark.slow
def test_a_resume_skips_a_damaged_sharded_checkpoint_and_export_refuses_it(
    tmp_path: Path,
) -> None:
    folder = tmp_path / "ck"
    run = (*DIGITS, "--epochs", "1", "--checkpoint-dir", str(folder), "--save-every-steps", "10")
    first = run_cli(*run)
    assert first.returncode == 0, first.stderr
    *_, before, newest = _visible(folder)  # steps 20 and 23
    (newest / "__1_0.distcp").unlink()  # rank 1's shards
    because = "truncated or corrupt (shard __1_0.distcp is missing)"

    exported = tmp_path / "model.pt"
    refused = run_cli("export", str(newest), str(exported))
    assert refused.returncode == 2, refused.stderr
    assert "Traceback" not in refused.stderr, refused.stderr
    assert refused.stderr.strip() == (
        f"ddpkit: error: checkpoint {newest} is damaged (shard __1_0.distcp is missing): "
        f"export an intact one; `ddpkit export {folder} {exported}` picks the newest"
    )
    assert not exported.exists()
    picked = run_cli("export", str(folder), str(exported))
    assert picked.returncode == 0, picked.stderr
    assert f"skipped corrupt {newest.name}: {because}; exporting {before.name}" in picked.stderr
    assert f"tensors of {before.name}" in picked.stdout

    resumed = run_cli(*run, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert "Traceback" not in resumed.stderr, resumed.stderr
    assert (
        f"skipped corrupt {newest.name}: {because}; resumed from {before} at epoch 1 after "
        "batch 20 (step 20)"
    ) in resumed.stdout, resumed.stdout
    assert [p.name for p in _visible(folder)][-1] == newest.name  # saved again, whole
    _assert_whole(newest, tmp_path)


# -- SIGKILLs at random moments of a real job -------------------------------------------------


def _session(sid: int) -> list[int]:
    """The live processes of session `sid` (the job's launcher and its ranks)."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] not in "ZX":
            members.append(int(stat.parent.name))
    return members


def _newest_step(folder: Path) -> int:
    visible = _visible(folder) if folder.is_dir() else []
    return int(visible[-1].name[5:14]) if visible else -1


@pytest.mark.slow
@NEEDS_FSDP
def test_sigkills_at_random_moments_of_sharded_saves_always_leave_one_to_resume_from(
    tmp_path: Path,
) -> None:
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    folder = tmp_path / "ck"
    job = [*DDPKIT, *DIGITS, "--epochs", "100", "--save-every-steps", "1", "--keep-last", "2"]
    job += ["--checkpoint-dir", str(folder), "--no-progress"]
    newest: Path | None = None
    for trial in range(10):
        # The kill goes to the whole job, to its launcher, or to rank 0 (the writer).
        target = ("job", "launcher", "rank 0")[trial % 3]
        where = f"trial {trial} (kill to the {target}, seed {seed})"
        log = tmp_path / f"run-{trial}.log"
        start = _newest_step(folder)
        with log.open("w") as out:
            proc = subprocess.Popen(
                [*job, *(["--resume"] if newest else [])],
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group, so all of it can be killed
                cwd=ROOT,
            )
        try:
            deadline = time.monotonic() + 180
            while _newest_step(folder) <= start:
                assert proc.poll() is None, f"{where}: {log.read_text()}"
                assert time.monotonic() < deadline, f"{where}: no new checkpoint"
                time.sleep(0.02)
            time.sleep(rng.uniform(0.0, 1.5))  # within a save most of the time
            if target == "job":
                os.killpg(proc.pid, signal.SIGKILL)
            elif target == "launcher":
                os.kill(proc.pid, signal.SIGKILL)  # its ranks die with it
            else:
                holder = json.loads((folder / "ddpkit.lock").read_text())  # rank 0 holds it
                os.kill(int(holder["pid"]), signal.SIGKILL)
            proc.wait(timeout=60)
            deadline = time.monotonic() + 60
            while _session(proc.pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not _session(proc.pid), f"{where}: processes left"
        finally:
            if proc.poll() is None or _session(proc.pid):
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        text = log.read_text()
        if newest is not None:  # this run resumed from what the last kill left
            assert f"resumed from {newest} at epoch" in text, f"{where}: {text}"
        visible = _visible(folder)
        assert 1 <= len(visible) <= 2, f"{where}: {sorted(os.listdir(folder))}"
        for path in visible:
            _assert_whole(path, tmp_path)
        newest = visible[-1]

    assert newest is not None
    meta = torch.load(newest / "meta.pt", weights_only=True)
    epochs = int(meta["epoch"]) + 1  # the epoch it stopped in, finished
    final = run_cli(*DIGITS, "--epochs", str(epochs), "--checkpoint-dir", str(folder), "--resume")
    assert final.returncode == 0, final.stderr
    assert f"resumed from {newest} at epoch {epochs}" in final.stdout, final.stdout
    assert not [p for p in os.listdir(folder) if p.endswith(".tmp")]  # the kills' leftovers

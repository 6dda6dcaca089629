"""Checkpoints: atomic rank-0 writes, safe loads, skipping broken files, pruning."""

from __future__ import annotations

import errno
import logging
import os
import pickle
import shlex
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ddpkit import DistContext, launch
from ddpkit.checkpoint.digest import model_digest, state_digest
from ddpkit.checkpoint.pt import (
    atomic_save,
    check_writable,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    load_model_state,
    save_checkpoint,
    wait_for_checkpoints,
)
from ddpkit.errors import CheckpointError
from tests.conftest import ROOT, wait_for_files

CTX = DistContext()


def _state(value: float) -> dict[str, Any]:
    return {"model": {"w": torch.full((3,), value)}, "epoch": int(value), "global_step": 0}


def test_save_and_load_round_trip_with_rng_and_mode(tmp_path: Path) -> None:
    path = save_checkpoint(_state(1.0), tmp_path, CTX, step=5)
    assert path.name == "ckpt-000000005.pt"
    state = load_checkpoint(path, CTX)
    assert torch.equal(state["model"]["w"], torch.full((3,), 1.0))
    assert state["world_size"] == 1 and len(state["rng"]) == 1
    assert isinstance(state["rng"][0]["torch"], torch.Tensor)
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask  # not private like a temp file


def test_keep_last_prunes_the_oldest(tmp_path: Path) -> None:
    for step in range(1, 6):
        save_checkpoint(_state(step), tmp_path, CTX, step=step, keep_last=2)
    wait_for_checkpoints()  # the older ones go once the newest is on disk
    assert [p.name for p in list_checkpoints(tmp_path)] == [
        "ckpt-000000004.pt",
        "ckpt-000000005.pt",
    ]


def test_truncated_newest_is_reported_and_skipped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    save_checkpoint(_state(1.0), tmp_path, CTX, step=1)
    newest = save_checkpoint(_state(2.0), tmp_path, CTX, step=2)
    data = newest.read_bytes()
    newest.write_bytes(data[: len(data) // 2])
    with caplog.at_level(logging.WARNING, logger="ddpkit"):
        found = latest_checkpoint(tmp_path, CTX)
    assert found is not None
    path, state = found
    assert path.name == "ckpt-000000001.pt" and state["epoch"] == 1
    assert "skipped corrupt ckpt-000000002.pt: truncated or corrupt (" in caplog.text
    assert "; resuming from ckpt-000000001.pt" in caplog.text
    assert "delete it" not in caplog.text  # the older one is already used: no advice to do that


def test_only_broken_checkpoints_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "ckpt-000000003.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match=r"no checkpoint in .* could be read") as info:
        latest_checkpoint(tmp_path, CTX)
    assert "truncated or corrupt" in str(info.value) and "refused" not in str(info.value)
    assert latest_checkpoint(tmp_path / "empty", CTX) is None


class _Evil:
    """Unpickling this runs a shell command that creates `marker`."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {shlex.quote(str(self.marker))}",))


@pytest.mark.parametrize("writer", ["torch.save", "pickle"])
def test_an_unsafe_pickle_is_refused_and_never_unpickled(
    tmp_path: Path, writer: str, caplog: pytest.LogCaptureFixture
) -> None:
    marker = tmp_path / "MARKER"
    payload = {"model": {}, "payload": _Evil(marker)}
    pickle.loads(pickle.dumps(_Evil(tmp_path / "control")))  # the payload does run code
    assert (tmp_path / "control").exists()
    save_checkpoint(_state(1.0), tmp_path, CTX, step=1)
    evil = tmp_path / "ckpt-000000002.pt"
    if writer == "torch.save":
        torch.save(payload, evil)
    else:
        evil.write_bytes(pickle.dumps(payload, protocol=2))
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(evil, CTX)
    message = str(info.value)
    assert "was refused" in message and "weights-only" in message, message
    assert "not unpickled" in message and "posix.system" in message, message
    assert "truncated or corrupt" not in message
    with caplog.at_level(logging.WARNING, logger="ddpkit"):
        found = latest_checkpoint(tmp_path, CTX)
    assert found is not None and found[0].name == "ckpt-000000001.pt"
    assert "skipped refused ckpt-000000002.pt: it holds Python objects" in caplog.text
    assert "; resuming from ckpt-000000001.pt" in caplog.text
    assert not marker.exists()


def test_one_process_loads_the_file_as_it_reads_it_and_gets_what_torch_load_gets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Only the digest that other ranks check needs a file's bytes in memory; one process
    # decodes the file as it reads it (it read all of it, then hashed and decoded the
    # copy: 3x a torch.load of 400 MB), and gets the same state.
    import ddpkit.checkpoint.pt as ckpt

    save_checkpoint(_state(1.0), tmp_path, CTX, step=1)
    path = save_checkpoint(_state(2.0), tmp_path, CTX, step=2)
    plain = torch.load(path, weights_only=True)

    def whole_file(p: Path) -> bytes:
        raise AssertionError(f"{p} was read into memory whole")

    monkeypatch.setattr(ckpt, "_read_bytes", whole_file)
    found = latest_checkpoint(tmp_path, CTX)
    assert found is not None and found[0] == path
    for state in (load_checkpoint(path, CTX), found[1]):
        assert state.keys() == plain.keys() and state_digest(state) == state_digest(plain)
    # A file that does not load is told as before (from its bytes): see the tests above.
    monkeypatch.undo()
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=r"ckpt-000000002.pt is truncated or corrupt \("):
        load_checkpoint(path, CTX)


def test_ddp_prefixed_keys_are_accepted(tmp_path: Path) -> None:
    model = nn.Linear(2, 1)
    prefixed = {f"module.{k}": torch.ones_like(v) for k, v in model.state_dict().items()}
    load_model_state(model, prefixed)
    assert torch.equal(model.weight, torch.ones(1, 2))


def test_digest_tells_models_apart() -> None:
    a, b = nn.Linear(3, 2), nn.Linear(3, 2)
    b.load_state_dict(a.state_dict())
    assert model_digest(a) == model_digest(b)
    with torch.no_grad():
        b.bias[0] += 1e-7
    assert model_digest(a) != model_digest(b)


def test_unwritable_folder_is_a_clear_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(CheckpointError, match=r"cannot write checkpoints to .*--checkpoint-dir"):
        check_writable(blocker / "sub")


def _save_on_all_ranks(ctx: DistContext, folder: str) -> list[str]:
    torch.manual_seed(100 + ctx.rank)  # different RNG state per rank
    path = save_checkpoint(_state(float(ctx.rank)), folder, ctx, step=1)
    # after the barrier every rank can read the file rank 0 wrote
    state = load_checkpoint(path, ctx)
    return [p.name for p in Path(folder).iterdir()] + [str(state["epoch"]), str(len(state["rng"]))]


def test_only_rank0_writes_and_every_rank_sees_the_file(tmp_path: Path) -> None:
    out = launch(_save_on_all_ranks, str(tmp_path), nprocs=2)
    assert out == ["ckpt-000000001.pt", "0", "2"]  # rank 0's state, both ranks' RNGs
    rngs = load_checkpoint(tmp_path / "ckpt-000000001.pt", CTX)["rng"]
    assert not torch.equal(rngs[0]["torch"], rngs[1]["torch"])


_KILLED_MID_SAVE = textwrap.dedent(
    """
    import os, sys, time, torch
    from pathlib import Path
    from ddpkit.checkpoint.pt import atomic_save

    folder = Path(sys.argv[1])
    atomic_save({"model": {"w": torch.ones(3)}}, folder / "ckpt-000000001.pt")

    real_save = torch.save
    def slow_save(obj, f, *a, **k):
        f.write(b"PK partial bytes of a big checkpoint")
        f.flush()
        (folder / "saving").write_text("1")
        time.sleep(300)  # killed here, in the middle of the write
    torch.save = slow_save
    atomic_save({"model": {"w": torch.zeros(3)}}, folder / "ckpt-000000002.pt")
    """
)


def test_a_process_killed_mid_save_leaves_the_previous_checkpoint_intact(
    tmp_path: Path,
) -> None:
    script = tmp_path / "saver.py"
    script.write_text(_KILLED_MID_SAVE)
    folder = tmp_path / "ckpts"
    folder.mkdir()
    proc = subprocess.Popen([sys.executable, str(script), str(folder)], cwd=ROOT)
    try:
        wait_for_files([folder / "saving"])
    finally:
        proc.kill()
        proc.wait()
    assert [p.name for p in list_checkpoints(folder)] == ["ckpt-000000001.pt"]
    found = latest_checkpoint(folder, CTX)
    assert found is not None and torch.equal(found[1]["model"]["w"], torch.ones(3))
    # the next save clears the half-written temporary file
    save_checkpoint(_state(3.0), folder, CTX, step=3)
    assert not list(folder.glob(".*.tmp"))


# -- the flush to disk runs beside training -------------------------------------------
class _HeldFsync:
    """os.fsync held until `go` is set (a slow disk), or failing with `error`."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, error: int | None = None) -> None:
        self.go, self.error, self.files = threading.Event(), error, 0
        self.real = os.fsync
        monkeypatch.setattr(os, "fsync", self)

    def __call__(self, fd: int) -> None:
        if not self.go.wait(timeout=30):
            raise AssertionError("fsync was held for 30 s")
        if self.error is not None:
            raise OSError(self.error, os.strerror(self.error))
        self.files += 1
        self.real(fd)


def test_save_returns_before_the_disk_flush_and_prunes_only_after_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    save_checkpoint(_state(1.0), tmp_path, CTX, step=1, keep_last=1)
    wait_for_checkpoints()
    fsync = _HeldFsync(monkeypatch)
    path = save_checkpoint(_state(2.0), tmp_path, CTX, step=2, keep_last=1)  # not held up
    # Whole under its name already, and the one it outdates is kept until it is on disk.
    assert torch.equal(load_checkpoint(path, CTX)["model"]["w"], torch.full((3,), 2.0))
    assert [p.name for p in list_checkpoints(tmp_path)] == [
        "ckpt-000000001.pt",
        "ckpt-000000002.pt",
    ]
    fsync.go.set()
    wait_for_checkpoints()
    assert fsync.files == 2  # the file, then its folder
    assert [p.name for p in list_checkpoints(tmp_path)] == ["ckpt-000000002.pt"]
    assert not list(tmp_path.glob(".*.tmp"))


def test_a_failed_flush_keeps_the_older_checkpoint_and_is_raised_by_the_next_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    save_checkpoint(_state(1.0), tmp_path, CTX, step=1, keep_last=1)
    wait_for_checkpoints()
    fsync = _HeldFsync(monkeypatch, error=errno.EIO)
    fsync.go.set()
    save_checkpoint(_state(2.0), tmp_path, CTX, step=2, keep_last=1)
    with pytest.raises(
        CheckpointError,
        match=r"ckpt-000000002.pt may not be on disk .*"
        r"ckpt-000000001.pt kept",
    ):
        save_checkpoint(_state(3.0), tmp_path, CTX, step=3, keep_last=1)
    assert "ckpt-000000001.pt" in [p.name for p in list_checkpoints(tmp_path)]
    wait_for_checkpoints()  # said once


_EXITS_WHILE_FLUSHING = textwrap.dedent(
    """
    import os, sys, time, torch
    from pathlib import Path
    import ddpkit
    from ddpkit.checkpoint.pt import save_checkpoint

    folder, how = Path(sys.argv[1]), sys.argv[2]
    real = os.fsync
    def slow_fsync(fd):
        time.sleep(1.0)  # a slow disk: the process is done before the flush
        real(fd)
        with open(folder / "flushed", "a") as f:
            f.write("x")
    os.fsync = slow_fsync

    def job(ctx):
        state = {"model": {"w": torch.ones(3)}}
        save_checkpoint(state, folder / "ckpts", ctx, step=1)

    if how == "launch":
        ddpkit.launch(job, nprocs=1)
    else:
        job(ddpkit.DistContext())
    """
)


@pytest.mark.parametrize("how", ["plain", "launch"])
def test_a_process_that_ends_right_after_a_save_waits_for_its_flush(
    tmp_path: Path, how: str
) -> None:
    script = tmp_path / "saver.py"
    script.write_text(_EXITS_WHILE_FLUSHING)
    out = subprocess.run(
        [sys.executable, str(script), str(tmp_path), how],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "flushed").read_text() == "xx"  # the file and its folder


def test_atomic_save_failure_leaves_no_temporary(tmp_path: Path) -> None:
    with pytest.raises(Exception):  # noqa: B017 - torch raises a pickling error type
        atomic_save({"bad": lambda: 0}, tmp_path / "x.pt")
    assert list(tmp_path.iterdir()) == []


# -- every rank resumes from the checkpoint rank 0 chose ----------------------------------


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _break_reads_on_rank1(how: str) -> None:
    """Make this rank's reads of ckpt-10 fail or return other bytes (a flaky or a
    different filesystem), through the module's one file-read function."""
    import ddpkit.checkpoint.pt as ckpt

    real = ckpt._read_bytes

    def read(path: Path) -> bytes:
        if path.name != "ckpt-000000010.pt":
            return real(path)
        if how == "fail":
            raise OSError(errno.EIO, "Input/output error", str(path))
        return real(path.with_name("ckpt-000000005.pt"))  # a valid file, other content

    ckpt._read_bytes = read


def _resume_everywhere(
    ctx: DistContext, folders: list[str], rank1_reads: str | None
) -> tuple[list[list[str]], list[list[str]]]:
    """For each folder ("{rank}" is this rank's node), what latest_checkpoint gave on
    every rank ("ckpt-N w=V", "none" or "error: ..."), and every rank's warnings."""
    if ctx.rank == 1 and rank1_reads is not None:
        _break_reads_on_rank1(rank1_reads)
    warnings = _Warnings()
    logging.getLogger("ddpkit").addHandler(warnings)
    results = []
    for folder in folders:
        try:
            found = latest_checkpoint(folder.format(rank=ctx.rank), ctx)
        except CheckpointError as exc:
            mine = f"error: {exc}"
        else:
            mine = "none" if found is None else f"{found[0].name} w={found[1]['model']['w'][0]:g}"
        everyone: list[Any] = [None] * ctx.world_size
        dist.all_gather_object(everyone, mine)
        results.append(everyone)
    logged: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(logged, warnings.messages)
    return results, logged


def _five_and_ten(folder: Path, ten: float = 10.0) -> Path:
    save_checkpoint(_state(5.0), folder, CTX, step=5)
    return save_checkpoint(_state(ten), folder, CTX, step=10)


def test_every_rank_loads_the_file_rank0_chose(tmp_path: Path) -> None:
    _five_and_ten(tmp_path / "good")
    newest = _five_and_ten(tmp_path / "corrupt")
    newest.write_bytes(newest.read_bytes()[:100])
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "ckpt-000000003.pt").write_bytes(b"not a checkpoint")
    folders = ["good", "corrupt", "empty", "broken"]
    results, logged = launch(
        _resume_everywhere, [str(tmp_path / f) for f in folders], None, nprocs=2, backend="gloo"
    )
    good, corrupt, empty, broken = results
    assert good == ["ckpt-000000010.pt w=10"] * 2
    assert corrupt == ["ckpt-000000005.pt w=5"] * 2  # rank 0 skipped the corrupt newest
    assert empty == ["none", "none"]
    assert broken[0] == broken[1] and broken[0].startswith("error: no checkpoint in")
    warned, quiet = logged
    assert quiet == []  # logged once, by rank 0
    assert warned == [
        "skipped corrupt ckpt-000000010.pt: truncated or corrupt (RuntimeError); "
        "resuming from ckpt-000000005.pt"
    ]


@pytest.mark.parametrize(
    ("rank1_reads", "reason"),
    [("fail", "cannot be read (OSError"), ("other bytes", "bytes differ from rank 0's")],
)
def test_a_rank_that_cannot_load_rank0s_choice_stops_every_rank(
    tmp_path: Path, rank1_reads: str, reason: str
) -> None:
    newest = _five_and_ten(tmp_path)
    results, _ = launch(_resume_everywhere, [str(tmp_path)], rank1_reads, nprocs=2, backend="gloo")
    (outcome,) = results
    assert outcome[0] == outcome[1], outcome  # the same error on every rank, no silent fallback
    assert outcome[0].startswith("error: rank(s) 1 could not load checkpoint"), outcome
    assert str(newest) in outcome[0] and "(step 10)" in outcome[0] and reason in outcome[0]


def test_nodes_that_do_not_share_the_folder_stop_with_an_error(tmp_path: Path) -> None:
    """Each rank sees its own node's folder: rank 1 lacks the newest file, or holds
    different content under its name. The old per-rank choice silently diverged here."""
    _five_and_ten(tmp_path / "missing0")
    save_checkpoint(_state(5.0), tmp_path / "missing1", CTX, step=5)
    _five_and_ten(tmp_path / "differ0")
    _five_and_ten(tmp_path / "differ1", ten=99.0)
    folders = [str(tmp_path / "missing{rank}"), str(tmp_path / "differ{rank}")]
    (missing, differ), _ = launch(_resume_everywhere, folders, None, nprocs=2, backend="gloo")
    for outcome in (missing, differ):
        assert outcome[0] == outcome[1], outcome
        assert outcome[0].startswith("error: rank(s) 1 could not load checkpoint"), outcome
        assert "ckpt-000000010.pt" in outcome[0]
    assert "nodes must share the checkpoint folder" in missing[0]
    assert "bytes differ from rank 0's" in differ[0]


# -- what save_checkpoint accepts: what latest_checkpoint and find_checkpoint read back --
@pytest.mark.parametrize(
    ("state", "said"),
    [
        (
            {"net": {"w": torch.ones(3)}, "epoch": 1},
            "save_checkpoint's state has no 'model' entry (it has 'net', 'epoch')",
        ),
        (
            {"model": nn.Linear(2, 1)},
            "save_checkpoint's state['model'] is a torch.nn.modules.linear.Linear",
        ),
        ([torch.ones(3)], "save_checkpoint's state is a list, not a dict"),
    ],
    ids=["no-model", "a-module", "not-a-dict"],
)
def test_a_state_that_could_not_be_resumed_is_refused_before_anything_is_written(
    tmp_path: Path, state: Any, said: str
) -> None:
    folder = tmp_path / "ck"
    with pytest.raises(CheckpointError) as info:
        save_checkpoint(state, folder, CTX, step=1)
    message = str(info.value)
    assert message.startswith(said), message
    assert "\n" not in message and "pass " in message  # one line, with the fix
    assert not folder.exists()  # nothing was written, not even the folder


def _save_without_model(ctx: DistContext, folder: str) -> list[str]:
    """Every rank calls save_checkpoint with a state that has no 'model' entry (rank
    0's, which is written; the others pass an empty one, as save_state does); each
    rank's error, gathered on every rank."""
    state = {"net": {"w": torch.ones(3)}} if ctx.is_main else {}
    try:
        save_checkpoint(state, folder, ctx, step=1)
        said = "saved"
    except CheckpointError as exc:
        said = str(exc)
    everyone: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(everyone, said)
    return everyone


def test_every_rank_raises_rank0s_refusal_and_no_file_is_written(tmp_path: Path) -> None:
    folder = tmp_path / "ck"
    said = launch(_save_without_model, str(folder), nprocs=2, backend="gloo")
    assert said[0] == said[1], said  # the same error on every rank: none left waiting
    assert said[0].startswith("save_checkpoint's state has no 'model' entry"), said
    assert not folder.exists()

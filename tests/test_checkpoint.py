"""Checkpoints: atomic rank-0 writes, safe loads, skipping broken files, pruning."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from ddpkit import CheckpointError, DistContext, launch
from ddpkit.checkpoint import (
    atomic_save,
    check_writable,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    load_model_state,
    save_checkpoint,
)
from ddpkit.digest import model_digest
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
    assert "ckpt-000000002.pt" in caplog.text and "truncated or corrupt" in caplog.text


def test_only_broken_checkpoints_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "ckpt-000000003.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match=r"no checkpoint in .* could be read"):
        latest_checkpoint(tmp_path, CTX)
    assert latest_checkpoint(tmp_path / "empty", CTX) is None


class _Evil:
    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, ("echo pwned",))


def test_loading_never_unpickles_arbitrary_objects(tmp_path: Path) -> None:
    path = tmp_path / "ckpt-000000001.pt"
    torch.save({"model": {}, "payload": _Evil()}, path)
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
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
    from ddpkit.checkpoint import atomic_save

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


def test_atomic_save_failure_leaves_no_temporary(tmp_path: Path) -> None:
    with pytest.raises(Exception):  # noqa: B017 - torch raises a pickling error type
        atomic_save({"bad": lambda: 0}, tmp_path / "x.pt")
    assert list(tmp_path.iterdir()) == []

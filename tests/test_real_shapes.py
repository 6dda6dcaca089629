"""Scripts shaped like the public ones in bench/real (written here, not copied) hold what
ddpkit does with them in CI: `ddpkit run --audit` on 2 CPU ranks reports what each
committed, no more, and the ranks that should agree end with equal weights and optimizer
state. bench/real.py runs the real files; each entry there names the test that holds it."""

from __future__ import annotations

import json
import shutil
import socket
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.conftest import run_cli

SHAPES = Path(__file__).resolve().parent / "real_shapes"


def _audited(
    tmp_path: Path, script: str, *args: str, nproc: int = 2
) -> tuple[int, str, list[dict[str, Any]]]:
    """Copy the shaped script into tmp_path and run it there under `ddpkit run --audit`;
    returns (exit status, output, the audit's findings)."""
    shutil.copy(SHAPES / script, tmp_path / script)
    done = run_cli(
        *("run", "--nproc", str(nproc), "--audit", "--log-dir", "logs", script, *args),
        cwd=tmp_path,
        env={"OMP_NUM_THREADS": "1"},
    )
    output = done.stdout + done.stderr
    log = tmp_path / "logs" / "audit.json"
    assert log.exists(), output
    findings: list[dict[str, Any]] = json.loads(log.read_text(encoding="utf-8"))["findings"]
    return done.returncode, output, findings


def _same(a: Any, b: Any, where: str = "") -> None:
    """Equal nested states: tensors bit for bit, everything else by ==."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for k in a:
            _same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def _ranks_agree(*paths: Path) -> None:
    first = torch.load(paths[0], weights_only=True)
    for other in paths[1:]:
        _same(first, torch.load(other, weights_only=True), other.name)


def _codes(findings: list[dict[str, Any]]) -> set[str]:
    return {str(f["code"]) for f in findings}


@pytest.mark.slow
def test_torchrun_tutorial_shape_with_a_peek_is_audited_clean(tmp_path: Path) -> None:
    # multigpu_torchrun.py: the one-batch peek before set_epoch is no second pass, and
    # the script's options after its positional ones are its own.
    dump = tmp_path / "dump"
    dump.mkdir()
    rc, output, findings = _audited(
        tmp_path, "peek_torchrun.py", "2", "1", "--batch_size", "8", "--dump", str(dump)
    )
    assert rc == 0, output
    assert findings == [], output
    assert (tmp_path / "snapshot.pt").exists()
    _ranks_agree(dump / "final-rank0.pt", dump / "final-rank1.pt")


@pytest.mark.slow
def test_single_gpu_shape_audit_names_the_shared_checkpoint(tmp_path: Path) -> None:
    # single_gpu.py run on 2 ranks as it is: both write checkpoint.pt, and with no wrap
    # and unseeded data the ranks train different weights.
    rc, output, findings = _audited(tmp_path, "single_device.py", "2", "1")
    assert rc == 0, output
    assert _codes(findings) == {"DDP103", "DDP112"}, output
    saved = next(f for f in findings if f["code"] == "DDP103")
    assert "checkpoint.pt" in saved["message"] and saved["path"].endswith("single_device.py")
    assert "no rank called torch.distributed.init_process_group" in output


@pytest.mark.slow
def test_a_cpu_branch_that_skips_the_wrap_is_named_by_the_audit(tmp_path: Path) -> None:
    # imagenet main.py without an accelerator: a process group, no DDP wrap, no destroy.
    rc, output, findings = _audited(tmp_path, "cpu_branch_no_wrap.py", "--dist-url", "env://")
    assert rc == 0, output
    assert _codes(findings) == {"DDP111", "DDP112"}, output
    differ = next(f for f in findings if f["code"] == "DDP112")
    assert "DistributedDataParallel" in differ["message"], differ


@pytest.mark.slow
def test_nanogpt_shape_under_run_audit(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    rng = np.random.default_rng(0)
    for split, n in (("train", 4000), ("val", 400)):
        rng.integers(0, 40, n, dtype=np.uint16).tofile(data / f"{split}.bin")
    (data / "vocab.txt").write_text("40\n")
    rc, output, findings = _audited(tmp_path, "nanogpt_shape.py", "--max_iters=6")
    assert rc == 0, output
    assert findings == [], output
    assert (tmp_path / "out" / "ckpt.pt").exists()
    out = tmp_path / "out"
    _ranks_agree(out / "final-rank0.pt", out / "final-rank1.pt")


@pytest.mark.slow
def test_a_save_that_every_rank_passes_under_torchrun_is_named(tmp_path: Path) -> None:
    # moco's save condition was written for mp.spawn; under torchrun every rank passes it.
    rc, output, findings = _audited(tmp_path, "every_rank_saves.py")
    assert rc == 0, output
    assert _codes(findings) == {"DDP103", "DDP104", "DDP105", "DDP111"}, output
    saved = next(f for f in findings if f["code"] == "DDP103")
    assert "checkpoint_0000.pth.tar" in saved["message"]


@pytest.mark.slow
def test_a_script_that_spawns_its_own_ranks_is_refused_under_run(tmp_path: Path) -> None:
    # multigpu.py is its own launcher: inside a rank of `ddpkit run` (as of torchrun) its
    # spawned children waited for a store nobody serves, for good. It is refused in one
    # line that names the call and the fix, with --audit too.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rc, output, _ = _audited(tmp_path, "spawn_own_ranks.py", str(port), "2", nproc=1)
    assert rc == 2, output
    assert "starts its own ranks with torch.multiprocessing.spawn()" in output, output


@pytest.mark.slow
def test_an_accuracy_pass_over_the_training_loader_is_not_a_repeated_epoch(
    tmp_path: Path,
) -> None:
    # LLMs-from-scratch: after the last epoch, accuracy over the training loader iterates
    # its sampler again with that epoch; nothing trains on it, so no DDP101.
    rc, output, findings = _audited(tmp_path, "eval_on_train_loader.py")
    assert rc == 0, output
    assert findings == [], output
    assert "[rank 1] train accuracy" in output

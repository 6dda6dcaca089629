"""RunLog: a fresh run into a used run folder keeps the old record beside the new one."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ddpkit.runlog import RunLog


def _run(folder: Path, losses: list[float], *, resume: bool = False, **config: Any) -> RunLog:
    log = RunLog(str(folder), {"resume": resume, **config}, enabled=True)
    for step, loss in enumerate(losses, start=1):
        log.write("step", step, {"loss": loss})
    log.close()
    return log


def _losses(path: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in path.read_text().splitlines()]


def test_a_fresh_run_keeps_the_last_record_as_metrics_1_and_starts_a_new_one(
    tmp_path: Path,
) -> None:
    first = _run(tmp_path, [3.0, 2.0])
    second = _run(tmp_path, [9.0])
    assert _losses(tmp_path / "metrics.jsonl") == [9.0]  # not 3, 2, 9: one run per file
    assert first.kept is None
    assert second.kept == tmp_path / "metrics.1.jsonl"
    assert _losses(second.kept) == [3.0, 2.0]
    third = _run(tmp_path, [7.0])
    assert third.kept == tmp_path / "metrics.2.jsonl"
    assert _losses(tmp_path / "metrics.1.jsonl") == [3.0, 2.0]
    assert _losses(tmp_path / "metrics.2.jsonl") == [9.0]
    assert _losses(tmp_path / "metrics.jsonl") == [7.0]


def test_a_resumed_run_appends_to_the_record_it_continues(tmp_path: Path) -> None:
    _run(tmp_path, [3.0, 2.0])
    resumed = _run(tmp_path, [1.0], resume=True, checkpoint_dir=str(tmp_path / "ckpt"))
    assert resumed.kept is None
    assert _losses(tmp_path / "metrics.jsonl") == [3.0, 2.0, 1.0]
    assert not (tmp_path / "metrics.1.jsonl").exists()


def test_an_empty_record_is_not_kept_and_numbers_already_taken_are_skipped(
    tmp_path: Path,
) -> None:
    (tmp_path / "metrics.jsonl").touch()  # a run that stopped before its first line
    assert _run(tmp_path, [5.0]).kept is None
    (tmp_path / "config.1.json").write_text("{}")  # a file of the user's, say
    assert _run(tmp_path, [4.0]).kept == tmp_path / "metrics.2.jsonl"
    assert _losses(tmp_path / "metrics.2.jsonl") == [5.0]
    assert (tmp_path / "config.1.json").read_text() == "{}"
    assert json.loads((tmp_path / "config.2.json").read_text())["resume"] is False

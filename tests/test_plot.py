"""`ddpkit plot` on synthetic run folders: through the CLI as a user runs it, and the API."""

from __future__ import annotations

import json
import logging
import math
import sys
from pathlib import Path
from typing import Any

import pytest

from ddpkit.errors import ConfigError
from ddpkit.plot import plot_runs, read_metrics
from tests.conftest import run_cli

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
CHARTS = ["loss.png", "eval.png", "throughput.png"]


def _records(speed: float, epochs: int = 3, steps_per_epoch: int = 20) -> list[dict[str, Any]]:
    lines: list[dict[str, Any]] = []
    step, elapsed = 0, 0.0
    for epoch in range(epochs):
        for _ in range(steps_per_epoch):
            step += 1
            elapsed += 256 / speed
            loss = 2.3 * math.exp(-step / 15) + 0.05
            if step % 5 == 0:
                lines.append(
                    {
                        "kind": "step",
                        "step": step,
                        "epoch": epoch,
                        "time": elapsed,
                        "loss": loss,
                        "lr": 0.001,
                        "grad_norm": 1.5,
                        "samples_per_s": speed,
                    }
                )
        lines.append(
            {
                "kind": "epoch",
                "step": step,
                "epoch": epoch + 1,
                "time": elapsed,
                "loss": loss,
                "lr": 0.001,
                "samples_per_s": speed,
                "eval_loss": loss * 1.1,
                "eval_samples": 360,
                "accuracy": 1 - 0.5 / (epoch + 1),
            }
        )
    return lines


def _write_run(folder: Path, lines: list[Any]) -> Path:
    """A run folder as a training run leaves it; `lines` are dicts (JSON) or raw text."""
    folder.mkdir(parents=True, exist_ok=True)
    text = "".join((ln if isinstance(ln, str) else json.dumps(ln)) + "\n" for ln in lines)
    (folder / "metrics.jsonl").write_text(text)
    (folder / "config.json").write_text(json.dumps({"epochs": 3, "batch_size": 64}))
    return folder


def _assert_png(path: Path, min_bytes: int = 10_000) -> None:
    assert path.is_file(), f"{path} was not written"
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, f"{path} is not a PNG"
    assert min_bytes < len(data) < 2_000_000, f"{path} has {len(data)} bytes"


def _one_error_line(proc: Any, *needles: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("ddpkit: error:")
    for needle in needles:
        assert needle in lines[0], lines[0]


# --- read_metrics (no matplotlib needed) ---------------------------------------------------


def test_read_metrics_keeps_step_and_epoch_records_in_order(tmp_path: Path) -> None:
    run = _write_run(
        tmp_path / "run",
        [
            {"kind": "step", "step": 1, "loss": 0.5, "future_field": [1, 2]},
            {"kind": "checkpoint", "step": 1, "path": "ckpt.pt"},  # unknown kind: ignored
            "",
            {"kind": "epoch", "step": 2, "epoch": 1, "loss": None, "accuracy": 0.5},
        ],
    )
    records = read_metrics(run)
    assert [r["kind"] for r in records] == ["step", "epoch"]
    assert records[0]["future_field"] == [1, 2] and records[1]["loss"] is None


def test_read_metrics_skips_malformed_lines_with_one_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    good = {"kind": "step", "step": 1, "loss": 0.5}
    run = _write_run(tmp_path / "run", [good, "{not json", "[1, 2]", "42", good, '{"kind": "st'])
    with caplog.at_level(logging.WARNING, logger="ddpkit"):
        records = read_metrics(run)
    assert records == [good, good]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "skipped 4 malformed line(s)" in warnings[0] and "2, 3, 4, 6" in warnings[0]


@pytest.mark.parametrize(
    ("make", "needles"),
    [
        (lambda d: None, ["does not exist", "metrics.jsonl"]),
        (lambda d: d.mkdir(), ["has no metrics.jsonl"]),
        (lambda d: d.write_text("x"), ["is not a folder"]),
        (lambda d: _write_run(d, []), ["is empty", "one JSON object per line"]),
        (lambda d: _write_run(d, ["{bad", {"kind": "other"}]), ["no 'step' or 'epoch' line"]),
    ],
    ids=["missing", "no-metrics-file", "a-file", "empty-file", "nothing-usable"],
)
def test_read_metrics_names_the_folder_and_what_it_expected(
    tmp_path: Path, make: Any, needles: list[str]
) -> None:
    folder = tmp_path / "my-run"
    make(folder)
    with pytest.raises(ConfigError) as info:
        read_metrics(folder)
    assert "my-run" in str(info.value)
    for needle in needles:
        assert needle in str(info.value)


def test_missing_matplotlib_is_a_config_error_naming_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = _write_run(tmp_path / "run", _records(1000.0))
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` fails
    with pytest.raises(ConfigError, match=r"pip install 'ddpkit\[plot\]'"):
        plot_runs([run], tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_label_count_must_match_run_count(tmp_path: Path) -> None:
    run = _write_run(tmp_path / "run", _records(1000.0))
    with pytest.raises(ConfigError, match="one --label per RUN_DIR"):
        plot_runs([run], tmp_path / "out", labels=["a", "b"])


# --- charts ------------------------------------------------------------------------------


def test_api_writes_three_valid_pngs(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    run = _write_run(tmp_path / "run", _records(15_000.0))
    written = plot_runs([run], tmp_path / "charts")
    assert written == [tmp_path / "charts" / name for name in CHARTS]
    for path in written:
        _assert_png(path)


def test_eval_chart_is_skipped_without_eval_metrics(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    lines = [
        {"kind": "step", "step": s, "time": s * 0.1, "loss": 1 / s, "samples_per_s": 900.0}
        for s in range(1, 30)
    ]
    lines.append({"kind": "epoch", "step": 29, "epoch": 1, "loss": 0.1, "eval_samples": 10})
    run = _write_run(tmp_path / "run", lines)
    written = plot_runs([run], tmp_path / "out")
    assert [p.name for p in written] == ["loss.png", "throughput.png"]


def test_sparse_and_odd_values_still_plot(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    run = _write_run(
        tmp_path / "run",
        [
            {"kind": "step", "step": 1, "loss": 0.9},  # no time, no throughput
            {"kind": "step", "step": 2, "loss": None, "samples_per_s": "fast"},
            {"kind": "step", "step": 3, "loss": float("nan"), "time": True},
            {"kind": "epoch", "epoch": 1, "accuracy": 0.4},  # no step
        ],
    )
    written = plot_runs([run], tmp_path / "out")
    assert [p.name for p in written] == ["loss.png", "eval.png"]
    for path in written:
        _assert_png(path, min_bytes=5_000)


def test_cli_single_run_writes_into_the_run_folder(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    run = _write_run(tmp_path / "run", _records(15_000.0))
    proc = run_cli("plot", str(run), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [str(run / name) for name in CHARTS]
    for name in CHARTS:
        _assert_png(run / name)


def test_cli_overlays_two_runs_with_labels_into_out(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    slow = _write_run(tmp_path / "nproc2", _records(15_000.0))
    fast = _write_run(tmp_path / "nproc4", _records(27_000.0, epochs=4))
    out = tmp_path / "compare"
    proc = run_cli(
        "plot",
        str(slow),
        str(fast),
        "--out",
        str(out),
        "--label",
        "2 ranks",
        "--label",
        "4 ranks",
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [str(out / name) for name in CHARTS]
    single = plot_runs([slow], tmp_path / "single")
    for name, alone in zip(CHARTS, single, strict=True):
        _assert_png(out / name)
        assert (out / name).read_bytes() != alone.read_bytes()  # both runs are drawn


def test_cli_several_runs_default_to_plots_in_cwd(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    a = _write_run(tmp_path / "runs" / "a", _records(1000.0))
    b = _write_run(tmp_path / "runs" / "b", _records(2000.0))
    proc = run_cli("plot", "runs/a", str(b), cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [str(Path("plots") / name) for name in CHARTS]
    for name in CHARTS:
        _assert_png(tmp_path / "plots" / name)
    assert not (a / "loss.png").exists()


def test_cli_skips_malformed_lines_with_a_warning(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    lines: list[Any] = list(_records(5000.0))
    lines.insert(2, "{oops")
    lines.append('{"kind": "step", "step": 99, "lo')  # cut off mid-write
    run = _write_run(tmp_path / "run", lines)
    proc = run_cli("plot", str(run), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    warning = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(warning) == 1 and warning[0].startswith("ddpkit: warning: skipped 2 malformed")
    _assert_png(run / "loss.png")


def test_cli_missing_folder_is_one_error_line(tmp_path: Path) -> None:
    _one_error_line(run_cli("plot", str(tmp_path / "nope")), "nope", "does not exist")


def test_cli_folder_without_metrics_is_one_error_line(tmp_path: Path) -> None:
    good = _write_run(tmp_path / "good", _records(1000.0))
    (tmp_path / "empty-run").mkdir()
    proc = run_cli("plot", str(good), str(tmp_path / "empty-run"), "--out", str(tmp_path / "o"))
    _one_error_line(proc, "empty-run", "has no metrics.jsonl")
    assert not (tmp_path / "o").exists()  # nothing written when one input is bad


def test_cli_empty_metrics_file_is_one_error_line(tmp_path: Path) -> None:
    run = _write_run(tmp_path / "run", [])
    _one_error_line(run_cli("plot", str(run)), "metrics.jsonl is empty")


def test_time_of_a_resumed_run_continues_where_it_stopped() -> None:
    from ddpkit.plot import _continuous_time

    times = [1.0, 2.0, None, 3.0, 0.5, 1.5, 0.2]  # resumed after 3.0 s, then after 1.5 s
    records = [{"kind": "step", "step": i, "time": t} for i, t in enumerate(times)]
    assert [r["time"] for r in _continuous_time(records)] == [1.0, 2.0, None, 3.0, 3.5, 4.5, 4.7]
    assert records[4]["time"] == 0.5  # the caller's records are left as they were

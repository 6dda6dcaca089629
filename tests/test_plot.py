"""`ddpkit plot` on synthetic run folders: through the CLI as a user runs it, and the API."""

from __future__ import annotations

import json
import logging
import math
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from ddpkit.errors import ConfigError
from ddpkit.records.plot import (
    _charts,
    _count,
    _eval_metrics,
    _load_runs,
    _run_styles,
    plot_runs,
    read_metrics,
)
from tests.conftest import run_cli

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
CHARTS = ["loss.png", "eval.png", "throughput.png", "lr.png", "grad_norm.png"]


def _records(
    speed: float, epochs: int = 3, steps_per_epoch: int = 20, batch: int = 256
) -> list[dict[str, Any]]:
    """The metrics.jsonl lines of a run of `batch` samples per step (all ranks), as
    ddpkit's run log writes them. The learning rate falls 10-fold per epoch."""
    lines: list[dict[str, Any]] = []
    step, elapsed = 0, 0.0
    for epoch in range(epochs):
        for _ in range(steps_per_epoch):
            step += 1
            elapsed += batch / speed
            loss = 2.3 * math.exp(-step / 15) + 0.05
            if step % 5 == 0:
                lines.append(
                    {
                        "kind": "step",
                        "step": step,
                        "epoch": epoch,
                        "time": elapsed,
                        "samples_seen": step * batch,
                        "loss": loss,
                        "lr": 0.001 * 0.1 ** (step / steps_per_epoch),
                        "grad_norm": 1.5 + step % 3,
                        "samples_per_s": speed,
                    }
                )
        lines.append(
            {
                "kind": "epoch",
                "step": step,
                "epoch": epoch + 1,
                "time": elapsed,
                "samples_seen": step * batch,
                "loss": loss,
                "lr": 0.001 * 0.1 ** (step / steps_per_epoch),
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
        (
            lambda d: _write_run(d, ["{bad", {"kind": "other"}]),
            ["no 'step', 'epoch' or 'profile' line"],
        ),
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
    assert proc.stdout == f"wrote 5 chart(s) to {run}{os.sep}: {', '.join(CHARTS)}\n"
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
    assert proc.stdout.splitlines() == [f"wrote 5 chart(s) to {out}{os.sep}: {', '.join(CHARTS)}"]
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
    assert proc.stdout.splitlines() == [f"wrote 5 chart(s) to plots{os.sep}: {', '.join(CHARTS)}"]
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
    from ddpkit.records.plot import _continuous_time

    times = [1.0, 2.0, None, 3.0, 0.5, 1.5, 0.2]  # resumed after 3.0 s, then after 1.5 s
    records = [{"kind": "step", "step": i, "time": t} for i, t in enumerate(times)]
    assert [r["time"] for r in _continuous_time(records)] == [1.0, 2.0, None, 3.0, 3.5, 4.5, 4.7]
    assert records[4]["time"] == 0.5  # the caller's records are left as they were


def test_nothing_to_plot_names_the_metrics_file(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    run = _write_run(tmp_path / "run", [{"kind": "step", "step": 1, "loss": None}])
    with pytest.raises(ConfigError, match="nothing to plot") as info:
        plot_runs([run], tmp_path / "out")
    assert f"in the metrics.jsonl of {run}" in str(info.value)
    assert not (tmp_path / "out").exists()


# --- learning rate and gradient norm -------------------------------------------------------


def _lines(fig: Any, panel: int = 0) -> list[Any]:
    return list(fig.axes[panel].lines)


def _xs(line: Any) -> list[float]:
    """The x values a line of a chart was drawn at."""
    return [float(v) for v in line.get_xdata()]


def _ys(line: Any) -> list[float]:
    return [float(v) for v in line.get_ydata()]


def test_lr_and_grad_norm_charts_draw_the_logged_values(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    records = _records(1000.0)
    run = _write_run(tmp_path / "run", records)
    charts = _charts(_load_runs([run], None, "step"), "step")
    (lr,) = _lines(charts["lr.png"])
    lr_by_step = {r["step"]: r["lr"] for r in records}  # epoch lines repeat their last step's
    assert _xs(lr) == list(lr_by_step)
    assert _ys(lr) == list(lr_by_step.values())
    (grad_norm,) = _lines(charts["grad_norm.png"])  # from the step lines only
    steps = [r for r in records if r["kind"] == "step"]
    assert _xs(grad_norm) == [r["step"] for r in steps]
    assert _ys(grad_norm) == [r["grad_norm"] for r in steps]
    assert charts["lr.png"].axes[0].get_yscale() == "log"  # lr decays 100-fold and more


@pytest.mark.parametrize(("epochs", "decades"), [(3, 3), (9, 9)])
def test_log_axis_of_the_learning_rate_has_labelled_ticks(
    tmp_path: Path, epochs: int, decades: int
) -> None:
    pytest.importorskip("matplotlib")
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    run = _write_run(tmp_path / "run", _records(1000.0, epochs=epochs))  # lr: 10x down an epoch
    fig = _charts(_load_runs([run], None, "step"), "step")["lr.png"]
    FigureCanvasAgg(fig)
    fig.savefig(tmp_path / "lr.png")  # places the ticks
    ax = fig.axes[0]
    low, high = ax.get_ylim()
    assert high / low > 10**decades and ax.get_yscale() == "log"
    labels = [t.get_text() for t in ax.get_yticklabels() if low <= t.get_position()[1] <= high]
    assert 3 <= len([t for t in labels if t]) <= 15, labels


def test_grad_norm_chart_is_skipped_only_when_no_run_has_one(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    no_norm = [{**r, "grad_norm": None} if r["kind"] == "step" else r for r in _records(900.0)]
    a = _write_run(tmp_path / "a", no_norm)
    b = _write_run(tmp_path / "b", no_norm)
    with_norm = _write_run(tmp_path / "c", _records(900.0))
    written = plot_runs([a, b], tmp_path / "none")
    assert [p.name for p in written] == ["loss.png", "eval.png", "throughput.png", "lr.png"]
    assert not (tmp_path / "none" / "grad_norm.png").exists()
    written = plot_runs([a, with_norm], tmp_path / "one")
    assert "grad_norm.png" in [p.name for p in written]
    _assert_png(tmp_path / "one" / "grad_norm.png")
    _assert_png(tmp_path / "one" / "lr.png")


def test_cli_prints_one_line_naming_the_folder_and_the_charts(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    no_norm = [{**r, "grad_norm": None} if r["kind"] == "step" else r for r in _records(900.0)]
    a = _write_run(tmp_path / "a", no_norm)
    b = _write_run(tmp_path / "b", no_norm)
    proc = run_cli("plot", str(a), str(b), "--out", str(tmp_path / "cmp"), timeout=120)
    assert proc.returncode == 0, proc.stderr
    folder = f"{tmp_path / 'cmp'}{os.sep}"
    charts = "loss.png, eval.png, throughput.png, lr.png"
    assert proc.stdout.splitlines() == [f"wrote 4 chart(s) to {folder}: {charts}"]
    assert sorted(p.name for p in (tmp_path / "cmp").iterdir()) == sorted(charts.split(", "))


# --- x axis: samples seen ------------------------------------------------------------------


def test_samples_axis_draws_against_samples_seen(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    small = _write_run(tmp_path / "b256", _records(1000.0, batch=256))
    large = _write_run(tmp_path / "b1024", _records(1000.0, batch=1024, epochs=1))
    charts = _charts(_load_runs([small, large], None, "samples"), "samples")
    for name in ("loss.png", "lr.png", "grad_norm.png"):
        ax = charts[name].axes[0]
        assert ax.get_xlabel() == "samples seen (all ranks)"
        assert ax.lines, name
        for line in ax.lines:  # samples seen, all multiples of 256; steps are all below 256
            xs = _xs(line)
            assert all(x >= 256 and x % 256 == 0 for x in xs), (name, xs)
    loss = charts["loss.png"].axes[0]
    step_lines = [ln for ln in loss.lines if len(_xs(ln)) > 3]
    assert _xs(step_lines[0]) == [256 * s for s in range(5, 61, 5)]
    assert _xs(step_lines[-1]) == [1024 * s for s in range(5, 21, 5)]
    by_samples, by_time = charts["throughput.png"].axes
    assert by_samples.get_title() == "by samples seen" and by_time.get_title() == "by elapsed time"


def test_samples_seen_is_not_an_eval_metric(tmp_path: Path) -> None:
    run = _write_run(tmp_path / "run", _records(1000.0))
    assert _eval_metrics(_load_runs([run], None, "step")) == ["accuracy"]


def test_cli_x_samples_writes_other_charts_than_by_step(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    a = _write_run(tmp_path / "a", _records(1000.0, batch=128))
    b = _write_run(tmp_path / "b", _records(1000.0, batch=512))
    by_samples = run_cli("plot", str(a), str(b), "--x", "samples", "--out", str(tmp_path / "s"))
    assert by_samples.returncode == 0, by_samples.stderr
    by_step = run_cli("plot", str(a), str(b), "--out", str(tmp_path / "t"))
    assert by_step.returncode == 0, by_step.stderr
    for name in CHARTS:
        _assert_png(tmp_path / "s" / name)
    assert (tmp_path / "s" / "loss.png").read_bytes() != (tmp_path / "t" / "loss.png").read_bytes()


def test_cli_samples_axis_of_a_log_without_samples_seen_is_one_error_line(
    tmp_path: Path,
) -> None:
    full = _write_run(tmp_path / "full-run", _records(1000.0))
    bare_lines = [{k: v for k, v in r.items() if k != "samples_seen"} for r in _records(1000.0)]
    bare = _write_run(tmp_path / "bare-run", bare_lines)
    out = tmp_path / "out"
    proc = run_cli("plot", str(full), str(bare), "--x", "samples", "--out", str(out))
    _one_error_line(
        proc,
        f"{bare / 'metrics.jsonl'} has no samples_seen in any line, so it cannot be drawn by "
        "samples seen: plot that run with --x step or --x time, or rerun its training with "
        "ddpkit, which logs samples_seen",
    )
    assert "full-run" not in proc.stderr
    assert not out.exists()
    proc = run_cli("plot", str(full), str(bare), "--x", "step", "--out", str(out), timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_cli_rejects_an_unknown_x_axis(tmp_path: Path) -> None:
    run = _write_run(tmp_path / "run", _records(1000.0))
    proc = run_cli("plot", str(run), "--x", "epochs")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "step" in proc.stderr and "samples" in proc.stderr


# --- telling runs apart --------------------------------------------------------------------


def test_any_two_of_twenty_runs_differ_in_two_of_colour_marker_linestyle() -> None:
    styles = _run_styles(20)
    for i, a in enumerate(styles):
        for b in styles[i + 1 :]:
            same = (a.color == b.color) + (a.marker == b.marker) + (a.linestyle == b.linestyle)
            assert same <= 1, (a, b)


def test_identical_runs_get_distinct_lines_with_sparse_markers(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    lines = _records(1000.0, steps_per_epoch=200)  # 120 step points: a dense line
    a = _write_run(tmp_path / "seed0", lines)
    b = _write_run(tmp_path / "copy", lines)
    charts = _charts(_load_runs([a, b], None, "step"), "step")
    for name in ("loss.png", "lr.png", "grad_norm.png"):
        ax = charts[name].axes[0]
        first, second = [ln for ln in ax.lines if len(_xs(ln)) == 120]
        assert _ys(first) == _ys(second)  # they would hide each other
        assert first.get_color() != second.get_color()
        assert first.get_linestyle() != second.get_linestyle()
        assert first.get_marker() != second.get_marker()
        # Sparse markers, at other places along the line for each run.
        assert first.get_markevery() is not None and second.get_markevery() is not None
        assert first.get_markevery() != second.get_markevery()
    # Eval lines are short, with a marker on every point: the first run's are bigger.
    first, second = charts["eval.png"].axes[0].lines
    assert _ys(first) == _ys(second) and first.get_markevery() is None
    assert first.get_markersize() > second.get_markersize()
    run_legend: Any = charts["loss.png"].axes[0].artists[0]
    legend_lines = run_legend.get_lines()
    assert len({(ln.get_linestyle(), ln.get_marker()) for ln in legend_lines}) == 2


@pytest.mark.parametrize(
    ("value", "text"),
    [(0, "0"), (5000, "5,000"), (20_000, "20k"), (150_000, "150k"), (2.5e6, "2.5M"), (3e9, "3G")],
)
def test_samples_ticks_are_short(value: float, text: str) -> None:
    assert _count(value, short=True) == text
    assert _count(20_000, short=False) == "20,000"  # steps keep their thousands separators

"""Charts of one or more training runs, read from the runs' `metrics.jsonl`.

A run folder holds `metrics.jsonl`, one JSON object per line. The lines ddpkit plots are

    {"kind": "step", "step": 50, "epoch": 0, "time": 3.2, "loss": 0.41, "samples_per_s": 15300.0}
    {"kind": "epoch", "step": 230, "epoch": 1, "time": 12.9, "loss": 0.12, "eval_loss": 0.09,
     "accuracy": 0.981}

Any field may be missing or null; unknown kinds are ignored, and malformed lines and values
of plotted fields that are not numbers (text, true/false) are skipped with a warning. NaN,
infinities and numbers beyond ±1e200 are gaps in the lines. Every numeric field of an epoch
line that is not one of the bookkeeping or training fields below (`_NOT_EVAL_METRICS`) is an
eval metric and gets a panel in `eval.png`.

matplotlib is an optional extra (`pip install 'ddpkit[plot]'`), imported only by `plot_runs`.
It draws on its own Agg canvas, never through pyplot, so the caller's backend is untouched.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ddpkit.errors import ConfigError

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["METRICS_FILE", "plot_runs", "read_metrics"]

log = logging.getLogger("ddpkit")

METRICS_FILE = "metrics.jsonl"
_KINDS = ("step", "epoch")
# Numeric fields of an epoch line that are not eval metrics (eval_loss has its place in loss.png).
_NOT_EVAL_METRICS = frozenset(
    {
        "kind",
        "step",
        "epoch",
        "time",
        "loss",
        "lr",
        "grad_norm",
        "samples_per_s",
        "samples",
        "eval_loss",
        "eval_samples",
        "eval_time",
        "train_time",
        "world_size",
        "nproc",
    }
)
# The fields drawn besides the eval metrics (every other field of an epoch line).
_PLOTTED = frozenset({"step", "epoch", "time", "loss", "eval_loss", "samples_per_s"})
# Larger numbers are not drawn: matplotlib's axis arithmetic overflows near 1e308.
_LARGEST = 1e200
_MISSING_MATPLOTLIB = "ddpkit plot needs matplotlib: pip install 'ddpkit[plot]'"
_DPI = 110
# Loss on a log axis when it is positive and spans at least this ratio (max / min).
_LOG_SCALE_RATIO = 30.0
_SHOWN_BAD_LINES = 5
# Step lines are many and noisy: thin. Epoch lines are few: big markers, no line.
# Epoch markers and eval lines are drawn above the step lines (zorder).
_STEP_LINE: dict[str, Any] = {"linewidth": 1.0, "alpha": 0.8}
_EPOCH_MARKER: dict[str, Any] = {
    "linestyle": "none",
    "marker": "o",
    "markersize": 7,
    "markeredgecolor": "white",
    "zorder": 3,
}
_EVAL_LINE: dict[str, Any] = {
    "linestyle": "--",
    "linewidth": 1.8,
    "marker": "s",
    "markersize": 6,
    "markeredgecolor": "white",
    "zorder": 3,
}
# Above this many points a step line is a dense band: fainter, so what is on top stays visible.
_DENSE_POINTS = 400


@dataclass(frozen=True)
class _Run:
    label: str
    records: list[dict[str, Any]]


Series = tuple[list[float], list[float]]


def read_metrics(run_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The `step` and `epoch` records of `run_dir/metrics.jsonl`, in file order.

    Blank lines and lines of other kinds are ignored; lines that are not one JSON object are
    skipped with a warning on the `ddpkit` logger. Raises `ConfigError` when the folder or its
    metrics file is missing, cannot be read, or holds no step or epoch record.
    """
    folder = Path(run_dir)
    hint = f"pass a run folder that a training run wrote (it holds {METRICS_FILE})"
    if not folder.exists():
        raise ConfigError(f"run folder {folder} does not exist: {hint}")
    if not folder.is_dir():
        raise ConfigError(f"{folder} is not a folder: {hint}")
    path = folder / METRICS_FILE
    if path.exists() and not path.is_file():
        raise ConfigError(f"{path} is not a regular file: {hint}")
    if not path.is_file():
        raise ConfigError(
            f"run folder {folder} has no {METRICS_FILE}: {hint}, one JSON object per line"
        )
    records: list[dict[str, Any]] = []
    bad: list[int] = []
    not_numbers: list[str] = []
    seen_any = False
    try:
        with path.open(encoding="utf-8", errors="replace") as f:
            for lineno, line in enumerate(f, 1):
                text = line.strip()
                if not text:
                    continue
                seen_any = True
                try:
                    obj = json.loads(text)
                except ValueError:
                    bad.append(lineno)
                    continue
                if not isinstance(obj, dict):
                    bad.append(lineno)
                elif obj.get("kind") in _KINDS:
                    records.append(obj)
                    not_numbers += [f"line {lineno} {k!r}: {v}" for k, v in _not_numbers(obj)]
    except OSError as exc:
        raise ConfigError(f"cannot read {path} ({exc.strerror}): check its permissions") from None
    if bad:
        shown = ", ".join(str(n) for n in bad[:_SHOWN_BAD_LINES])
        more = f" and {len(bad) - _SHOWN_BAD_LINES} more" if len(bad) > _SHOWN_BAD_LINES else ""
        log.warning(
            "skipped %d malformed line(s) of %s (line(s) %s%s): each line must be one JSON object",
            len(bad),
            path,
            shown,
            more,
        )
    if not_numbers:
        hidden = len(not_numbers) - _SHOWN_BAD_LINES
        log.warning(
            "skipped %d value(s) of %s that are not numbers (%s%s): a metric must be a "
            "number or null",
            len(not_numbers),
            path,
            ", ".join(not_numbers[:_SHOWN_BAD_LINES]),
            f" and {hidden} more" if hidden > 0 else "",
        )
    if not records:
        what = "is empty" if not seen_any else "holds no 'step' or 'epoch' line"
        raise ConfigError(
            f"{path} {what}: expected one JSON object per line such as "
            '{"kind": "step", "step": 1, "loss": 0.5}; did the run log any step?'
        )
    return records


def plot_runs(
    run_dirs: Sequence[str | os.PathLike[str]],
    out_dir: str | os.PathLike[str],
    *,
    labels: Sequence[str] | None = None,
) -> list[Path]:
    """Write `loss.png`, `eval.png` and `throughput.png` of the runs into `out_dir`.

    Several runs are overlaid on the same axes, one colour each; the legend names them by
    their folder's name or by `labels` (one per run, in order). A chart with nothing to show
    (e.g. `eval.png` of runs without eval metrics) is not written. Returns the paths written.
    """
    if isinstance(run_dirs, (str, os.PathLike)):
        run_dirs = [run_dirs]
    if not run_dirs:
        raise ConfigError("no run folder given: pass at least one RUN_DIR")
    if labels is not None and len(labels) != len(run_dirs):
        raise ConfigError(
            f"got {len(labels)} label(s) for {len(run_dirs)} run folder(s): "
            "give one --label per RUN_DIR, in the same order"
        )
    names = list(labels) if labels is not None else _default_labels(run_dirs)
    runs = [
        _Run(name, _continuous_time(read_metrics(d)))
        for name, d in zip(names, run_dirs, strict=True)
    ]
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"output folder {out} is a file: pass another --out folder")

    try:
        import matplotlib  # noqa: F401  (a clear error before any submodule import)
        from matplotlib.backends.backend_agg import FigureCanvasAgg
    except ImportError:
        raise ConfigError(_MISSING_MATPLOTLIB) from None

    charts = {
        "loss.png": _loss_chart(runs),
        "eval.png": _eval_chart(runs),
        "throughput.png": _throughput_chart(runs),
    }
    if all(fig is None for fig in charts.values()):
        raise ConfigError(
            "nothing to plot: no loss, samples_per_s or eval metric that can be drawn (a number "
            "within ±1e200) in the {METRICS_FILE} of "
            f"{', '.join(str(d) for d in run_dirs)}"
        )
    new_folders = [p for p in (out, *out.parents) if not p.exists()]  # deepest first
    written: list[Path] = []
    try:
        out.mkdir(parents=True, exist_ok=True)
        for name, fig in charts.items():
            if fig is None:
                continue
            FigureCanvasAgg(fig)  # draw on Agg: no pyplot, no GUI, no global backend switch
            path = out / name
            if not path.exists():
                written.append(path)  # removed again if a later chart fails
            fig.savefig(path, dpi=_DPI)
    except BaseException as exc:
        for path in written:
            path.unlink(missing_ok=True)
        for folder in new_folders:
            with contextlib.suppress(OSError):
                folder.rmdir()
        if isinstance(exc, OSError):
            raise ConfigError(
                f"cannot write the charts to {out} ({exc.strerror}): pass another --out folder"
            ) from None
        raise
    return [out / name for name, fig in charts.items() if fig is not None]


# --- data -------------------------------------------------------------------------------------


def _default_labels(run_dirs: Sequence[str | os.PathLike[str]]) -> list[str]:
    """Each folder's name; `parent/name` where two runs share a name."""
    paths = [Path(d).resolve() for d in run_dirs]
    names = [p.name or str(p) for p in paths]
    for i, p in enumerate(paths):
        if names.count(p.name or str(p)) > 1:
            names[i] = f"{p.parent.name}/{p.name}"
    seen: dict[str, int] = {}
    for i, name in enumerate(names):
        seen[name] = seen.get(name, 0) + 1
        if seen[name] > 1:
            names[i] = f"{name} #{seen[name]}"
    return names


def _continuous_time(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records with `time` counted on from where it stopped when it starts again: a
    resumed run appends to the same metrics.jsonl, and its clock restarts at 0."""
    out: list[dict[str, Any]] = []
    offset, prev_raw, prev = 0.0, None, 0.0
    for record in records:
        raw = _number(record.get("time"))
        if raw is not None:
            if prev_raw is not None and raw < prev_raw:
                offset = prev
            prev_raw, prev = raw, raw + offset
            record = {**record, "time": prev}
        out.append(record)
    return out


def _number(value: object) -> float | None:
    """A float that can be drawn, or None for anything else (missing, null, text, bool,
    NaN, inf, or beyond ±_LARGEST)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:  # an int too large for a float
        return None
    return number if abs(number) <= _LARGEST else None  # False for NaN too


def _not_numbers(record: dict[str, Any]) -> list[tuple[str, str]]:
    """The plotted fields of `record` whose value is neither a number nor null, with the
    value as JSON (shortened)."""
    eval_line = record.get("kind") == "epoch"
    return [
        (key, json.dumps(value)[:20])
        for key, value in record.items()
        if (key in _PLOTTED or (eval_line and key not in _NOT_EVAL_METRICS))
        and value is not None
        and (isinstance(value, bool) or not isinstance(value, (int, float)))
    ]


def _series(records: Iterable[dict[str, Any]], kinds: Sequence[str], x: str, y: str) -> Series:
    """Points (x, y) of the records of `kinds` that have both, sorted by x; where an x repeats
    (a resumed run logs some steps again), the last record wins."""
    points: dict[float, float] = {}
    for record in records:
        if record.get("kind") not in kinds:
            continue
        xv, yv = _number(record.get(x)), _number(record.get(y))
        if xv is not None and yv is not None:
            points[xv] = yv
    xs = sorted(points)
    return xs, [points[v] for v in xs]


def _eval_metrics(runs: Sequence[_Run]) -> list[str]:
    names: dict[str, None] = {}
    for run in runs:
        for record in run.records:
            if record.get("kind") != "epoch":
                continue
            for key, value in record.items():
                if key not in _NOT_EVAL_METRICS and _number(value) is not None:
                    names.setdefault(key, None)
    return list(names)


# --- drawing ----------------------------------------------------------------------------------


def _new_figure(width: float, height: float) -> Figure:
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), layout="constrained")


def _title(base: str, runs: Sequence[_Run]) -> str:
    return f"{base} — {runs[0].label}" if len(runs) == 1 else base


def _line(ax: Axes, series: Series, color: str, **style: Any) -> bool:
    """Plot one series; False when it has no point. A lone point gets a marker."""
    xs, ys = series
    if not xs:
        return False
    if len(xs) == 1 and style.get("marker") is None:
        style["marker"] = "o"
    if len(xs) > _DENSE_POINTS and style.get("linestyle") != "none":
        style["alpha"] = min(style.get("alpha", 1.0), 0.45)
    ax.plot(xs, ys, color=color, **style)
    return True


def _legends(
    ax: Axes,
    run_labels: Sequence[str],
    colors: Sequence[str],
    styles: dict[str, dict[str, Any]],
    *,
    title: str = "run",
) -> None:
    """Legends right of the axes, where they never hide data: the runs (colours, when
    `run_labels` is not empty) on top and the series styles (in grey) at the bottom."""
    from matplotlib.lines import Line2D

    outside = {"borderaxespad": 0.0, "fontsize": 9}
    if run_labels:
        run_handles = [Line2D([], [], color=c, linewidth=2.5) for c in colors]
        runs = ax.legend(
            run_handles,
            list(run_labels),
            title=title,
            loc="upper left",
            bbox_to_anchor=(1.02, 1.0),
            **outside,
        )
        if styles:
            ax.add_artist(runs)  # a second ax.legend() would replace it
    if styles:
        style_handles = [Line2D([], [], color="0.3", **kw) for kw in styles.values()]
        ax.legend(
            style_handles, list(styles), loc="lower left", bbox_to_anchor=(1.02, 0.0), **outside
        )


def _style_axes(ax: Axes, title: str, xlabel: str, ylabel: str) -> None:
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, which="major", alpha=0.35)
    ax.grid(True, which="minor", alpha=0.12)


def _step_axis(ax: Axes) -> None:
    """Whole steps at round intervals, with thousands separators."""
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True, steps=[1, 2, 2.5, 5, 10]))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:,.0f}"))


def _colors(runs: Sequence[_Run]) -> list[str]:
    return [f"C{i % 10}" for i in range(len(runs))]


def _loss_chart(runs: Sequence[_Run]) -> Figure | None:
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    fig = _new_figure(9.5, 5.5)
    ax = fig.add_subplot()
    colors = _colors(runs)
    styles: dict[str, dict[str, Any]] = {
        "train loss (step)": _STEP_LINE,
        "train loss (epoch mean)": _EPOCH_MARKER,
        "eval loss": _EVAL_LINE,
    }
    used: dict[str, dict[str, Any]] = {}
    values: list[float] = []
    for run, color in zip(runs, colors, strict=True):
        for name, kinds, field in (
            ("train loss (step)", ("step",), "loss"),
            ("train loss (epoch mean)", ("epoch",), "loss"),
            ("eval loss", _KINDS, "eval_loss"),
        ):
            series = _series(run.records, kinds, "step", field)
            if _line(ax, series, color, **styles[name]):
                used[name] = styles[name]
                values += series[1]
    if not used:
        return None
    if min(values) > 0 and max(values) / min(values) >= _LOG_SCALE_RATIO:
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
        ax.yaxis.set_minor_formatter(NullFormatter())
    _step_axis(ax)
    _style_axes(ax, _title("Loss", runs), "optimizer step", "loss")
    _legends(ax, [r.label for r in runs] if len(runs) > 1 else [], colors, used)
    return fig


def _eval_chart(runs: Sequence[_Run]) -> Figure | None:
    from matplotlib.ticker import MaxNLocator, PercentFormatter

    metrics = _eval_metrics(runs)
    if not metrics:
        return None
    fig = _new_figure(9.5, 1.0 + 3.3 * len(metrics))
    axes = fig.subplots(len(metrics), 1, sharex=True, squeeze=False)[:, 0]
    colors = _colors(runs)
    for i, (ax, metric) in enumerate(zip(axes, metrics, strict=True)):
        values: list[float] = []
        shown_labels: list[str] = []
        shown_colors: list[str] = []
        for run, color in zip(runs, colors, strict=True):
            series = _series(run.records, ("epoch",), "epoch", metric)
            if _line(ax, series, color, linewidth=1.8, marker="o", markersize=5):
                values += series[1]
                shown_labels.append(f"{run.label}: {_format(metric, series[1][-1])}")
                shown_colors.append(color)
        if "acc" in metric.lower() and values and all(0 <= v <= 1 for v in values):
            ax.yaxis.set_major_formatter(PercentFormatter(xmax=1))
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        _style_axes(ax, metric, "epoch (completed)" if i == len(metrics) - 1 else "", metric)
        _legends(ax, shown_labels, shown_colors, {}, title="last value")
    fig.suptitle(_title("Evaluation per epoch", runs))
    return fig


def _format(metric: str, value: float) -> str:
    if "acc" in metric.lower() and 0 <= value <= 1:
        return f"{value:.1%}"
    return f"{value:.4g}"


def _time_unit(seconds: float) -> tuple[str, float]:
    if seconds >= 2 * 3600:
        return "hours", 3600.0
    if seconds >= 3 * 60:
        return "minutes", 60.0
    return "seconds", 1.0


def _throughput_chart(runs: Sequence[_Run]) -> Figure | None:
    from matplotlib.ticker import FuncFormatter

    fig = _new_figure(13.0, 5.0)
    by_step, by_time = fig.subplots(1, 2, sharey=True)
    colors = _colors(runs)
    styles: dict[str, dict[str, Any]] = {
        "samples/s (step)": _STEP_LINE,
        "samples/s (epoch mean)": _EPOCH_MARKER,
    }
    step_kinds = {"samples/s (step)": ("step",), "samples/s (epoch mean)": ("epoch",)}
    latest = max(
        (t for run in runs for t in _series(run.records, _KINDS, "time", "samples_per_s")[0]),
        default=0.0,
    )
    unit, scale = _time_unit(latest)
    used: dict[str, dict[str, Any]] = {}
    for run, color in zip(runs, colors, strict=True):
        for name, kinds in step_kinds.items():
            if _line(
                by_step, _series(run.records, kinds, "step", "samples_per_s"), color, **styles[name]
            ):
                used[name] = styles[name]
            xs, ys = _series(run.records, kinds, "time", "samples_per_s")
            if _line(by_time, ([x / scale for x in xs], ys), color, **styles[name]):
                used[name] = styles[name]
    if not used:
        return None
    by_step.set_ylim(bottom=0)
    _step_axis(by_step)
    by_step.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:,.0f}"))
    _style_axes(by_step, "by optimizer step", "optimizer step", "samples / s")
    _style_axes(by_time, "by elapsed time", f"time since start ({unit})", "")
    by_time.tick_params(labelleft=True)
    for ax, field in ((by_step, "step"), (by_time, "time")):
        if not ax.lines:
            ax.text(
                0.5,
                0.5,
                f"no '{field}' field in the runs' {METRICS_FILE}",
                ha="center",
                va="center",
                transform=ax.transAxes,
                color="0.4",
            )
    _legends(by_time, [r.label for r in runs] if len(runs) > 1 else [], colors, used)
    fig.suptitle(_title("Throughput", runs))
    return fig

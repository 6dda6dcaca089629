"""Charts of one or more training runs, read from the runs' `metrics.jsonl`.

A run folder holds `metrics.jsonl`, one JSON object per line. The lines ddpkit plots are

    {"kind": "step", "step": 50, "epoch": 0, "time": 3.2, "samples_seen": 12800, "loss": 0.41,
     "samples_per_s": 15300.0, "lr": 0.001, "grad_norm": 1.7}
    {"kind": "epoch", "step": 230, "epoch": 1, "time": 12.9, "samples_seen": 58880, "loss": 0.12,
     "eval_loss": 0.09, "accuracy": 0.981}
    {"kind": "profile", "step": 230, "time": 12.9, "rank": 1, "steps": 230, "data_ms": 3.1,
     "compute_ms": 20.4, "comm_ms": 1.2, "optimizer_ms": 0.8, "ddpkit_ms": 0.1}

(the last: `--profile`'s breakdown of one rank's steps since its record before, drawn in
`profile.png`: a stacked bar per rank, and the breakdown over the steps).

Any field may be missing or null; unknown kinds are ignored, and malformed lines and values
of plotted fields that are not numbers (text, true/false) are skipped with a warning. NaN,
infinities and numbers beyond ±1e200 are gaps in the lines. Every numeric field of an epoch
line that is not one of the bookkeeping or training fields below (`_NOT_EVAL_METRICS`) is an
eval metric and gets a panel in `eval.png`.

Loss, learning rate, gradient norm and throughput are drawn against one x axis (`X_AXES`): the
optimizer step, the time since the start, or the samples seen (`samples_seen`, all ranks
together), which lines up runs of different batch sizes. Eval metrics are drawn per epoch.

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
from ddpkit.inrank.breakdown import PARTS

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["METRICS_FILE", "X_AXES", "plot_runs", "read_metrics"]

log = logging.getLogger("ddpkit")

METRICS_FILE = "metrics.jsonl"
_KINDS = ("step", "epoch")
_READ = (*_KINDS, "profile")
# The fields drawn besides the eval metrics (every other field of an epoch line).
_X_FIELDS = ("step", "epoch", "time", "samples_seen")  # epoch: eval.png's
_PLOTTED = frozenset((*_X_FIELDS, "loss", "eval_loss", "samples_per_s", "lr", "grad_norm"))
# Numeric fields of an epoch line that are not eval metrics (eval_loss has its place in loss.png).
_BOOKKEEPING = ("kind", "samples", "eval_samples", "eval_time", "train_time", "world_size", "nproc")
_NOT_EVAL_METRICS = _PLOTTED | frozenset(_BOOKKEEPING)
# The x axes a chart can be drawn against (fields step, time and samples_seen: `_x_axis`).
X_AXES = ("step", "time", "samples")
# Larger numbers are not drawn: matplotlib's axis arithmetic overflows near 1e308.
_LARGEST = 1e200
_MISSING_MATPLOTLIB = "ddpkit plot needs matplotlib: pip install 'ddpkit[plot]'"
_DPI = 110
# Loss on a log axis when it is positive and spans at least this ratio (max / min).
_LOG_SCALE_RATIO = 30.0
# Up to this ratio a log axis has ticks at 1, 2 and 5 of each decade.
_FEW_DECADES = 1e4
_SHOWN_BAD_LINES = 5
# Each run has a colour, a line style and a marker; the cycles have coprime-ish lengths
# (10, 4, 7) so that any two of the first 20 runs differ in at least two of the three, and
# identical runs drawn on top of each other stay visible.
_LINESTYLES = ("-", "--", ":", "-.")
_MARKERS = ("o", "s", "^", "D", "v", "P", "X")
# About this many markers along a long line, so that it stays readable however many points
# it has (spaced by points, not by distance: a noisy line is long and would get many more).
_MARKS_PER_LINE = 12
# Markers on every point of the first run are this much bigger than those of the last run.
_MARK_GROWTH = 0.6
_Style = dict[str, Any]  # keywords of Axes.plot() and Line2D
# The kinds of series differ in weight, the runs in colour, line style and marker:
# step lines are many and noisy (thin, small markers), epoch means are few (big markers, no
# line), eval lines are thick with hollow markers. Epoch and eval points are drawn on top.
_STEP_LINE: _Style = dict(linewidth=1.0, alpha=0.8, markersize=4)
_EPOCH_MARKER: _Style = dict(linestyle="none", markersize=8, markeredgecolor="white", zorder=3)
_EVAL_LINE: _Style = dict(linewidth=2.0, markersize=6, markerfacecolor="white", zorder=3)
# How each kind of series looks in the legend (grey, and with the first run's marker shape).
_STEP_KEY: _Style = dict(linewidth=1.0, marker="o", markersize=4)
_EPOCH_KEY: _Style = dict(linestyle="none", marker="o", markersize=8)
_EVAL_KEY: _Style = dict(linewidth=2.0, marker="o", markersize=6, markerfacecolor="white")
# Lines of eval metrics, learning rate and gradient norm.
_VALUE_LINE: _Style = dict(linewidth=1.6, markersize=5)
# How a run looks in the legend.
_RUN_KEY: _Style = dict(linewidth=1.8, markersize=6)
# Lines of up to this many points get a marker on every point (they are not dense).
_ALL_MARKERS = 20
# Above this many points a step line is a dense band: fainter, so what is on top stays visible.
_DENSE_POINTS = 400


@dataclass(frozen=True)
class _RunStyle:
    color: str
    linestyle: str
    marker: str
    mark_offset: float  # where the first sparse marker goes, as a fraction of their spacing
    mark_scale: float  # size of markers on every point: earlier runs' are bigger, so that
    # identical runs' markers (same x, same y) show as shapes one inside the other

    def line(self, **kind: Any) -> _Style:
        """plot() keywords of the run's colour, line style and marker, as changed by `kind`."""
        return {"color": self.color, "linestyle": self.linestyle, "marker": self.marker, **kind}


@dataclass(frozen=True)
class _Run:
    label: str
    records: list[dict[str, Any]]
    style: _RunStyle


@dataclass(frozen=True)
class _Axis:
    """An x axis: which field of the records it reads, its label, and the unit it shows."""

    name: str
    field: str
    label: str
    scale: float = 1.0  # values are divided by it (seconds to minutes or hours)


Series = tuple[list[float], list[float]]


def read_metrics(run_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The `step`, `epoch` and `profile` records of `run_dir/metrics.jsonl`, in file order.

    Blank lines and lines of other kinds are ignored; lines that are not one JSON object are
    skipped with a warning on the `ddpkit` logger. Raises `ConfigError` when the folder or its
    metrics file is missing, cannot be read, or holds no step, epoch or profile record.
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
    bad: list[str] = []
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
                    obj = None
                if not isinstance(obj, dict):
                    bad.append(str(lineno))
                elif obj.get("kind") in _READ:
                    records.append(obj)
                    not_numbers += [f"line {lineno} {k!r}: {v}" for k, v in _not_numbers(obj)]
    except OSError as exc:
        raise ConfigError(f"cannot read {path} ({exc.strerror}): check its permissions") from None
    malformed = "malformed line(s) of %s (line(s) %s%s): each line must be one JSON object"
    not_number = "value(s) of %s that are not numbers (%s%s): a metric must be a number or null"
    for skipped, what in ((bad, malformed), (not_numbers, not_number)):
        if skipped:
            hidden = len(skipped) - _SHOWN_BAD_LINES
            more = f" and {hidden} more" if hidden > 0 else ""
            shown = ", ".join(skipped[:_SHOWN_BAD_LINES])
            log.warning("skipped %d " + what, len(skipped), path, shown, more)
    if not records:
        what = "is empty" if not seen_any else "holds no 'step', 'epoch' or 'profile' line"
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
    x: str = "step",
) -> list[Path]:
    """Write the charts of the runs into `out_dir`: `loss.png`, `eval.png`, `throughput.png`,
    `lr.png` (learning rate), `grad_norm.png` (gradient norm) and `profile.png` (each
    rank's step time, from `--profile`).

    Several runs are overlaid on the same axes, each with its own colour, line style and
    marker; the legend names them by their folder's name or by `labels` (one per run, in
    order). `x` is the x axis of every chart but `eval.png` (which is per epoch): "step"
    (optimizer steps), "time" (since the start) or "samples" (samples seen, all ranks
    together: compares runs of different batch sizes). A chart with nothing to show (e.g.
    `eval.png` of runs without eval metrics, or `grad_norm.png` when it was never logged) is
    not written. Returns the paths written.
    """
    if isinstance(run_dirs, (str, os.PathLike)):
        run_dirs = [run_dirs]
    if not run_dirs:
        raise ConfigError("no run folder given: pass at least one RUN_DIR")
    if x not in X_AXES:
        raise ConfigError(f"unknown x axis {x!r}: pass one of {', '.join(X_AXES)}")
    if labels is not None and len(labels) != len(run_dirs):
        raise ConfigError(
            f"got {len(labels)} label(s) for {len(run_dirs)} run folder(s): "
            "give one --label per RUN_DIR, in the same order"
        )
    runs = _load_runs(run_dirs, labels, x)
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"output folder {out} is a file: pass another --out folder")

    try:
        import matplotlib  # noqa: F401  (a clear error before any submodule import)
    except ImportError:
        raise ConfigError(_MISSING_MATPLOTLIB) from None

    charts = _charts(runs, x)
    if not charts:
        raise ConfigError(
            "nothing to plot: no loss, lr, grad_norm, samples_per_s, eval metric or profile "
            f"that can be drawn (a number within ±1e200) in the {METRICS_FILE} of "
            f"{', '.join(str(d) for d in run_dirs)}"
        )
    _save(charts, out)
    return [out / name for name in charts]


def _load_runs(
    run_dirs: Sequence[str | os.PathLike[str]], labels: Sequence[str] | None, x: str
) -> list[_Run]:
    """The runs' records, legend names and styles; `ConfigError` when one cannot be drawn
    against the x axis `x` (a run without samples_seen, by samples)."""
    names = list(labels) if labels is not None else _default_labels(run_dirs)
    styles = _run_styles(len(run_dirs))
    runs = [
        _Run(name, _continuous_time(read_metrics(d)), style)
        for name, d, style in zip(names, run_dirs, styles, strict=True)
    ]
    for run_dir, run in zip(run_dirs, runs, strict=True):
        # A metrics.jsonl that another program wrote, or edited by hand: drawn by samples,
        # that run would be missing without a word.
        if x == "samples" and all(_number(r.get("samples_seen")) is None for r in run.records):
            raise ConfigError(
                f"{Path(run_dir) / METRICS_FILE} has no samples_seen in any line, so it cannot be "
                "drawn by samples seen: plot that run with --x step or --x time, or rerun its "
                "training with ddpkit, which logs samples_seen"
            )
    return runs


def _charts(runs: Sequence[_Run], x: str) -> dict[str, Figure]:
    """The charts that have something to show, by file name, with `x` as their x axis."""
    axis = _x_axis(runs, x)
    throughput_axes = [axis] if x == "time" else [axis, _x_axis(runs, "time")]
    charts = {
        "loss.png": _line_chart(runs, axis, "Loss", _LOSS_SERIES, 5.5),
        "eval.png": _eval_chart(runs),
        "throughput.png": _throughput_chart(runs, throughput_axes),
        "lr.png": _line_chart(runs, axis, "Learning rate", _LR_SERIES, 4.5),
        "grad_norm.png": _line_chart(runs, axis, "Gradient norm", _GRAD_NORM_SERIES, 4.5),
        "profile.png": _profile_chart(runs, axis),
    }
    return {name: fig for name, fig in charts.items() if fig is not None}


def _save(charts: dict[str, Figure], out: Path) -> None:
    """Write the charts as PNGs into `out`; on failure remove what this call created."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    new_folders = [p for p in (out, *out.parents) if not p.exists()]  # deepest first
    written: list[Path] = []
    try:
        out.mkdir(parents=True, exist_ok=True)
        for name, fig in charts.items():
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
    resumed run appends to the same metrics.jsonl, and before ddpkit's run log carried
    the time on across a resume, its clock restarted at 0 (such files are still read)."""
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


def _run_styles(count: int) -> list[_RunStyle]:
    """A colour, line style and marker for each of `count` runs (see _LINESTYLES)."""
    return [
        _RunStyle(
            color=f"C{i % 10}",
            linestyle=_LINESTYLES[i % len(_LINESTYLES)],
            marker=_MARKERS[i % len(_MARKERS)],
            mark_offset=i / count,
            mark_scale=1.0 + _MARK_GROWTH * (count - 1 - i) / max(count - 1, 1),
        )
        for i in range(count)
    ]


def _x_axis(runs: Sequence[_Run], x: str) -> _Axis:
    """The axis `x` ("step", "time" or "samples"); time in the unit that suits the runs."""
    if x == "samples":
        return _Axis(x, "samples_seen", "samples seen (all ranks)")
    if x == "step":
        return _Axis(x, "step", "optimizer step")
    times = (_number(r.get("time")) for run in runs for r in run.records)
    unit, scale = _time_unit(max((t for t in times if t is not None), default=0.0))
    return _Axis(x, "time", f"time since start ({unit})", scale)


def _along(records: Iterable[dict[str, Any]], kinds: Sequence[str], axis: _Axis, y: str) -> Series:
    """`_series` with `axis` as x, in the axis' unit."""
    xs, ys = _series(records, kinds, axis.field, y)
    return [v / axis.scale for v in xs] if axis.scale != 1.0 else xs, ys


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


def _line(ax: Axes, series: Series, run: _Run, kind: _Style) -> bool:
    """Plot one series of `run` in its colour, line style and marker, as changed by `kind`
    (e.g. _EPOCH_MARKER: no line); False when it has no point. Markers are sparse along long
    lines, at other points for each run so that identical runs' markers do not coincide."""
    xs, ys = series
    if not xs:
        return False
    style = run.style.line(**kind)
    if len(xs) > _ALL_MARKERS and style["linestyle"] != "none":
        every = len(xs) // _MARKS_PER_LINE
        style["markevery"] = (int(run.style.mark_offset * every), every)
    else:
        style["markersize"] = style.get("markersize", 6.0) * run.style.mark_scale
    if len(xs) > _DENSE_POINTS and style["linestyle"] != "none":
        style["alpha"] = min(style.get("alpha", 1.0), 0.45)
    ax.plot(xs, ys, **style)
    return True


def _run_keys(runs: Sequence[_Run]) -> list[tuple[str, _Style]]:
    """Legend entries of the runs (none for a single run: the title names it)."""
    return [(run.label, run.style.line(**_RUN_KEY)) for run in runs] if len(runs) > 1 else []


def _legends(
    ax: Axes, runs: Sequence[tuple[str, _Style]], kinds: dict[str, _Style], *, title: str = "run"
) -> None:
    """Legends right of the axes, where they never hide data: the runs (label and line style)
    on top and the kinds of series (in grey) at the bottom."""
    from matplotlib.lines import Line2D

    outside = {"borderaxespad": 0.0, "fontsize": 9}
    if runs:
        run_legend = ax.legend(
            [Line2D([], [], **style) for _, style in runs],
            [label for label, _ in runs],
            title=title,
            loc="upper left",
            bbox_to_anchor=(1.02, 1.0),
            handlelength=3.0,  # long enough to show the line style
            **outside,
        )
        if kinds:
            ax.add_artist(run_legend)  # a second ax.legend() would replace it
    if kinds:
        ax.legend(
            [Line2D([], [], color="0.3", **kw) for kw in kinds.values()],
            list(kinds),
            loc="lower left",
            bbox_to_anchor=(1.02, 0.0),
            **outside,
        )


def _style_axes(ax: Axes, title: str, xlabel: str, ylabel: str) -> None:
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, which="major", alpha=0.35)
    ax.grid(True, which="minor", alpha=0.12)


def _format_x(ax: Axes, axis: _Axis) -> None:
    """Steps and samples are counts: whole numbers at round intervals, steps with thousands
    separators, samples (millions soon) short as 250k or 1.5M so that the labels fit."""
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    if axis.name == "time":
        return
    ax.xaxis.set_major_locator(MaxNLocator(integer=True, steps=[1, 2, 2.5, 5, 10]))
    short = axis.name == "samples"
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos: _count(v, short=short)))


def _count(value: float, *, short: bool) -> str:
    """`value` with thousands separators, or `short` as 250k, 1.5M, 2G from 10,000 on."""
    if short:
        for threshold, unit, suffix in ((1e9, 1e9, "G"), (1e6, 1e6, "M"), (1e4, 1e3, "k")):
            if abs(value) >= threshold:
                return f"{value / unit:g}{suffix}"
    return f"{value:,.0f}"


def _log_y_if_wide(ax: Axes, values: Sequence[float]) -> None:
    """A log y axis when the values are positive and span _LOG_SCALE_RATIO or more: else a
    falling loss or a decaying learning rate is a flat line at the bottom."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    if not values or min(values) <= 0 or max(values) / min(values) < _LOG_SCALE_RATIO:
        return
    ax.set_yscale("log")
    if max(values) / min(values) < _FEW_DECADES:
        ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    # else matplotlib's own: ticks at 1, 2 and 5 are crowded over more decades, and from about
    # 6 decades on LogLocator(subs=...) gives no tick at all.
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())


# A series of a chart: its name in the legend of the kinds of series ("": none), the kinds of
# records it is drawn from, their field, its style and its legend key.
_SeriesSpec = tuple[str, tuple[str, ...], str, _Style, _Style]
_LOSS_SERIES: tuple[_SeriesSpec, ...] = (
    ("train loss (step)", ("step",), "loss", _STEP_LINE, _STEP_KEY),
    ("train loss (epoch mean)", ("epoch",), "loss", _EPOCH_MARKER, _EPOCH_KEY),
    ("eval loss", _KINDS, "eval_loss", _EVAL_LINE, _EVAL_KEY),
)
_LR_SERIES: tuple[_SeriesSpec, ...] = (("", _KINDS, "lr", _VALUE_LINE, {}),)
_GRAD_NORM_SERIES: tuple[_SeriesSpec, ...] = (("", ("step",), "grad_norm", _VALUE_LINE, {}),)


def _line_chart(
    runs: Sequence[_Run], axis: _Axis, title: str, series: Sequence[_SeriesSpec], height: float
) -> Figure | None:
    """The `series` of the runs against `axis`, the y axis named after the first one's field;
    None when no run has any."""
    fig = _new_figure(9.5, height)
    ax = fig.add_subplot()
    used: dict[str, _Style] = {}
    values: list[float] = []
    for run in runs:
        for name, kinds, field, kind, key in series:
            points = _along(run.records, kinds, axis, field)
            if _line(ax, points, run, kind):
                values += points[1]
                if name:
                    used[name] = key
    if not values:
        return None
    _log_y_if_wide(ax, values)
    _format_x(ax, axis)
    _style_axes(ax, _title(title, runs), axis.label, series[0][2])
    _legends(ax, _run_keys(runs), used)
    return fig


def _eval_chart(runs: Sequence[_Run]) -> Figure | None:
    from matplotlib.ticker import MaxNLocator, PercentFormatter

    metrics = _eval_metrics(runs)
    if not metrics:
        return None
    fig = _new_figure(9.5, 1.0 + 3.3 * len(metrics))
    axes = fig.subplots(len(metrics), 1, sharex=True, squeeze=False)[:, 0]
    for i, (ax, metric) in enumerate(zip(axes, metrics, strict=True)):
        values: list[float] = []
        shown: list[tuple[str, _Style]] = []
        for run in runs:
            series = _series(run.records, ("epoch",), "epoch", metric)
            if _line(ax, series, run, _VALUE_LINE):
                values += series[1]
                last = f"{run.label}: {_format(metric, series[1][-1])}"
                shown.append((last, run.style.line(**_RUN_KEY)))
        if "acc" in metric.lower() and values and all(0 <= v <= 1 for v in values):
            ax.yaxis.set_major_formatter(PercentFormatter(xmax=1))
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        _style_axes(ax, metric, "epoch (completed)" if i == len(metrics) - 1 else "", metric)
        _legends(ax, shown, {}, title="last value")
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


_THROUGHPUT_SERIES: tuple[_SeriesSpec, ...] = (
    ("samples/s (step)", ("step",), "samples_per_s", _STEP_LINE, _STEP_KEY),
    ("samples/s (epoch mean)", ("epoch",), "samples_per_s", _EPOCH_MARKER, _EPOCH_KEY),
)
_PANEL_TITLES = dict(step="by optimizer step", time="by elapsed time", samples="by samples seen")


def _throughput_chart(runs: Sequence[_Run], axes: Sequence[_Axis]) -> Figure | None:
    """samples/s of the runs, one panel per x axis in `axes`."""
    from matplotlib.ticker import FuncFormatter

    fig = _new_figure(1.0 + 6.0 * len(axes), 5.0)
    panels = fig.subplots(1, len(axes), sharey=True, squeeze=False)[0]
    used: dict[str, _Style] = {}
    for ax, axis in zip(panels, axes, strict=True):
        for run in runs:
            for name, kinds, field, kind, key in _THROUGHPUT_SERIES:
                series = _along(run.records, kinds, axis, field)
                if _line(ax, series, run, kind):
                    used[name] = key
    if not used:
        return None
    panels[0].set_ylim(bottom=0)
    panels[0].yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:,.0f}"))
    for i, (ax, axis) in enumerate(zip(panels, axes, strict=True)):
        _format_x(ax, axis)
        _style_axes(ax, _PANEL_TITLES[axis.name], axis.label, "" if i else "samples / s")
        ax.tick_params(labelleft=True)
        if not ax.lines:  # say so in grey in the middle of the empty panel
            text = f"no '{axis.field}' field in the runs' {METRICS_FILE}"
            ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="0.4")
    _legends(panels[-1], _run_keys(runs), used)
    fig.suptitle(_title("Throughput", runs))
    return fig


# --profile's parts, in PARTS' order, each in a colour of its own.
_PART_COLORS = {"data": "C1", "compute": "C0", "comm": "C3", "optimizer": "C2", "ddpkit": "C7"}


def _profile_chart(runs: Sequence[_Run], axis: _Axis) -> Figure | None:
    """--profile's breakdown, a row per run: each rank's milliseconds per step as a
    stacked bar (the whole run), and over `axis` the mean of the ranks' as stacked areas;
    None when no run was profiled."""
    profiled = [(run, _profiles(run)) for run in runs]
    profiled = [(run, ranks) for run, ranks in profiled if ranks]
    if not profiled:
        return None
    fig = _new_figure(12.0, 1.5 + 3.5 * len(profiled))
    rows = fig.subplots(len(profiled), 2, squeeze=False, width_ratios=(1, 2))
    for (bars, areas), (run, ranks) in zip(rows, profiled, strict=True):
        names = [f"rank {rank}" for rank in ranks]
        left = [0.0] * len(ranks)
        for part in PARTS:
            widths = [_mean_ms(records, part) for records in ranks.values()]
            bars.barh(names, widths, left=left, color=_PART_COLORS[part], label=part)
            left = [a + b for a, b in zip(left, widths, strict=True)]
        bars.invert_yaxis()  # rank 0 on top
        _style_axes(bars, _title("Step time by rank", [run]), "ms per step", "")
        xs, stacks = _over(ranks, axis)
        areas.stackplot(xs, *stacks, colors=[_PART_COLORS[p] for p in PARTS], labels=PARTS)
        _style_axes(areas, "Mean of the ranks over the run", axis.label, "ms per step")
        _format_x(areas, axis)
    rows[0][1].legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=9)
    return fig


def _profiles(run: _Run) -> dict[int, list[dict[str, Any]]]:
    """The run's profile records by rank, in rank order."""
    ranks: dict[int, list[dict[str, Any]]] = {}
    for record in run.records:
        rank = _number(record.get("rank"))
        if record.get("kind") == "profile" and rank is not None and _number(record.get("steps")):
            ranks.setdefault(int(rank), []).append(record)
    return dict(sorted(ranks.items()))


def _mean_ms(records: list[dict[str, Any]], part: str) -> float:
    """Milliseconds per step of `part` over the records (each weighs its steps)."""
    steps = sum(_number(r.get("steps")) or 0.0 for r in records)
    total = sum(
        (_number(r.get(f"{part}_ms")) or 0.0) * (_number(r.get("steps")) or 0.0) for r in records
    )
    return total / steps if steps else 0.0


def _over(
    ranks: dict[int, list[dict[str, Any]]], axis: _Axis
) -> tuple[list[float], list[list[float]]]:
    """The mean over ranks of each part's ms per step, at each x of the records."""
    at: dict[float, list[dict[str, Any]]] = {}
    for records in ranks.values():
        for record in records:
            x = _number(record.get(axis.field))
            if x is not None:
                at.setdefault(x / axis.scale, []).append(record)
    xs = sorted(at)
    return xs, [[_mean_ms(at[x], part) for x in xs] for part in PARTS]

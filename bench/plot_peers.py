"""The chart of `bench/peers.py`'s results, for the README.

    .venv/bin/python bench/plot_peers.py bench/results/peers.json docs/bench-peers.png

One panel per workload: median training samples/s of each contestant (bars) with one
and with two processes, each bar labelled with its ratio to the hand-written loop; a
last panel with the median time from the command's start to the first optimizer step.
Draws on matplotlib's Agg canvas (no pyplot, no display needed).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from matplotlib.ticker import FuncFormatter
from peers import BF16, CONTESTANTS, FLOOR, SYNCBN, VARIANTS

if TYPE_CHECKING:
    from matplotlib.axes import Axes

ORDER = (*CONTESTANTS, *VARIANTS)
COLORS = {
    "hand": "#9e9e9e",
    "ddpkit": "#1f77b4",
    "accelerate": "#ff7f0e",
    "fabric": "#9467bd",
    SYNCBN: "#aec7e8",
    BF16: "#17becf",
    FLOOR: "#d9d9d9",  # start-up only: one process alone, no launcher
}
WIDTH = 0.8  # of one group of bars


def _bars(ax: Axes, groups: list[str], values: dict[str, list[float | None]]) -> None:
    """Grouped bars: one group per x label, one bar per contestant that has a value."""
    names = [n for n in (*ORDER, FLOOR) if n in values]
    step = WIDTH / len(names)
    for i, name in enumerate(names):
        label: str | None = name  # on the first bar drawn only: one legend entry
        for g, value in enumerate(values[name]):
            if value is None:
                continue
            x = g - WIDTH / 2 + step * (i + 0.5)
            ax.bar(x, value, step, color=COLORS[name], label=label)
            label = None
    ax.set_xticks(range(len(groups)), groups)


def _label(ax: Axes, x: float, y: float, text: str) -> None:
    ax.annotate(text, (x, y), ha="center", va="bottom", fontsize=6, rotation=90)


def _rate_panel(ax: Axes, workload: str, rows: list[dict[str, Any]]) -> None:
    mine = sorted((r for r in rows if r["workload"] == workload), key=lambda r: r["nprocs"])
    names = [n for n in ORDER if any(n in r["contestants"] for r in mine)]
    values = {n: [r["contestants"].get(n, {}).get("median") for r in mine] for n in names}
    _bars(ax, [f"{r['nprocs']} proc" for r in mine], values)
    step = WIDTH / len(names)
    for i, n in enumerate(names):
        for g, r in enumerate(mine):
            c = r["contestants"].get(n)
            if c and c["median"] is not None and c.get("ratio_to_hand") is not None:
                _label(
                    ax, g - WIDTH / 2 + step * (i + 0.5), c["median"], f"{c['ratio_to_hand']:.2f}x"
                )
    ax.set_title(workload)
    ax.set_ylabel("samples/s (median)")
    ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:,.0f}"))
    ax.margins(y=0.18)


def _start_panel(ax: Axes, rows: list[dict[str, Any]]) -> bool:
    """Time to first step per process count (cells with start-up launches only)."""
    mine = [r for r in rows if any(c["first_step_median"] for c in r["contestants"].values())]
    if not mine:
        return False
    names = [n for n in (*ORDER, FLOOR) if any(n in r["contestants"] for r in mine)]
    values = {
        n: [r["contestants"].get(n, {}).get("first_step_median") for r in mine] for n in names
    }
    _bars(ax, [f"{r['workload']}, {r['nprocs']} proc" for r in mine], values)
    ax.set_title("start-up")
    ax.set_ylabel("s to first optimizer step (median)")
    return True


def plot(doc: dict[str, Any], out: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = doc["rows"]
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    has_start = any(c["first_step_median"] for r in rows for c in r["contestants"].values())
    panels = len(workloads) + has_start
    fig = Figure(figsize=(3.2 * panels, 3.6), layout="constrained")
    FigureCanvasAgg(fig)  # no pyplot: no GUI, no global backend
    axes = fig.subplots(1, panels, squeeze=False)[0]
    for ax, workload in zip(axes, workloads, strict=False):
        _rate_panel(ax, workload, rows)
    if has_start:
        _start_panel(axes[-1], rows)
    legend: dict[str, Any] = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            legend.setdefault(label, handle)
    fig.legend(list(legend.values()), list(legend), loc="outside lower center", ncols=len(legend))
    meta = doc["meta"]
    fig.suptitle(
        f"ddpkit vs peers, {meta['date'][:10]}: torch {meta['torch']}, gloo, "
        f"{meta['cpu_count']} CPU(s); bars labelled with the ratio to the hand-written loop",
        fontsize=9,
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=130)


def main(argv: Sequence[str]) -> int:
    if len(argv) != 2:
        print("usage: plot_peers.py RESULTS.json OUT.png", file=sys.stderr)
        return 2
    plot(json.loads(Path(argv[0]).read_text()), Path(argv[1]))
    print(f"wrote {argv[1]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

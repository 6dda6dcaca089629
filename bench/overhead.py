"""What does ddpkit's Trainer cost against the DDP tutorial's hand-written loop?

Two contestants train the same job with the same data order, batch size and thread
count, and end with bit-identical models (checked: `same_model` in the JSON):

- `hand`: the PyTorch DDP tutorial's `multigpu.py` (`tutorial.py` here: its `Trainer`,
  `DistributedSampler` + `set_epoch`, `DDP(model)`), ported to gloo on CPU.
- `ddpkit`: `ddpkit.Trainer(...).fit()`.

Both are `peers_jobs.py`'s contestants of the same names (`peers.py` adds Accelerate
and Lightning Fabric).

Each launch starts the ranks the tutorial's way (`mp.spawn`, `init_process_group`) and
then, in the same processes, trains with both contestants in turn: one unmeasured
warm-up epoch each, then `--rounds` rounds of hand, ddpkit / ddpkit, hand / ... each on
a fresh model (`peers.py`'s throughput launch, with two contestants). Sharing the
processes matters on a small machine: where the OS happens to place a launch's threads
moves a whole launch by up to 25 % (measured here with 2 ranks on 2 cores), and that
now hits both contestants alike instead of landing on one.
Launch mechanics (spawn, rendezvous, teardown) are not timed; `bench/peers.py` times
start-up separately.

Both measure throughput the way `Trainer` does: global samples trained (per-rank
`len(sampler)` x world size x epochs) over the summed time of the epochs' batch loops
on rank 0. The wall time of the whole `fit()` / `train()` call (which also counts
ddpkit's per-epoch loss all-reduce) gives `wall_ratio`. Each rank gets
`cores // nprocs` threads, as `ddpkit.launch` gives them.

With one process the two do different work on purpose: the tutorial wraps the model in
DDP anyway (a gradient all-reduce over one rank every step), ddpkit does not.

Timings on a machine that other jobs share are noise: every launch records the share of
the CPUs other processes used meanwhile (`foreign_load`), and `--settle S` waits for a
quiet machine before each launch and runs a disturbed launch again.

    .venv/bin/python bench/overhead.py              # ~3 min on 2 idle cores
    .venv/bin/python bench/overhead.py --quick      # smoke run, under a minute
    .venv/bin/python bench/overhead.py --markdown   # the table for the README
    .venv/bin/python bench/overhead.py --device cuda --nprocs 1   # on one GPU (nccl)

Results (every raw measurement, medians, ratios) go to `--out`
(default bench/results/overhead.json).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch
from machine import BUSY_LIMIT, add_settle_args, measured, warn_if_contended
from peers import choose, throughput_launch
from tables import format_table
from tutorial import WORKLOADS, Workload, threads_for

import ddpkit

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "overhead.json"
TARGET_RATIO = 0.98
CONTESTANTS = ("hand", "ddpkit")
OVERHEAD_WORKLOADS = ("linear", "mlp")
QUICK_EPOCHS = {"linear": 10, "mlp": 1, "cnn": 1}


def run_all(
    workloads: Sequence[Workload],
    nprocs_list: Sequence[int],
    repeats: int,
    rounds: int,
    say: Callable[[str], None],
    device: str = "cpu",
    settle_s: float = 0.0,
    retries: int = 2,
) -> list[dict[str, Any]]:
    """Every (workload, nprocs) cell, launched `repeats` times; repeats are spread over
    the whole run, so slow drift hits every cell alike.

    With `settle_s`, each launch first waits for a quiet machine, and a launch during
    which other processes took the CPUs is run again (at most `retries` times); the runs
    it replaces stay in the output with `kept: false`.
    """
    runs: list[dict[str, Any]] = []
    backend = "nccl" if device == "cuda" else "gloo"
    for repeat in range(repeats):
        for workload in workloads:
            for nprocs in nprocs_list:
                replaced: list[tuple[list[dict[str, Any]], float | None, int]] = []
                launch_runs, foreign, attempt = measured(
                    functools.partial(
                        throughput_launch,
                        workload,
                        nprocs,
                        list(CONTESTANTS),
                        rounds,
                        threads_for(nprocs),  # what ddpkit.launch gives each rank
                        backend,
                    ),
                    settle_s,
                    retries,
                    say,
                    replaced,
                )
                cell = {"workload": workload.name, "nprocs": nprocs, "repeat": repeat}
                for records, load, tried in [*replaced, (launch_runs, foreign, attempt)]:
                    kept = records is launch_runs
                    runs += [
                        {**cell, **r, "foreign_load": load, "attempt": tried, "kept": kept}
                        for r in records
                    ]
                say(_launch_line(workload.name, nprocs, repeat, launch_runs, foreign))
    return runs


def _launch_line(
    name: str, nprocs: int, repeat: int, runs: list[dict[str, Any]], foreign: float | None
) -> str:
    rates = "  ".join(f"{r['contestant']} {r['samples_per_s']:,.0f}" for r in runs)
    busy = "" if foreign is None else f", other load {foreign:.0%}"
    note = f" [{runs[0]['note']}]" if runs and runs[0]["note"] else ""
    return f"  [{repeat + 1}] {name:<5} nproc {nprocs}: {rates} samples/s{busy}{note}"


def _cell(runs: list[dict[str, Any]], name: str, nprocs: int, contestant: str) -> list[Any]:
    """The kept runs of one contestant in one cell, in run order."""
    return [
        r
        for r in runs
        if r["kept"] and (r["workload"], r["nprocs"], r["contestant"]) == (name, nprocs, contestant)
    ]


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per cell: every rate, the medians, the ratio of medians (the headline), the
    median of the paired ratios (each ddpkit run over the hand-written run of the same
    round and launch), the same ratio for the whole-call wall time, and whether the
    models agree."""
    rows: list[dict[str, Any]] = []
    for name, nprocs in dict.fromkeys((r["workload"], r["nprocs"]) for r in runs):
        hand, ours = _cell(runs, name, nprocs, "hand"), _cell(runs, name, nprocs, "ddpkit")
        hand_rates = [float(r["samples_per_s"]) for r in hand]
        ours_rates = [float(r["samples_per_s"]) for r in ours]
        hand_med, ours_med = statistics.median(hand_rates), statistics.median(ours_rates)
        # Both lists are in run order and every round has one run of each.
        pairs = [o / h for o, h in zip(ours_rates, hand_rates, strict=True)]
        wall = [
            statistics.median(float(r["wall_samples_per_s"]) for r in rs) for rs in (hand, ours)
        ]
        rows.append(
            {
                "workload": name,
                "nprocs": nprocs,
                "hand_samples_per_s": hand_rates,
                "ddpkit_samples_per_s": ours_rates,
                "hand_median": hand_med,
                "ddpkit_median": ours_med,
                "ratio": ours_med / hand_med,
                "paired_ratios": pairs,
                "paired_ratio_median": statistics.median(pairs),
                "wall_ratio": wall[1] / wall[0],
                "same_model": len({r["model_digest"] for r in hand + ours}) == 1,
                "contended_runs": sum(
                    (r["foreign_load"] or 0.0) >= BUSY_LIMIT for r in hand + ours
                ),
                "meets_target": ours_med / hand_med >= TARGET_RATIO,
            }
        )
    return rows


def header(meta: dict[str, Any]) -> str:
    return (
        f"ddpkit overhead benchmark, {meta['date']}: torch {meta['torch']}, "
        f"python {meta['python']}, {meta['cpu_count']} CPU(s), "
        f"load average at start {meta['loadavg_start']:.2f}; "
        f"{meta['repeats']} launch(es) x {meta['rounds']} round(s) per cell, on {meta['device']}"
    )


def table(rows: list[dict[str, Any]], markdown: bool) -> str:
    head = [
        "workload",
        "nproc",
        "hand-written samples/s",
        "ddpkit samples/s",
        "ratio ddpkit/hand",
        "median of paired ratios",
        "paired ratios (min-max)",
        "wall ratio",
    ]
    body = [
        [
            r["workload"],
            str(r["nprocs"]),
            f"{r['hand_median']:,.0f}",
            f"{r['ddpkit_median']:,.0f}",
            f"{r['ratio']:.3f}",
            f"{r['paired_ratio_median']:.3f}",
            f"{min(r['paired_ratios']):.2f}-{max(r['paired_ratios']):.2f}",
            f"{r['wall_ratio']:.3f}",
        ]
        for r in rows
    ]
    return format_table(head, body, markdown)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="bench/overhead.py",
        description="ddpkit's Trainer vs. the DDP tutorial's hand-written loop (gloo, CPU).",
    )
    p.add_argument("--repeats", type=int, default=5, help="launches per cell (default 5)")
    p.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="runs of each contestant per launch, taking turns (default 2)",
    )
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cpu (gloo) or cuda (nccl, one GPU per rank); default cpu",
    )
    p.add_argument("--nprocs", default="1,2", help="process counts, comma-separated (default 1,2)")
    p.add_argument(
        "--workloads",
        default=",".join(OVERHEAD_WORKLOADS),
        help=f"comma-separated, of {', '.join(WORKLOADS)} (default %(default)s)",
    )
    p.add_argument(
        "--quick", action="store_true", help="a smoke run: 1 launch of short runs (~30 s)"
    )
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON file (default %(default)s)")
    p.add_argument("--markdown", action="store_true", help="print the table as markdown")
    add_settle_args(p)
    args = p.parse_args(argv)
    try:
        args.nprocs = [int(n) for n in args.nprocs.split(",")]
    except ValueError:
        p.error(f"--nprocs takes integers like 1,2 (got {args.nprocs!r})")
    args.workloads = choose(p, "--workloads", args.workloads, WORKLOADS)
    if min(args.repeats, args.rounds, *args.nprocs) < 1 or min(args.retries, args.settle) < 0:
        p.error("--repeats, --rounds and --nprocs must be >= 1, --retries and --settle >= 0")
    if args.device == "cuda":
        gpus = torch.cuda.device_count()
        if max(args.nprocs) > gpus:
            p.error(f"--device cuda needs a GPU per rank: {gpus} visible, --nprocs {args.nprocs}")
    if args.quick:
        args.repeats = 1
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    workloads = [WORKLOADS[name] for name in args.workloads]
    if args.quick:
        workloads = [replace(w, epochs=QUICK_EPOCHS[w.name]) for w in workloads]
    meta: dict[str, Any] = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "ddpkit": ddpkit.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": threads_for(1),
        "loadavg_start": os.getloadavg()[0],
        "repeats": args.repeats,
        "rounds": args.rounds,
        "device": args.device,
        "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else None,
        "quick": args.quick,
        "settle_s": args.settle,
        "retries": args.retries,
        "busy_limit": BUSY_LIMIT,
        "nprocs": args.nprocs,
        "workloads": {w.name: asdict(w) for w in workloads},
        "target_ratio": TARGET_RATIO,
        "measure": "global samples / summed batch-loop time of all epochs on rank 0",
    }

    def say(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    say(header(meta))
    start = time.perf_counter()
    runs = run_all(
        workloads,
        args.nprocs,
        args.repeats,
        args.rounds,
        say,
        args.device,
        args.settle,
        args.retries,
    )
    rows = summarize(runs)
    meta["loadavg_end"] = os.getloadavg()[0]
    meta["elapsed_s"] = round(time.perf_counter() - start, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "rows": rows, "runs": runs}, indent=2) + "\n")
    print(header(meta))
    print(table(rows, args.markdown))
    warn_if_contended([r for r in runs if r["kept"]], say)
    say(f"wrote {args.out} ({meta['elapsed_s']}s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

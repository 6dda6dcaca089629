"""ddpkit against the tutorial's hand-written loop, HuggingFace Accelerate and Lightning
Fabric, on the same work.

Three workloads (`tutorial.py`): `linear`, the tutorial's regression (Linear 20->1);
`mlp`, compute-bound (512-1024-1024-1); `cnn`, two conv+BatchNorm blocks on 3x32x32
synthetic images. Four contestants (`peers_jobs.py`): `hand`, `ddpkit`, `accelerate`,
`fabric`, each written the way its docs recommend, plus `ddpkit+syncbn` on the
two-process cnn row (ddpkit's default, synchronised BatchNorm; the others cannot
synchronise BatchNorm on CPU, so it is shown but not part of the targets).

Two measurements, for 1 and 2 processes:

- Throughput (samples/s): one launch of N ranks (`mp.spawn`, gloo) per cell, and in the
  same processes each contestant trains in turn on a fresh model: one unmeasured warm-up
  epoch each, then `--rounds` rounds in rotating order. Timed on rank 0 over the epochs'
  batch loops only. The environment of each rank is torchrun's (RANK, WORLD_SIZE,
  LOCAL_RANK, ..., TORCHELASTIC_RUN_ID), so Accelerate and Fabric attach to the process
  group that is already there. Sharing the processes matters on a small machine: where
  the OS places a launch's threads moves the whole launch by up to 25 % (2 ranks on
  2 cores), and that now hits every contestant alike.
- Start-up and memory: separate launches, each contestant started the way its docs
  say (`python` + `mp.spawn`; `ddpkit.launch`; `accelerate launch --multi_gpu
  --num_processes N` (`--cpu --num_processes 1` for one); `Fabric(...).launch()`).
  Time to first step runs from just before the command starts to rank 0's first
  `optimizer.step()`; peak memory is each rank's `ru_maxrss` after one epoch. By
  default on the cnn job only (`--start-workloads`): the others build another model
  (a few MB) and start the same way.

A third, with `--short` (and only then): short runs, the whole training call.

- Short runs: what a run pays once or once per epoch (set-up of the first step, a
  checkpoint's wait for the disk at the end of `fit`, run-log files) is lost in the
  throughput above, which times the batch loops of long runs; a run of a few seconds
  feels it. `hand` and `ddpkit` only, each in a launch of its own (started as for
  start-up, alternating who goes first), timed on rank 0 from the start of the
  training call (`train()`, `fit()`) to its return, checkpoints included; process
  start-up is not counted, and the set-up before the call (data, model, optimizer,
  wrapping) is reported beside it. Two jobs (`SHORT_RUNS`): `mlp` on one process, 2
  epochs of 4,096 samples (under a second on 2 cores); the tutorial's `linear` on 2
  ranks, 10 epochs of 20,480 samples (about 6 s), with a checkpoint after each epoch
  (the tutorial's: rank 0 `torch.save`s the model's state dict; ddpkit's:
  `checkpoint_dir`). The ratio is hand's time over ddpkit's (>= 1: ddpkit is at least
  as fast). Results go to bench/results/peers_short.json.

Every run checks that the framework saw N ranks, wrapped the model in DDP when N > 1,
and that all ranks ended with the same parameters (gradient sync happened). Where the
data order is the same (ddpkit; with two ranks also fabric, whose sampler is the
tutorial's), the model must be the hand-written loop's bit for bit
(`same_model_as_hand`). In throughput launches every rank of every cell gets
`cores // max(--nprocs)` threads (1 on 2 cores), so that one process and N processes
compare like with like (scaling efficiency); start-up launches give each rank
`cores // nprocs`, as `ddpkit.launch` does.

    .venv/bin/pip install -c constraints.txt -e ".[bench]"     # Accelerate and Fabric
    .venv/bin/python bench/peers.py                  # about 8 min on 2 idle cores
    .venv/bin/python bench/peers.py --quick          # smoke run, about 80 s
    .venv/bin/python bench/peers.py --settle 30 --markdown   # the README's tables
    .venv/bin/python bench/peers.py --contestants hand,ddpkit   # without the extra
    .venv/bin/python bench/peers.py --short --markdown   # short runs only, about 3 min
    .venv/bin/python bench/plot_peers.py bench/results/peers.json docs/bench-peers.png

Without Accelerate or Lightning Fabric installed it stops with a one-line error that
names `pip install -e ".[bench]"` (or `--contestants hand,ddpkit`).
Results (every raw run, medians, ratios, targets) go to `--out`
(default bench/results/peers.json); `bench/plot_peers.py` draws them.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from machine import BUSY_LIMIT, add_settle_args, measured, warn_if_contended
from peers_jobs import TRAIN, quiet_peers
from tutorial import (
    LOOPBACK,
    WORKLOADS,
    Workload,
    ddp_setup,
    loopback_store,
    threads_for,
)

import ddpkit
from ddpkit.processes.workers import exit_now

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "results" / "peers.json"
SHORT_OUT = HERE / "results" / "peers_short.json"
CONTESTANTS = ("hand", "ddpkit", "accelerate", "fabric")
PEERS = {"accelerate": "accelerate", "fabric": "lightning_fabric"}  # contestant -> module
SYNCBN = "ddpkit+syncbn"  # only ddpkit can sync BatchNorm on CPU: its cost against plain BN
BF16 = "ddpkit+bf16"  # gradients all-reduced in bfloat16 (grad_compression="bf16")
VARIANTS = (SYNCBN, BF16)  # ddpkit's options, compared with ddpkit itself
# Start-up launches only: one process alone, no launcher, no process group. No launcher's
# rank reaches its first step sooner, so floor/hand is the lowest first-step ratio any
# launcher could show.
FLOOR = "floor"
TARGET_HAND = 1.0  # ddpkit samples/s >= the hand-written loop's
TARGET_PEER = 1.0  # ... and >= each peer's
TARGET_FIRST_STEP = 0.5  # time to first step <= 0.5 x the hand-written loop's
TARGET_SYNCBN = 1.10  # plain-BN samples/s over synchronised-BN samples/s <= 1.10
TARGET_SCALING = 0.75  # MLP samples/s at 2 ranks >= 0.75 x 2 x one process's
QUICK_EPOCHS = {"linear": 8, "mlp": 1, "cnn": 1}
Say = Callable[[str], None]


@dataclass(frozen=True)
class ShortRun:
    """A job of a few seconds of training, as an outside harness timed it (issue 47)."""

    name: str
    workload: Workload
    nprocs: int
    checkpoint: bool  # after each epoch


SHORT_RUNS = (
    ShortRun("mlp/1", replace(WORKLOADS["mlp"], epochs=2), 1, checkpoint=False),
    ShortRun(
        "linear/2 + checkpoints",
        replace(WORKLOADS["linear"], samples=20_480, epochs=10),
        2,
        checkpoint=True,
    ),
)
SHORT_CONTESTANTS = ("hand", "ddpkit")


# -- throughput: one launch, every contestant in turn -----------------------------------
def _as_torchrun(rank: int, world_size: int, port: int) -> None:
    """torchrun's environment, so Accelerate and Fabric see this launch as theirs (one
    process: none, as under a plain `python`)."""
    if world_size == 1:
        return
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        GROUP_RANK="0",
        MASTER_ADDR=LOOPBACK,
        MASTER_PORT=str(port),
        TORCHELASTIC_RUN_ID="ddpkit-bench",  # Fabric: started externally, spawn nothing
    )


def _order(contestants: Sequence[str], round: int) -> list[str]:
    """Round r starts with contestant r (mod k): each takes each place equally often."""
    k = round % len(contestants)
    return [*contestants[k:], *contestants[:k]]


def _ranks_agree(model_digest: str, world_size: int) -> bool:
    """Did every rank end with the same parameters? Without gradient sync they differ."""
    digests: list[Any] = [None] * world_size
    dist.all_gather_object(digests, model_digest)
    return len(set(digests)) == 1


def worker(
    rank: int,
    world_size: int,
    workload: Workload,
    contestants: list[str],
    rounds: int,
    backend: str,
    port: int,
    out: str,
    threads: int,
) -> None:
    """One rank of a throughput launch: the tutorial's set-up, then the contestants."""
    _as_torchrun(rank, world_size, port)
    quiet_peers()
    torch.set_num_threads(threads)
    ddp_setup(rank, world_size, port, backend)
    try:
        for name in contestants:  # warm-up: first-use costs land on no measurement
            TRAIN[name](replace(workload, epochs=1), world_size, -1, None)
        runs = []
        for r in range(rounds):
            for name in _order(contestants, r):
                torch.set_num_threads(threads)
                run = TRAIN[name](workload, world_size, r, None)
                agree = _ranks_agree(run.model_digest, world_size)
                runs.append({**run.record(), "ranks_agree": agree})
        if rank == 0:
            Path(out).write_text(json.dumps(runs))
    finally:
        dist.destroy_process_group()
    # Skip the interpreter's shutdown: gloo's threads can abort it (SIGABRT) after a
    # clean run, as ddpkit's own workers do.
    exit_now(0)


def throughput_launch(
    workload: Workload,
    nprocs: int,
    contestants: list[str],
    rounds: int,
    threads: int,
    backend: str = "gloo",
) -> list[dict[str, Any]]:
    """One launch of `nprocs` ranks of `threads` threads each (nccl: a GPU each); rank
    0's runs, in run order."""
    store = loopback_store(nprocs)
    try:
        with tempfile.TemporaryDirectory(prefix="ddpkit-peers-") as tmp:
            out = Path(tmp, "rank0.json")
            args = (nprocs, workload, contestants, rounds, backend, store.port, str(out), threads)
            note = ""
            try:
                mp.spawn(worker, args=args, nprocs=nprocs)  # type: ignore[attr-defined,no-untyped-call]
            except Exception as exc:
                if not out.exists():
                    raise
                # Measured already; a rank died on the way out (gloo can abort at exit).
                note = f"crashed after training: {type(exc).__name__}: {exc}"
            runs: list[dict[str, Any]] = json.loads(out.read_text())
            return [{**r, "note": note} for r in runs]
    finally:
        del store


# -- start-up and memory: one launch per contestant, started its own way ----------------
def start_command(
    contestant: str, workload: Workload, nprocs: int, out: Path, checkpoint: bool = False
) -> list[str]:
    """The command a user of `contestant` types to start this job (`checkpoint`: after
    each epoch, into a folder of `out`)."""
    script = [str(HERE / "peers_jobs.py"), contestant, workload.name, str(nprocs), str(out)]
    script += [str(workload.epochs), "--samples", str(workload.samples)]
    script += ["--checkpoint"] if checkpoint else []
    if contestant != "accelerate":
        return [sys.executable, *script]
    accelerate = Path(sys.executable).with_name("accelerate")
    launcher = [str(accelerate)] if accelerate.exists() else [sys.executable, "-m", "accelerate"]
    # `--cpu --num_processes 2` would quietly run ONE process (the simple launcher);
    # several CPU processes need the torchrun launcher of `--multi_gpu`, and the script
    # passes Accelerator(cpu=True).
    how = ["--multi_gpu"] if nprocs > 1 else ["--cpu"]
    return [
        *launcher,
        "launch",
        *how,
        "--num_processes",
        str(nprocs),
        "--num_machines",
        "1",
        "--num_cpu_threads_per_process",
        str(threads_for(nprocs)),
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "--main_process_ip",
        LOOPBACK,
        "--main_process_port",
        "0",  # a free port (the default, 29500, collides with other jobs)
        *script,
    ]


def start_launch(contestant: str, workload: Workload, nprocs: int) -> dict[str, Any]:
    """Run one job from a fresh command; time to rank 0's first step, each rank's peak
    memory, and the world size each rank saw."""
    with tempfile.TemporaryDirectory(prefix="ddpkit-peers-start-") as tmp:
        cmd = start_command(contestant, workload, nprocs, Path(tmp))
        t0 = time.time()  # wall clock: the ranks stamp their first step with time.time()
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=HERE.parent)
        exit_s = time.time() - t0
        ranks = [json.loads(p.read_text()) for p in sorted(Path(tmp).glob("rank*.json"))]
    # A non-zero exit after every rank reported (an abort at interpreter exit) is kept,
    # with its return code; a rank that never reported is an error.
    expected = 1 if contestant == FLOOR else nprocs
    if len(ranks) != expected:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
        raise RuntimeError(
            f"{contestant} start-up launch ({' '.join(cmd)}) exited {proc.returncode} with "
            f"{len(ranks)} of {expected} rank reports:\n{tail}"
        )
    ranks.sort(key=lambda r: r["rank"])
    first = ranks[0]["first_step_at"]
    return {
        "contestant": contestant,
        "first_step_s": None if first is None else first - t0,
        "exit_s": exit_s,
        "peak_rss_mb": [r["max_rss_kb"] / 1024 for r in ranks],
        "world_sizes": [r["world_size"] for r in ranks],
        "returncode": proc.returncode,
    }


def _one_start(contestant: str, workload: Workload, nprocs: int) -> list[dict[str, Any]]:
    return [start_launch(contestant, workload, nprocs)]


# -- short runs: one launch per run, the whole training call ----------------------------
def short_launch(contestant: str, run: ShortRun) -> list[dict[str, Any]]:
    """One short run from a fresh command: rank 0's set-up and training-call times."""
    with tempfile.TemporaryDirectory(prefix="ddpkit-peers-short-") as tmp:
        cmd = start_command(contestant, run.workload, run.nprocs, Path(tmp), run.checkpoint)
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=HERE.parent)
        exit_s = time.perf_counter() - t0
        ranks = [json.loads(p.read_text()) for p in sorted(Path(tmp).glob("rank*.json"))]
    if len(ranks) != run.nprocs:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
        raise RuntimeError(
            f"{contestant} short run ({' '.join(cmd)}) exited {proc.returncode} with "
            f"{len(ranks)} of {run.nprocs} rank reports:\n{tail}"
        )
    ranks.sort(key=lambda r: r["rank"])
    # Rank 0's times: it writes the checkpoints, so their cost lands there.
    return [
        {
            "contestant": contestant,
            "setup_s": ranks[0]["setup_s"],
            "fit_s": ranks[0]["fit_s"],
            "train_s": ranks[0]["train_s"],
            "fit_s_per_rank": [r["fit_s"] for r in ranks],
            "exit_s": exit_s,  # the whole command, process start-up included
            "world_sizes": [r["world_size"] for r in ranks],
            "digests": [r["model_digest"] for r in ranks],
            "returncode": proc.returncode,
        }
    ]


def run_short(
    repeats: int, say: Say, settle_s: float = 0.0, retries: int = 2
) -> list[dict[str, Any]]:
    """Every short run `repeats` times per contestant, in alternating order."""
    records: list[dict[str, Any]] = []
    for repeat in range(repeats):
        for job in SHORT_RUNS:
            done = []
            for name in _order(SHORT_CONTESTANTS, repeat):
                launch = functools.partial(short_launch, name, job)
                (record,), foreign, attempt = measured(launch, settle_s, retries, say)
                cell = {"run": job.name, "repeat": repeat, "foreign_load": foreign}
                done.append({**cell, **record, "attempt": attempt})
            records += done
            times = "  ".join(f"{r['contestant']} {r['fit_s']:.3f}s" for r in done)
            say(f"  [short {repeat + 1}] {job.name}: training call {times}")
    return records


def summarize_short(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per short run: each contestant's median set-up and training-call time; hand's
    over ddpkit's (>= 1: ddpkit is at least as fast), of the medians and per repeat."""
    rows = []
    for name in dict.fromkeys(r["run"] for r in records):
        mine = [r for r in records if r["run"] == name]
        per: dict[str, dict[str, Any]] = {}
        for c in SHORT_CONTESTANTS:
            rs = [r for r in mine if r["contestant"] == c]
            per[c] = {
                "fit_s": [r["fit_s"] for r in rs],
                "fit_median": _median(r["fit_s"] for r in rs),
                "setup_median": _median(r["setup_s"] for r in rs),
                "total_median": _median(r["setup_s"] + r["fit_s"] for r in rs),
                "digests": sorted({d for r in rs for d in r["digests"]}),
                "world_sizes": sorted({w for r in rs for w in r["world_sizes"]}),
            }
        hand, ours = per["hand"], per["ddpkit"]
        by = {(r["repeat"], r["contestant"]): r["fit_s"] for r in mine}
        paired = [
            by[(k, "hand")] / by[(k, "ddpkit")]
            for k in sorted({r["repeat"] for r in mine})
            if (k, "hand") in by and (k, "ddpkit") in by
        ]
        rows.append(
            {
                "run": name,
                "nprocs": next(j.nprocs for j in SHORT_RUNS if j.name == name),
                "contestants": per,
                "ratio": _ratio(hand["fit_median"], ours["fit_median"]),
                "paired_ratios": paired,
                "paired_ratio_median": _median(paired),
                "ratio_with_setup": _ratio(hand["total_median"], ours["total_median"]),
                # Both train the same batches in the same order: the same model, bit for bit.
                "same_model": len(hand["digests"]) == 1 and hand["digests"] == ours["digests"],
            }
        )
    return rows


def short_table(rows: list[dict[str, Any]], markdown: bool) -> str:
    """Medians of rank 0's training call (and set-up), and hand's over ddpkit's."""
    head = [
        "short run",
        "hand s",
        "ddpkit s",
        "hand/ddpkit",
        "paired (min-max)",
        "set-up s hand/ddpkit",
        "with set-up",
    ]
    body = []
    for r in rows:
        hand, ours, paired = (
            r["contestants"]["hand"],
            r["contestants"]["ddpkit"],
            r["paired_ratios"],
        )
        spread = f"{min(paired):.2f}-{max(paired):.2f}" if paired else "-"
        body.append(
            [
                r["run"],
                _num(hand["fit_median"], ".3f"),
                _num(ours["fit_median"], ".3f"),
                _num(r["ratio"], ".3f"),
                f"{_num(r['paired_ratio_median'], '.3f')} ({spread})",
                f"{_num(hand['setup_median'], '.2f')}/{_num(ours['setup_median'], '.2f')}",
                _num(r["ratio_with_setup"], ".3f"),
            ]
        )
    return _render(head, body, markdown)


def short_report(rows: list[dict[str, Any]], markdown: bool) -> str:
    parts = [
        "Short runs: rank 0's training call (train()/fit(), checkpoints included), median s; "
        "hand/ddpkit >= 1: ddpkit is at least as fast",
        short_table(rows, markdown),
    ]
    problems = [
        f"- {r['run']}: ddpkit's model is not the hand-written loop's"
        for r in rows
        if not r["same_model"]
    ]
    problems += [
        f"- {r['run']} {name}: saw world size(s) {c['world_sizes']}, not {r['nprocs']}"
        for r in rows
        for name, c in r["contestants"].items()
        if c["world_sizes"] != [r["nprocs"]]
    ]
    verdict = "both saw every rank and ended with the same model"
    parts += ["", "Checks: " + ("" if problems else verdict)]
    return "\n".join(parts + problems)


# -- the schedule -----------------------------------------------------------------------
def contestants_for(workload: Workload, nprocs: int, chosen: Sequence[str]) -> list[str]:
    """The contestants of one cell: synchronised BatchNorm only where there is some, bf16
    gradients where the all-reduce is the bottleneck (the MLP)."""
    extra = {"cnn": [SYNCBN], "mlp": [BF16]}.get(workload.name, [])
    return [*chosen, *(extra if nprocs > 1 and "ddpkit" in chosen else [])]


def run_all(
    workloads: Sequence[Workload],
    nprocs_list: Sequence[int],
    chosen: Sequence[str],
    repeats: int,
    rounds: int,
    start_workloads: Sequence[Workload],
    start_repeats: int,
    say: Say,
    settle_s: float = 0.0,
    retries: int = 2,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Every cell's throughput launches, then the start-up launches; repeats are spread
    over the whole run, so slow drift hits every cell alike."""
    runs: list[dict[str, Any]] = []
    threads = threads_for(max(nprocs_list))  # per rank, in every cell alike
    for repeat in range(repeats):
        for w in workloads:
            for n in nprocs_list:
                names = contestants_for(w, n, chosen)
                launch_runs, foreign, attempt = measured(
                    functools.partial(throughput_launch, w, n, names, rounds, threads),
                    settle_s,
                    retries,
                    say,
                )
                cell = {"workload": w.name, "nprocs": n, "repeat": repeat}
                runs += [
                    {**cell, **r, "foreign_load": foreign, "attempt": attempt} for r in launch_runs
                ]
                say(_rate_line(w.name, n, repeat, launch_runs, foreign))
    starts: list[dict[str, Any]] = []
    for repeat in range(start_repeats):
        for w in start_workloads:
            for n in nprocs_list:
                names = contestants_for(w, n, chosen) + ([FLOOR] if "hand" in chosen else [])
                for name in _order(names, repeat):  # alternate who goes first
                    records, foreign, attempt = measured(
                        functools.partial(_one_start, name, w, n),
                        settle_s,
                        retries,
                        say,
                    )
                    cell = {"workload": w.name, "nprocs": n, "repeat": repeat}
                    starts.append({**cell, **records[0], "foreign_load": foreign})
                say(_start_line(w.name, n, repeat, starts[-len(names) :]))
    return runs, starts


def _rate_line(
    name: str, nprocs: int, repeat: int, runs: list[dict[str, Any]], foreign: float | None
) -> str:
    by: dict[str, list[float]] = {}
    for r in runs:
        by.setdefault(r["contestant"], []).append(r["samples_per_s"])
    rates = "  ".join(f"{c} {statistics.median(v):,.0f}" for c, v in by.items())
    busy = "" if foreign is None else f", other load {foreign:.0%}"
    note = f" [{runs[0]['note']}]" if runs and runs[0]["note"] else ""
    return f"  [{repeat + 1}] {name:<4} nproc {nprocs}: {rates} samples/s{busy}{note}"


def _start_line(name: str, nprocs: int, repeat: int, starts: list[dict[str, Any]]) -> str:
    parts = "  ".join(
        f"{s['contestant']} {s['first_step_s']:.2f}s/{max(s['peak_rss_mb']):.0f}MB" for s in starts
    )
    return f"  [start {repeat + 1}] {name:<4} nproc {nprocs}: first step/peak RSS {parts}"


# -- summary ----------------------------------------------------------------------------
def _median(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _paired(runs: list[dict[str, Any]], ours: str, other: str) -> list[float]:
    """`ours`'s rate over `other`'s in the same launch and round."""
    rate = {(r["repeat"], r["round"], r["contestant"]): r["samples_per_s"] for r in runs}
    return [
        rate[(rep, rnd, ours)] / rate[(rep, rnd, other)]
        for (rep, rnd, c) in rate
        if c == ours and (rep, rnd, other) in rate and rate[(rep, rnd, other)]
    ]


def summarize_cell(runs: list[dict[str, Any]], starts: list[dict[str, Any]]) -> dict[str, Any]:
    """One (workload, nprocs) cell: per contestant its rates, start-up times, memory and
    checks; ratios to the hand-written loop; ddpkit over each other contestant."""
    names = list(dict.fromkeys([r["contestant"] for r in runs] + [s["contestant"] for s in starts]))
    hand_digests = {r["model_digest"] for r in runs if r["contestant"] == "hand"}
    per: dict[str, dict[str, Any]] = {}
    for name in names:
        mine = [r for r in runs if r["contestant"] == name]
        booted = [s for s in starts if s["contestant"] == name]
        rates = [float(r["samples_per_s"]) for r in mine]
        digests = {r["model_digest"] for r in mine}
        per[name] = {
            "samples_per_s": rates,
            "median": _median(rates),
            "first_step_s": [s["first_step_s"] for s in booted],
            "first_step_median": _median(s["first_step_s"] for s in booted),
            # per launch, the largest rank's peak; then the median over launches
            "peak_rss_mb": [max(s["peak_rss_mb"]) for s in booted],
            "peak_rss_median": _median(max(s["peak_rss_mb"]) for s in booted),
            "world_sizes": sorted(
                {r["world_size"] for r in mine} | {w for s in booted for w in s["world_sizes"]}
            ),
            "ddp": sorted({bool(r["ddp"]) for r in mine}),
            "ranks_agree": all(r["ranks_agree"] for r in mine),
            "cpu_us_per_sample": _median(r.get("cpu_us_per_sample") for r in mine),
            "same_model_as_hand": bool(hand_digests) and digests == hand_digests,
        }
    hand = per.get("hand", {}).get("median")
    for values in per.values():
        values["ratio_to_hand"] = _ratio(values["median"], hand)
    ours = per.get("ddpkit", {})
    vs: dict[str, dict[str, Any]] = {
        other: {
            "ratio": _ratio(ours.get("median"), per[other]["median"]),
            "paired_ratios": _paired(runs, "ddpkit", other),
            "first_step_ratio": _ratio(
                ours.get("first_step_median"), per[other]["first_step_median"]
            ),
        }
        for other in names
        if other not in ("ddpkit", *VARIANTS, FLOOR) and "ddpkit" in per
    }
    for other, v in vs.items():
        v["paired_ratio_median"] = _median(v["paired_ratios"])
        v["cpu_ratio"] = _ratio(ours.get("cpu_us_per_sample"), per[other]["cpu_us_per_sample"])
    # What synchronising BatchNorm costs: plain BN's samples/s over synchronised BN's.
    sync_cost = _median(1 / r for r in _paired(runs, SYNCBN, "ddpkit"))
    floor = per.get(FLOOR, {}).get("first_step_median")
    start_floor = {
        "floor_over_hand": _ratio(floor, per.get("hand", {}).get("first_step_median")),
        "ddpkit_over_floor": _ratio(ours.get("first_step_median"), floor),
    }
    return {
        "contestants": per,
        "ddpkit_vs": vs,
        "syncbn_cost": sync_cost,
        "start_floor": start_floor if floor is not None else None,
    }


def summarize(runs: list[dict[str, Any]], starts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every cell, in the order they ran."""
    cells = dict.fromkeys((r["workload"], r["nprocs"]) for r in [*runs, *starts])
    return [
        {
            "workload": w,
            "nprocs": n,
            **summarize_cell(
                [r for r in runs if (r["workload"], r["nprocs"]) == (w, n)],
                [s for s in starts if (s["workload"], s["nprocs"]) == (w, n)],
            ),
        }
        for w, n in cells
    ]


def scaling(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per workload and contestant: samples/s at the most processes over that many times
    the one-process rate (1.0: perfect). ddpkit's variants run only with several
    processes; their one-process job is ddpkit's (nothing to synchronise alone)."""
    out = []
    for w in dict.fromkeys(r["workload"] for r in rows):
        mine = {
            r["nprocs"]: r["contestants"]
            for r in rows
            if r["workload"] == w
            and any(c["median"] is not None for c in r["contestants"].values())
        }
        if 1 not in mine or len(mine) < 2:  # start-up launches only, or one process count
            continue
        n = max(mine)
        eff: dict[str, float | None] = {}
        for name, values in mine[n].items():
            base = mine[1].get("ddpkit" if name in VARIANTS else name, {}).get("median")
            eff[name] = _ratio(values["median"], None if base is None else base * n)
        out.append({"workload": w, "nprocs": n, "efficiency": eff})
    return out


def targets(rows: list[dict[str, Any]], scale: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's targets, row by row: samples/s >= 1.0 x hand and each peer; CPU time
    per sample of one process <= hand's; time to first step <= 0.5 x hand's and shorter
    than each peer's; synchronised BatchNorm <= 1.10 x plain BN; MLP scaling >= 0.75."""
    out = []
    for row in rows:
        where = f"{row['workload']}/{row['nprocs']}"
        for other, v in row["ddpkit_vs"].items():
            need = TARGET_HAND if other == "hand" else TARGET_PEER
            if v["ratio"] is not None:
                out.append(_target(where, f"samples/s vs {other}", v["ratio"], need))
            if other == "hand" and row["nprocs"] == 1 and v["cpu_ratio"] is not None:
                out.append(
                    _target(where, "CPU time per sample vs hand", v["cpu_ratio"], 1.0, below=True)
                )
            first, need = v["first_step_ratio"], TARGET_FIRST_STEP if other == "hand" else 1.0
            if first is not None:
                out.append(_target(where, f"first step vs {other}", first, need, below=True))
        if row["syncbn_cost"] is not None:
            cost = row["syncbn_cost"]
            out.append(_target(where, "SyncBN cost vs plain BN", cost, TARGET_SYNCBN, below=True))
    for s in scale:
        if s["workload"] != "mlp":
            continue
        for name in ("ddpkit", BF16):
            if s["efficiency"].get(name) is not None:
                what = f"scaling of {name}"
                out.append(
                    _target(f"mlp/{s['nprocs']}", what, s["efficiency"][name], TARGET_SCALING)
                )
    return out


def _target(
    where: str, what: str, value: float, need: float, below: bool = False
) -> dict[str, Any]:
    met = value <= need if below else value >= need
    return {"row": where, "target": what, "value": value, "need": need, "below": below, "met": met}


# -- tables -----------------------------------------------------------------------------
def _names(rows: list[dict[str, Any]], floor: bool = False) -> list[str]:
    """The contestants that ran, in the tables' order; with `floor`, the start-up floor
    last (it has no throughput)."""
    seen = dict.fromkeys(n for r in rows for n in r["contestants"])
    return [n for n in (*CONTESTANTS, *VARIANTS, *([FLOOR] if floor else [])) if n in seen]


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _render(head: list[str], body: list[list[str]], markdown: bool, left: int = 1) -> str:
    """A text or markdown table; the first `left` columns are words, the rest numbers."""
    if markdown:
        lines = [
            "| " + " | ".join(head) + " |",
            "|" + "|".join(["---"] * left + ["--:"] * (len(head) - left)) + "|",
        ]
        return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in body])
    widths = [max(len(x) for x in col) for col in zip(head, *body, strict=True)]

    def fmt(row: list[str]) -> str:
        return "  ".join(
            c.ljust(w) if i < left else c.rjust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        )

    return "\n".join([fmt(head), "  ".join("-" * w for w in widths), *map(fmt, body)])


def rate_table(rows: list[dict[str, Any]], markdown: bool) -> str:
    """Median samples/s per contestant (with its ratio to the hand-written loop), then
    ddpkit's median over each other contestant's."""
    names = _names(rows)
    others = [n for n in ("hand", "accelerate", "fabric") if n in names and "ddpkit" in names]
    head = ["workload", "nproc", *names, *(f"ddpkit/{o}" for o in others)]
    body = []
    for r in rows:
        cells = []
        for n in names:
            c = r["contestants"].get(n)
            if c is None or c["median"] is None:
                cells.append("-")
            elif n == "hand" or c["ratio_to_hand"] is None:
                cells.append(f"{c['median']:,.0f}")
            else:
                cells.append(f"{c['median']:,.0f} ({c['ratio_to_hand']:.2f})")
        ratios = [_num(r["ddpkit_vs"].get(o, {}).get("ratio"), ".3f") for o in others]
        body.append([r["workload"], str(r["nprocs"]), *cells, *ratios])
    return _render(head, body, markdown)


def start_table(rows: list[dict[str, Any]], markdown: bool) -> str:
    """Median time to first step and peak memory per rank: a line per contestant of each
    cell that had start-up launches."""
    head = ["workload", "contestant", "nproc", "first step s", "x ddpkit", "peak RSS MB per rank"]
    body = []
    for r in rows:
        cs = r["contestants"]
        ours = cs.get("ddpkit", {}).get("first_step_median")
        for name in _names([r], floor=True):
            c = cs[name]
            if c["first_step_median"] is None:
                continue
            body.append(
                [
                    r["workload"],
                    name,
                    str(r["nprocs"]),
                    _num(c["first_step_median"], ".2f"),
                    _num(_ratio(c["first_step_median"], ours), ".2f"),
                    _num(c["peak_rss_median"], ",.0f"),
                ]
            )
    return _render(head, body, markdown, left=2)


def floor_lines(rows: list[dict[str, Any]]) -> list[str]:
    """What the floor says of the first-step target, a line per cell that measured it."""
    lines = []
    for r in rows:
        f = r.get("start_floor")
        if f is None or f["floor_over_hand"] is None:
            continue
        ours = _num(f["ddpkit_over_floor"], ".2f")
        lines.append(
            f"- {r['workload']}/{r['nprocs']}: one process alone (the floor) reaches its first "
            f"step at {f['floor_over_hand']:.2f} x the hand-written loop's time, the lowest "
            f"ratio any launcher can show; ddpkit takes {ours} x the floor"
        )
    return ["Start-up floor:", *lines, ""] if lines else []


def scaling_table(scale: list[dict[str, Any]], names: list[str], markdown: bool) -> str:
    head = ["workload", "nproc", *names]
    body = [
        [s["workload"], str(s["nprocs"]), *(_num(s["efficiency"].get(n), ".2f") for n in names)]
        for s in scale
    ]
    return _render(head, body, markdown)


def check_lines(rows: list[dict[str, Any]]) -> list[str]:
    """Anything that says a contestant did not run what it should have: fewer ranks,
    no DDP wrapper, ranks that ended apart, a model that differs where it must not."""
    problems = []
    for row in rows:
        n, where = row["nprocs"], f"{row['workload']}/{row['nprocs']}"
        for name, c in row["contestants"].items():
            if name == FLOOR:  # one process by design
                continue
            if c["world_sizes"] and c["world_sizes"] != [n]:
                problems.append(f"{where} {name}: saw world size(s) {c['world_sizes']}, not {n}")
            if n > 1 and c["ddp"] and c["ddp"] != [True]:
                problems.append(f"{where} {name}: the model was not wrapped in DDP")
            if not c["ranks_agree"]:
                problems.append(f"{where} {name}: ranks ended with different models")
            same_order = name in ("ddpkit", "fabric") if n > 1 else name == "ddpkit"
            trained = c["median"] is not None and row["contestants"].get("hand", {}).get("median")
            if same_order and trained and not c["same_model_as_hand"]:
                problems.append(f"{where} {name}: not the hand-written loop's model")
    return problems


def report(
    rows: list[dict[str, Any]],
    scale: list[dict[str, Any]],
    goals: list[dict[str, Any]],
    markdown: bool,
) -> str:
    names = _names(rows)
    parts = [
        "Training throughput: median samples/s (in brackets: x the hand-written loop)",
        rate_table(rows, markdown),
        "",
        "Start-up and memory, medians: from the command's start to rank 0's first optimizer "
        "step; peak RSS of the largest rank after one epoch",
        start_table(rows, markdown),
        "",
        *floor_lines(rows),
        "Scaling efficiency: samples/s with N processes / (N x samples/s with one)",
        scaling_table(scale, names, markdown),
        "",
        "Targets:",
    ]
    for g in goals:
        sign = "<=" if g["below"] else ">="
        verdict = "met" if g["met"] else "MISSED"
        parts.append(
            f"- {g['row']} {g['target']}: {g['value']:.3f} (need {sign} {g['need']}) {verdict}"
        )
    problems = check_lines(rows)
    parts += ["", "Checks: " + ("all contestants ran what they should" if not problems else "")]
    parts += [f"- {p}" for p in problems]
    return "\n".join(parts)


def header(meta: dict[str, Any]) -> str:
    return (
        f"ddpkit vs peers, {meta['date']}: torch {meta['torch']}, python {meta['python']}, "
        f"{meta['cpu_count']} CPU(s), load average at start {meta['loadavg_start']:.2f}; "
        f"throughput: {meta['repeats']} launch(es) x {meta['rounds']} round(s) per cell; "
        f"start-up: {meta['start_repeats']} launch(es) per contestant and cell"
    )


# -- command line -----------------------------------------------------------------------
def _versions(chosen: Sequence[str]) -> dict[str, str]:
    from importlib.metadata import version

    out = {"torch": torch.__version__, "ddpkit": ddpkit.__version__}
    for name, dist_name in (("accelerate", "accelerate"), ("fabric", "lightning-fabric")):
        if name in chosen:
            out[name] = version(dist_name)
    return out


def choose(p: argparse.ArgumentParser, flag: str, text: str, choices: Iterable[str]) -> list[str]:
    """The comma-separated names of `text`, each one of `choices` (else a usage error)."""
    names = [n for n in text.split(",") if n]
    if not names or set(names) - set(choices):
        p.error(f"{flag}: pick from {', '.join(choices)} (got {text!r})")
    return names


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="bench/peers.py",
        description="ddpkit vs the hand-written DDP loop, Accelerate and Lightning Fabric "
        "(gloo, CPU): samples/s, time to first step, peak memory.",
    )
    p.add_argument(
        "--repeats", type=int, default=2, help="throughput launches per cell (default 2)"
    )
    p.add_argument(
        "--rounds", type=int, default=3, help="runs of each contestant per launch (default 3)"
    )
    p.add_argument(
        "--start-repeats",
        type=int,
        default=3,
        help="start-up launches per contestant and cell (default 3; 0: none)",
    )
    p.add_argument("--nprocs", default="1,2", help="process counts, comma-separated (default 1,2)")
    p.add_argument(
        "--workloads", default=",".join(WORKLOADS), help="comma-separated (default %(default)s)"
    )
    p.add_argument(
        "--start-workloads",
        default="cnn",
        help="workloads of the start-up launches (default %(default)s: the others build a "
        "different model, a few MB, and start the same way)",
    )
    p.add_argument(
        "--contestants",
        default=",".join(CONTESTANTS),
        help="comma-separated, of %(default)s; hand,ddpkit needs no extra packages",
    )
    p.add_argument("--quick", action="store_true", help="a smoke run (about 80 s)")
    p.add_argument(
        "--short",
        action="store_true",
        help="only the short runs: hand vs ddpkit, whole training call (about 3 min)",
    )
    p.add_argument(
        "--short-repeats",
        type=int,
        default=5,
        help="with --short: launches per contestant and short run (default 5)",
    )
    p.add_argument(
        "--out",
        type=Path,
        help=f"JSON file (default {DEFAULT_OUT}; with --short, {SHORT_OUT})",
    )
    p.add_argument("--markdown", action="store_true", help="print the tables as markdown")
    add_settle_args(p)
    args = p.parse_args(argv)
    try:
        args.nprocs = [int(n) for n in args.nprocs.split(",")]
    except ValueError:
        p.error(f"--nprocs takes integers like 1,2 (got {args.nprocs!r})")
    args.workloads = choose(p, "--workloads", args.workloads, WORKLOADS)
    args.start_workloads = choose(p, "--start-workloads", args.start_workloads, WORKLOADS)
    args.contestants = choose(p, "--contestants", args.contestants, CONTESTANTS)
    # The short runs have hand and ddpkit only: they need no extra.
    missing = [
        m
        for c, m in PEERS.items()
        if c in args.contestants and not args.short and importlib.util.find_spec(m) is None
    ]
    if missing:
        p.error(
            f'{" and ".join(missing)} not installed: pip install -c constraints.txt -e ".[bench]" '
            "(or pass --contestants hand,ddpkit)"
        )
    if (
        min(args.repeats, args.rounds, args.short_repeats, *args.nprocs) < 1
        or min(args.start_repeats, args.retries, args.settle) < 0
    ):
        p.error(
            "--repeats, --rounds, --short-repeats and --nprocs must be >= 1; "
            "--start-repeats, --retries and --settle >= 0"
        )
    if args.quick:
        args.repeats, args.rounds, args.start_repeats = 1, 1, 1
    if args.out is None:
        args.out = SHORT_OUT if args.short else DEFAULT_OUT
    return args


def short_main(args: argparse.Namespace) -> int:
    """`--short`: the short runs alone (hand and ddpkit: no extra packages needed)."""
    meta: dict[str, Any] = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        **_versions(SHORT_CONTESTANTS),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": threads_for(1),
        "loadavg_start": os.getloadavg()[0],
        "short_repeats": args.short_repeats,
        "settle_s": args.settle,
        "retries": args.retries,
        "busy_limit": BUSY_LIMIT,
        "runs": {
            r.name: {**asdict(r.workload), "nprocs": r.nprocs, "checkpoint": r.checkpoint}
            for r in SHORT_RUNS
        },
        "measure": "rank 0: from the start of train()/fit() to its return, checkpoints "
        "included; set-up (data, model, optimizer, wrapping) apart; no process start-up",
    }
    start = time.perf_counter()

    def say(text: str) -> None:
        print(f"{time.perf_counter() - start:5.0f}s {text}", file=sys.stderr, flush=True)

    say(
        f"short runs, {meta['date']}: torch {meta['torch']}, {meta['cpu_count']} CPU(s), "
        f"{args.short_repeats} launch(es) per contestant and run"
    )
    records = run_short(args.short_repeats, say, args.settle, args.retries)
    rows = summarize_short(records)
    meta["loadavg_end"] = os.getloadavg()[0]
    meta["elapsed_s"] = round(time.perf_counter() - start, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    doc = {"meta": meta, "rows": rows, "records": records}
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(short_report(rows, args.markdown))
    warn_if_contended(records, say)
    say(f"wrote {args.out} ({meta['elapsed_s']}s)")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.short:
        return short_main(args)
    workloads = [WORKLOADS[name] for name in args.workloads]
    if args.quick:
        workloads = [replace(w, epochs=QUICK_EPOCHS[w.name]) for w in workloads]
    # A start-up launch trains one epoch: peak memory is reached by then.
    start_workloads = [replace(WORKLOADS[name], epochs=1) for name in args.start_workloads]
    meta: dict[str, Any] = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        **_versions(args.contestants),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": threads_for(1),
        "threads_per_rank": threads_for(max(args.nprocs)),
        "loadavg_start": os.getloadavg()[0],
        "repeats": args.repeats,
        "rounds": args.rounds,
        "start_repeats": args.start_repeats,
        "quick": args.quick,
        "settle_s": args.settle,
        "retries": args.retries,
        "busy_limit": BUSY_LIMIT,
        "nprocs": args.nprocs,
        "contestants": args.contestants,
        "workloads": {w.name: asdict(w) for w in workloads},
        "start_workloads": {w.name: asdict(w) for w in start_workloads},
        "targets": {
            "ddpkit/hand": TARGET_HAND,
            "ddpkit/peer": TARGET_PEER,
            "first step ddpkit/hand": TARGET_FIRST_STEP,
            "syncbn cost": TARGET_SYNCBN,
            "mlp scaling": TARGET_SCALING,
        },
        "measure": "global samples / summed batch-loop time of all epochs on rank 0",
    }

    start = time.perf_counter()

    def say(text: str) -> None:
        print(f"{time.perf_counter() - start:5.0f}s {text}", file=sys.stderr, flush=True)

    say(header(meta))
    runs, starts = run_all(
        workloads,
        args.nprocs,
        args.contestants,
        args.repeats,
        args.rounds,
        start_workloads,
        args.start_repeats,
        say,
        args.settle,
        args.retries,
    )
    rows = summarize(runs, starts)
    scale = scaling(rows)
    goals = targets(rows, scale)
    meta["loadavg_end"] = os.getloadavg()[0]
    meta["elapsed_s"] = round(time.perf_counter() - start, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "meta": meta,
        "rows": rows,
        "scaling": scale,
        "targets": goals,
        "runs": runs,
        "starts": starts,
    }
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(header(meta))
    print(report(rows, scale, goals, args.markdown))
    warn_if_contended([*runs, *starts], say)
    say(f"wrote {args.out} ({meta['elapsed_s']}s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

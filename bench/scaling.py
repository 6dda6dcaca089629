"""Which of ddpkit's costs grow faster with the model than the work they do?

Every benchmark before this one trained models of a few MB, so a cost proportional to
the model's size went unseen: `model_digest` once walked tensor storage in Python, at
3.6 s per MiB (an hour for a 1 GB model), and nothing measured it. This script times,
for one model at two sizes (by default 25 M and 100 M float32 parameters, 100 and
400 MB: 6 Linear(width, width) layers), each of ddpkit's costs that touch every
byte of the model against what a user would write by hand:

- `save`: `save_checkpoint({"model", "optimizer"}, ...)` (Trainer's and
  `save_state`'s writer: temporary file, rename, and the fsync on a thread while
  training goes on) vs `torch.save` of the same dict to the same disk; `fsynced save`:
  `save_checkpoint` and `wait_for_checkpoints` (until the file is on disk) against
  `torch.save` and an `os.fsync` of the file, what makes a checkpoint survive a
  power cut. The flush a save leaves to its thread is waited for after the clock
  stops, so that it does not slow the next measurement.
- `load`: `load_checkpoint` vs `torch.load(weights_only=True)` of that file.
- `sharded save`: the DCP path of strategy "fsdp" (`save_checkpoint(..., shards=...)`,
  2 gloo ranks of FSDP2, one thread each) vs `torch.distributed.checkpoint.save` of the
  same state dict; skipped where FSDP2 cannot run on CPU (torch < 2.7).
- `digest`: `model_digest` vs sha256 over each tensor's `numpy().tobytes()`.
- `export`: `ddpkit export CKPT OUT.pt` (its function, in this process: a temporary
  file and a rename, no fsync) vs `torch.load` of the checkpoint and `torch.save` of
  its model.
- `verify record`: what `ddpkit verify` records on rank 0 after every step (a CPU
  copy of the state dict, and a digest per parameter to compare ranks, hashed on a
  thread while it `torch.save`s the copy) vs a `clone()` of each tensor and a
  `torch.save`.
- `resume`: a `Trainer` with `resume=True` from `fit()` to its first step (lock,
  choose the newest checkpoint, load it into model and optimizer) vs `torch.load` +
  `load_state_dict` by hand.

Method: each measurement runs in a fresh temporary folder (deleted afterwards, untimed)
that holds what it reads, hard-linked, and starts after an `os.sync()`, so that a file
one contestant left to the kernel to write out does not slow the next. The two take
turns (one unmeasured warm-up pair, then raw, ddpkit / ddpkit, raw / ...), and each
row reports the median of `--repeats` (7) runs with their spread (a run that writes
hundreds of MB is at times twice as slow, in CPU time too, when the kernel reclaims
page cache in its stead: with 3 runs, two such ones moved a median by 1.5x). The
optimizer is SGD without momentum, so a checkpoint is the model's weights and a few
bytes. One process
uses every core; the 2 ranks of the sharded save use one thread each. A cost that
grows with the model as its raw counterpart does keeps its ratio at both sizes
(`growth`, the ratio at this size over the ratio at the smallest, stays near 1); a
per-byte Python loop or a second copy shows as a ratio far above 1 at every size.
Each row also gives the `CPU ratio`: the CPU seconds of ddpkit's call over the raw
one's (this process and all its threads; rank 0's in the sharded save). A per-byte loop
or an extra copy raises it as much as the wall-time ratio, while a wait on the disk
(an fsync) hardly counts, and other processes disturb it far less. The `best ratio` is
that of each contestant's fastest run: the work itself, which noise only lengthens (on
this VM a slow run is slow in CPU time too, so the CPU ratio does not filter it out).
Files written just before they are read come from the page cache, for both alike.

Timings on a shared machine are noisy: each row records the share of the CPUs that
other processes (and the kernel, writing files out) used meanwhile (`foreign_load`).

    .venv/bin/python bench/scaling.py                    # ~3 min on 2 cores, 1.2 GB RAM
    .venv/bin/python bench/scaling.py --quick            # smoke run: 1 M and 4 M, 3 runs, ~30 s
    .venv/bin/python bench/scaling.py --markdown --json bench/results/scaling.json
    .venv/bin/python bench/scaling.py --params 10,50,200 --only digest,load

Rows whose ratio is above 1.2 at the largest size are named on stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import hashlib
import io
import json
import math
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from machine import LoadMeter, _machine_busy_s, _own_busy_s
from tables import format_table
from torch import nn
from tutorial import threads_for

import ddpkit
from ddpkit import DistContext
from ddpkit.checkpoint.digest import model_digest
from ddpkit.checkpoint.pt import load_checkpoint, save_checkpoint
from ddpkit.parallel.ranks import all_gather_object, broadcast_object

LIMIT = 1.2  # a ddpkit cost above this multiple of its raw counterpart is looked into
DEPTH = 6  # Linear layers: 6 x 4096^2 is 100.7 M parameters (bench/fsdp_memory.py's model)
DEFAULT_PARAMS = (25.0, 100.0)  # millions
QUICK_PARAMS = (1.0, 4.0)
COSTS = (
    "save",
    "fsynced save",
    "load",
    "sharded save",
    "digest",
    "export",
    "verify record",
    "resume",
)

# A contestant, given a fresh empty folder, prepares what it needs there (untimed) and
# returns the action that is timed; what the action returns is dropped after the clock
# stops, so that freeing a loaded state is timed for neither.
Prepare = Callable[[Path], Callable[[], object]]


@dataclass
class Cost:
    name: str
    ddpkit: Prepare
    raw: Prepare


# -- the model ---------------------------------------------------------------------------
def width_for(params_m: float, depth: int = DEPTH) -> int:
    """The layer width (a multiple of 64) whose `depth` Linear layers come nearest to
    `params_m` million parameters."""
    exact = math.sqrt(params_m * 1e6 / depth)
    return max(64, round(exact / 64) * 64)


def build_model(width: int, depth: int = DEPTH) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(width, width) for _ in range(depth)))


def size_of(model: nn.Module) -> tuple[int, float]:
    """(parameters, MB of the state dict's tensors)."""
    state = model.state_dict()
    params = sum(t.numel() for t in state.values())
    return params, sum(t.numel() * t.element_size() for t in state.values()) / 1e6


# -- timing ------------------------------------------------------------------------------
def measure(prepare: Prepare, base: Path | None) -> tuple[float, float]:
    """Wall and CPU seconds (of this process, all its threads) of one action, run in a
    fresh temporary folder under `base`."""
    with tempfile.TemporaryDirectory(dir=base, prefix="ddpkit-scaling-") as tmp:
        action = prepare(Path(tmp))
        gc.collect()  # the previous run's garbage is freed now, not during this one
        # A torch.save leaves its file to the kernel to write out; written now, it
        # does not slow whichever contestant comes next.
        os.sync()
        start, cpu = time.perf_counter(), time.process_time()
        result = action()
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
        ddpkit.wait_for_checkpoints()  # a save's flush, left to its thread: untimed
        del result, action
    return elapsed, cpu


def duel(
    run: Callable[[Prepare], tuple[float, float]], cost: Cost, repeats: int, warmup: int
) -> dict[str, list[float]]:
    """Both contestants of `cost`, taking turns: rounds alternate which goes first
    (ddpkit, raw / raw, ddpkit / ...), so a machine that slows down or speeds up during
    the rounds hits both alike. The first `warmup` rounds are not kept. Returns the wall
    seconds of each (`ddpkit`, `raw`) and their CPU seconds (`ddpkit_cpu`, `raw_cpu`)."""
    times: dict[str, list[float]] = {"ddpkit": [], "raw": [], "ddpkit_cpu": [], "raw_cpu": []}
    for r in range(warmup + repeats):
        for who in ("ddpkit", "raw") if r % 2 == 0 else ("raw", "ddpkit"):
            wall, cpu = run(cost.ddpkit if who == "ddpkit" else cost.raw)
            if r >= warmup:
                times[who].append(wall)
                times[f"{who}_cpu"].append(cpu)
    return times


def link_into(source: Path, folder: Path) -> Path:
    """`source` in `folder` under its own name: a hard link (no bytes copied, and the
    page cache stays as warm as it was), or a copy where links are not possible."""
    target = folder / source.name
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)
    return target


# -- the one-process costs ----------------------------------------------------------------
class _Stop(Exception):
    """Raised by `_StopAtFirstStep` to end `fit()` just before the first step."""


class _StopAtFirstStep(ddpkit.Callback):
    def on_fit_start(self, trainer: ddpkit.Trainer) -> None:
        raise _Stop


def _trainer(model: nn.Module, ctx: DistContext, folder: Path, resume: bool) -> ddpkit.Trainer:
    data = torch.utils.data.TensorDataset(torch.zeros(8, 1), torch.zeros(8, dtype=torch.long))
    config = ddpkit.TrainConfig(
        checkpoint_dir=str(folder), resume=resume, epochs=1, batch_size=8, progress=False
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return ddpkit.Trainer(
        model, optimizer, data, ctx, config, callbacks=[_StopAtFirstStep()], log_fn=_quiet
    )


def _quiet(_: str) -> None:
    pass


def one_process_costs(model: nn.Module, inputs: Path, ctx: DistContext) -> list[Cost]:
    """The costs that one process pays, on `model`; their input files go to `inputs`."""
    from ddpkit.cli import export
    from ddpkit.verification.equivalence import _Record

    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    # The files that load, export and resume read: written by ddpkit, as a job would.
    checkpoint = save_checkpoint(state, inputs / "saved", ctx, step=1)
    trained = _trainer(model, ctx, inputs / "trainer", resume=False)
    trained.save()
    resume_from = trained.last_checkpoint
    assert resume_from is not None
    del trained

    def ddpkit_save(folder: Path) -> Callable[[], object]:
        return lambda: save_checkpoint(state, folder, ctx, step=1)

    def durable_save(folder: Path) -> Callable[[], object]:
        def run() -> None:
            save_checkpoint(state, folder, ctx, step=1)
            ddpkit.wait_for_checkpoints()

        return run

    def raw_save(folder: Path) -> Callable[[], object]:
        return lambda: torch.save(state, folder / "ckpt.pt")

    def fsynced_save(folder: Path) -> Callable[[], object]:
        def run() -> None:
            with open(folder / "ckpt.pt", "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())

        return run

    def ddpkit_load(folder: Path) -> Callable[[], object]:
        path = link_into(checkpoint, folder)
        return lambda: load_checkpoint(path, ctx)

    def raw_load(folder: Path) -> Callable[[], object]:
        path = link_into(checkpoint, folder)
        return lambda: torch.load(path, map_location=ctx.device, weights_only=True)

    def ddpkit_digest(_: Path) -> Callable[[], object]:
        return lambda: model_digest(model)

    def raw_digest(_: Path) -> Callable[[], object]:
        def digest() -> str:
            h = hashlib.sha256()
            for key, tensor in model.state_dict().items():
                h.update(key.encode())
                h.update(tensor.detach().numpy().tobytes())
            return h.hexdigest()

        return digest

    def ddpkit_export(folder: Path) -> Callable[[], object]:
        args = argparse.Namespace(checkpoint=str(link_into(checkpoint, folder)), out=None)
        args.out = str(folder / "model.pt")

        def run() -> int:
            with contextlib.redirect_stdout(io.StringIO()):  # its "wrote ..." line
                return export.run(args)

        return run

    def raw_export(folder: Path) -> Callable[[], object]:
        path = link_into(checkpoint, folder)

        def run() -> None:
            weights = torch.load(path, map_location="cpu", weights_only=True)["model"]
            torch.save(weights, folder / "model.pt")

        return run

    # verify's N-rank run calls _Record.snap on every rank after every step; rank 0
    # also saves the copy.
    def ddpkit_record(folder: Path) -> Callable[[], object]:
        return lambda: _Record(folder, steps=1).snap(model, ctx, 1)

    def raw_record(folder: Path) -> Callable[[], object]:
        def run() -> None:
            copy = {k: v.detach().clone() for k, v in model.state_dict().items()}
            torch.save(copy, folder / "step-1.pt")

        return run

    def ddpkit_resume(folder: Path) -> Callable[[], object]:
        link_into(resume_from, folder)
        trainer = _trainer(model, ctx, folder, resume=True)

        def run() -> int:
            with contextlib.suppress(_Stop):
                trainer.fit()
            return trainer.global_step

        return run

    def raw_resume(folder: Path) -> Callable[[], object]:
        path = link_into(resume_from, folder)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

        def run() -> None:
            saved = torch.load(path, map_location="cpu", weights_only=True)
            model.load_state_dict(saved["model"])
            opt.load_state_dict(saved["optimizer"])

        return run

    return [
        Cost("save", ddpkit_save, raw_save),
        Cost("fsynced save", durable_save, fsynced_save),
        Cost("load", ddpkit_load, raw_load),
        Cost("digest", ddpkit_digest, raw_digest),
        Cost("export", ddpkit_export, raw_export),
        Cost("verify record", ddpkit_record, raw_record),
        Cost("resume", ddpkit_resume, raw_resume),
    ]


def run_one_process(
    sizes: Sequence[float],
    only: Sequence[str],
    repeats: int,
    warmup: int,
    base: Path | None,
    say: Callable[[str], None],
) -> list[dict[str, Any]]:
    torch.set_num_threads(threads_for(1))  # one process: every core
    ctx = DistContext.single("cpu")
    records: list[dict[str, Any]] = []
    for params_m in sizes:
        model = build_model(width_for(params_m))
        params, mb = size_of(model)
        with tempfile.TemporaryDirectory(dir=base, prefix="ddpkit-scaling-inputs-") as inputs:
            for cost in one_process_costs(model, Path(inputs), ctx):
                if cost.name not in only:
                    continue
                meter = LoadMeter()
                times = duel(lambda p: measure(p, base), cost, repeats, warmup)
                records.append(_record(cost.name, params, mb, times, meter.foreign(), 1))
                say(_line(records[-1]))
        del model
    return records


# -- the sharded save, on 2 ranks ---------------------------------------------------------
def measure_ranks(prepare: Prepare, base: Path | None, main: bool) -> tuple[float, float]:
    """`measure` on every rank of a process group: rank 0 makes the folder (one for all),
    every rank runs its action between two barriers, rank 0's clock counts."""
    tmp = tempfile.TemporaryDirectory(dir=base, prefix="ddpkit-scaling-") if main else None
    try:
        name: str | None = broadcast_object(tmp.name if tmp is not None else None)
        assert name is not None
        folder = Path(name)
        action = prepare(folder)
        gc.collect()
        if main:
            os.sync()  # as in `measure`
        ddpkit.barrier()
        start, cpu = time.perf_counter(), time.process_time()
        result = action()
        cpu = time.process_time() - cpu  # this rank's own work, without the wait below
        ddpkit.barrier()
        elapsed = time.perf_counter() - start
        del result, action
        ddpkit.barrier()  # nobody is still in the folder when rank 0 deletes it
    finally:
        if tmp is not None:
            tmp.cleanup()
    return elapsed, cpu


def sharded_cost(model: nn.Module, ctx: DistContext) -> Cost:
    """The sharded save of `model` (already sharded with FSDP on this rank's group)."""
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    from ddpkit.parallel.fsdp import sharded_state

    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # after sharding
    # What Trainer.save hands to both writers: every rank's shards of model and
    # optimizer, and (rank 0's) training state, which ddpkit writes beside them.
    shards = sharded_state(model, optimizer)
    rest = {"epoch": 0, "global_step": 1}

    def ours(folder: Path) -> Callable[[], object]:
        return lambda: save_checkpoint(rest, folder, ctx, step=1, shards=shards)

    def theirs(folder: Path) -> Callable[[], object]:
        return lambda: dcp_save(shards, checkpoint_id=folder / "ckpt.dcp")

    return Cost("sharded save", ours, theirs)


def _sharded_rank(
    ctx: DistContext, sizes: Sequence[float], repeats: int, warmup: int, base: str | None
) -> list[dict[str, Any]]:
    torch.set_num_threads(1)  # 2 processes on 2 cores
    folder_base = None if base is None else Path(base)
    records: list[dict[str, Any]] = []
    for params_m in sizes:
        bare = build_model(width_for(params_m))
        params, mb = size_of(bare)
        model = ddpkit.prepare_model(bare, ctx, strategy="fsdp", fsdp={"min_params": 100_000})
        cost = sharded_cost(model, ctx)
        meter = _RanksLoad()
        times = duel(lambda p: measure_ranks(p, folder_base, ctx.is_main), cost, repeats, warmup)
        foreign = meter.foreign()
        records.append(_record(cost.name, params, mb, times, foreign, ctx.world_size))
        del cost, model, bare
    return records


class _RanksLoad:
    """`machine.LoadMeter` for the ranks of a process group: the CPU that processes other
    than the ranks used (each rank's own time is gathered; `foreign()` is a collective)."""

    def __init__(self) -> None:
        self._t, self._busy, self._own = time.perf_counter(), _machine_busy_s(), _own_busy_s()

    def foreign(self) -> float | None:
        ranks = sum(all_gather_object(_own_busy_s() - self._own))
        busy, seconds = _machine_busy_s(), (time.perf_counter() - self._t) * threads_for(1)
        if busy is None or self._busy is None or seconds <= 0:
            return None
        return max(0.0, busy - self._busy - ranks) / seconds


def run_sharded(
    sizes: Sequence[float], repeats: int, warmup: int, base: Path | None
) -> list[dict[str, Any]]:
    """The sharded save's rows, from one launch of 2 ranks."""
    records: list[dict[str, Any]] = ddpkit.launch(
        _sharded_rank,
        list(sizes),
        repeats,
        warmup,
        None if base is None else str(base),
        nprocs=2,
        backend="gloo",
    )
    return records


# -- summary ------------------------------------------------------------------------------
def _record(
    name: str,
    params: int,
    mb: float,
    times: dict[str, list[float]],
    foreign: float | None,
    processes: int,
) -> dict[str, Any]:
    ours, theirs = statistics.median(times["ddpkit"]), statistics.median(times["raw"])
    cpu = {who: statistics.median(times[f"{who}_cpu"]) for who in ("ddpkit", "raw")}
    return {
        "cost": name,
        "params": params,
        "mb": round(mb, 1),
        "processes": processes,
        "ddpkit_s": times["ddpkit"],
        "raw_s": times["raw"],
        "ddpkit_median_s": ours,
        "raw_median_s": theirs,
        "ratio": ours / theirs,
        # The fastest run of each: the work itself, which noise can only lengthen (this
        # VM's slow runs are slow in CPU time too, so the CPU ratio does not filter them).
        "best_ratio": min(times["ddpkit"]) / min(times["raw"]),
        # CPU time is what a per-byte loop or an extra copy costs, and it is less
        # disturbed by other processes than the wall time (a wait on the disk is none).
        "ddpkit_cpu_s": times["ddpkit_cpu"],
        "raw_cpu_s": times["raw_cpu"],
        "cpu_ratio": cpu["ddpkit"] / cpu["raw"] if cpu["raw"] > 0 else None,
        "ddpkit_ms_per_mb": ours * 1e3 / mb,
        "raw_ms_per_mb": theirs * 1e3 / mb,
        "foreign_load": foreign,
    }


def summarize(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records in COSTS order, smallest size first, each with `growth`: its ratio
    over the same cost's ratio at the smallest size (1.0 there)."""
    rows = sorted(records, key=lambda r: (COSTS.index(r["cost"]), r["params"]))
    smallest: dict[str, float] = {}
    for row in rows:
        smallest.setdefault(row["cost"], row["ratio"])
        row["growth"] = row["ratio"] / smallest[row["cost"]]
    return rows


def over_limit(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows of the largest size whose ratio is above LIMIT."""
    if not rows:
        return []
    largest = max(r["params"] for r in rows)
    return [r for r in rows if r["params"] == largest and r["ratio"] > LIMIT]


def _spread(values: Sequence[float]) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def table(rows: list[dict[str, Any]], markdown: bool) -> str:
    head = [
        "cost",
        "params",
        "MB",
        "ddpkit s (min-max)",
        "raw s (min-max)",
        "ratio",
        "best ratio",
        "growth",
        "CPU ratio",
        "ddpkit ms/MB",
        "raw ms/MB",
    ]
    body = [
        [
            r["cost"] + (f" ({r['processes']} ranks)" if r["processes"] > 1 else ""),
            f"{r['params'] / 1e6:.1f} M",
            f"{r['mb']:,.0f}",
            _spread(r["ddpkit_s"]),
            _spread(r["raw_s"]),
            f"{r['ratio']:.2f}",
            f"{r['best_ratio']:.2f}",
            f"{r['growth']:.2f}",
            "-" if r["cpu_ratio"] is None else f"{r['cpu_ratio']:.2f}",
            f"{r['ddpkit_ms_per_mb']:.2f}",
            f"{r['raw_ms_per_mb']:.2f}",
        ]
        for r in rows
    ]
    return format_table(head, body, markdown)


def _line(r: dict[str, Any]) -> str:
    busy = "" if r["foreign_load"] is None else f", other load {r['foreign_load']:.0%}"
    return (
        f"  {r['cost']:<13} {r['params'] / 1e6:6.1f} M: ddpkit {_spread(r['ddpkit_s'])} s, "
        f"raw {_spread(r['raw_s'])} s, ratio {r['ratio']:.2f}"
        + ("" if r["cpu_ratio"] is None else f" (CPU {r['cpu_ratio']:.2f})")
        + busy
    )


# -- command line -------------------------------------------------------------------------
def _sizes(text: str) -> list[float]:
    sizes = sorted({float(x) for x in text.split(",") if x.strip()})
    if not sizes or sizes[0] <= 0:
        raise ValueError(text)
    return sizes


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="bench/scaling.py",
        description="ddpkit's per-byte costs (checkpoints, digest, export, verify, resume) "
        "against raw torch, at two model sizes.",
    )
    p.add_argument(
        "--params",
        default=",".join(f"{x:g}" for x in DEFAULT_PARAMS),
        help="model sizes in millions of parameters, comma-separated (default %(default)s)",
    )
    p.add_argument("--quick", action="store_true", help="a smoke run: 1 M and 4 M parameters")
    p.add_argument("--repeats", type=int, help="measured runs of each (default 7; 3 with --quick)")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured rounds first (default 1)")
    p.add_argument(
        "--only",
        default=",".join(COSTS),
        help=f"comma-separated, of: {', '.join(COSTS)} (default all)",
    )
    p.add_argument(
        "--dir",
        type=Path,
        default=None,
        help="where the temporary folders go (default: the system's temporary folder)",
    )
    p.add_argument("--json", type=Path, metavar="FILE", help="write every run and the rows here")
    p.add_argument("--markdown", action="store_true", help="print the table as markdown")
    args = p.parse_args(argv)
    try:
        args.params = _sizes(
            ",".join(f"{x:g}" for x in QUICK_PARAMS) if args.quick else args.params
        )
    except ValueError:
        p.error(f"--params takes positive numbers like 25,100 (got {args.params!r})")
    args.only = [c.strip() for c in args.only.split(",") if c.strip()]
    unknown = [c for c in args.only if c not in COSTS]
    if unknown or not args.only:
        p.error(f"--only takes names of {', '.join(COSTS)} (got {unknown or args.only})")
    if args.repeats is None:
        args.repeats = 3 if args.quick else 7
    if args.repeats < 1 or args.warmup < 0:
        p.error("--repeats must be >= 1 and --warmup >= 0")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)

    def say(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    from ddpkit.parallel.fsdp import cpu_supported

    meta: dict[str, Any] = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "ddpkit": ddpkit.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": threads_for(1),
        "loadavg_start": os.getloadavg()[0],
        "params_m": args.params,
        "depth": DEPTH,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "quick": args.quick,
        "limit": LIMIT,
        "skipped": [],
    }
    say(
        f"ddpkit scaling benchmark: torch {meta['torch']}, {meta['cpu_count']} CPU(s), "
        f"sizes {', '.join(f'{x:g} M' for x in args.params)}, {args.repeats} runs each"
    )
    start = time.perf_counter()
    records: list[dict[str, Any]] = []
    if [c for c in args.only if c != "sharded save"]:
        records += run_one_process(args.params, args.only, args.repeats, args.warmup, args.dir, say)
    if "sharded save" in args.only:
        if cpu_supported():
            sharded = run_sharded(args.params, args.repeats, args.warmup, args.dir)
            for r in sharded:
                say(_line(r))
            records += sharded
        else:
            meta["skipped"].append("sharded save: FSDP2 needs torch >= 2.7 on CPU")
            say("  sharded save: skipped (FSDP2 needs torch >= 2.7 on CPU ranks)")
    rows = summarize(records)
    meta["loadavg_end"] = os.getloadavg()[0]
    meta["elapsed_s"] = round(time.perf_counter() - start, 1)
    flagged = over_limit(rows)
    if args.json is not None:
        doc = {"meta": meta, "rows": rows, "over_limit": [r["cost"] for r in flagged]}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
    print(table(rows, args.markdown))
    for r in flagged:
        say(f"over {LIMIT}x at {r['params'] / 1e6:.1f} M: {r['cost']} ({r['ratio']:.2f}x raw)")
    say(f"done in {meta['elapsed_s']} s" + (f", wrote {args.json}" if args.json else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

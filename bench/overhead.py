"""What does ddpkit's Trainer cost against the DDP tutorial's hand-written loop?

Two contestants train the same job with the same data order, batch size and thread
count, alternating in one run (hand-written, ddpkit, hand-written, ddpkit, ...), and end
with bit-identical models (checked: `same_model` in the JSON):

- `hand`: the PyTorch DDP tutorial's `multigpu.py` (its `Trainer` with `_run_batch` and
  `_run_epoch`, `DistributedSampler` + `shuffle=False` + `set_epoch`, `DDP(model)`,
  `init_process_group`, `mp.spawn`, `destroy_process_group`) ported to gloo on CPU: MSE
  loss, a seeded dataset identical on every rank, a rendezvous port picked by the OS
  instead of 12355, `pin_memory` off (there is no GPU to pin for), and neither the
  per-epoch print nor checkpoints (ddpkit saves none here either).
- `ddpkit`: `ddpkit.launch(worker, nprocs=N, backend="gloo")` and `Trainer(...).fit()`.

Both measure throughput the way `Trainer` does: global samples trained (per-rank
`len(sampler)` x world size x epochs) over the summed time of the epochs' batch loops
on rank 0, so process start-up, rendezvous and teardown are not counted. Each rank gets
`cores // nprocs` threads, as `ddpkit.launch` gives them. A second rate over the wall
time of the whole `fit()` / `train()` call (which also counts ddpkit's per-epoch loss
all-reduce and logging) is recorded as `wall_ratio`.

With one process the two do different work on purpose: the tutorial wraps the model in
DDP anyway (a gradient all-reduce over one rank every step), ddpkit does not wrap it, and
`ddpkit.launch` runs the function in the calling process instead of spawning one.

Timings on a machine that other jobs share are noise: every run records the share of
the CPUs other processes used meanwhile (`foreign_load`), and `--settle S` waits for a
quiet machine before each pair and runs a disturbed pair again.

    .venv/bin/python bench/overhead.py              # ~3.5 min on 2 idle cores
    .venv/bin/python bench/overhead.py --quick      # smoke run, under a minute
    .venv/bin/python bench/overhead.py --markdown   # the table for the README
    .venv/bin/python bench/overhead.py --settle 300 --retries 5   # on a shared machine

Results (every raw measurement, medians, ratios) go to `--out`
(default bench/results/overhead.json).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import ddpkit
from ddpkit.examples.seed import dataset as seed_dataset

# Public in torch.distributed, but not re-exported in its type stubs.
TCPStore: Any = dist.TCPStore  # type: ignore[attr-defined]

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "overhead.json"
TARGET_RATIO = 0.98
CONTESTANTS = ("hand", "ddpkit")
_LOOPBACK = "127.0.0.1"


# -- workloads --------------------------------------------------------------------------
@dataclass(frozen=True)
class Workload:
    """One training job; `epochs` sizes a measured run (seconds, not minutes)."""

    name: str
    description: str
    samples: int
    batch_size: int  # per rank
    epochs: int
    lr: float


WORKLOADS: dict[str, Workload] = {
    "seed": Workload(
        "seed", "2,048 (20->1) pairs, Linear(20,1), SGD lr 1e-3", 2048, 32, epochs=40, lr=1e-3
    ),
    "mlp": Workload(
        "mlp",
        "4,096 (512->1) pairs, MLP 512-1024-1024-1 (ReLU), SGD lr 1e-3",
        4096,
        64,
        epochs=3,
        lr=1e-3,
    ),
}
QUICK_EPOCHS = {"seed": 15, "mlp": 1}
MLP_FEATURES, MLP_HIDDEN = 512, 1024


def mlp_dataset(size: int, seed: int = 1234) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(size, MLP_FEATURES, generator=g)
    return TensorDataset(x, x[:, :8].sum(dim=1, keepdim=True) + 0.1 * torch.randn(size, 1))


def load_train_objs(
    workload: Workload,
) -> tuple[Dataset[Any], nn.Module, torch.optim.Optimizer]:
    """The tutorial's `load_train_objs`: the same seeded data and model on every rank."""
    torch.manual_seed(0)
    model: nn.Module
    if workload.name == "seed":
        train_set: Dataset[Any] = seed_dataset(workload.samples)
        model = nn.Linear(20, 1)
    elif workload.name == "mlp":
        train_set = mlp_dataset(workload.samples)
        model = nn.Sequential(
            nn.Linear(MLP_FEATURES, MLP_HIDDEN),
            nn.ReLU(),
            nn.Linear(MLP_HIDDEN, MLP_HIDDEN),
            nn.ReLU(),
            nn.Linear(MLP_HIDDEN, 1),
        )
    else:
        raise ValueError(f"unknown workload {workload.name!r}: pick one of {sorted(WORKLOADS)}")
    optimizer = torch.optim.SGD(model.parameters(), lr=workload.lr)
    return train_set, model, optimizer


def threads_for(world_size: int) -> int:
    """What `ddpkit.launch` gives each rank: a fair share of the usable cores."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, world_size))


def digest(model: nn.Module) -> str:
    """sha256 over the parameters: both contestants must end with the same model."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


@dataclass(frozen=True)
class Measurement:
    """One contestant's run, as rank 0 saw it."""

    samples: int  # global samples trained, all epochs
    train_s: float  # summed time of the epochs' batch loops
    wall_s: float  # the whole fit()/train() call
    samples_per_s: float  # samples / train_s (for ddpkit: FitResult.samples_per_s)
    threads: int
    model_digest: str
    note: str = ""

    @property
    def wall_samples_per_s(self) -> float:
        return self.samples / self.wall_s if self.wall_s else 0.0


# -- contestant 1: the tutorial's multigpu.py, ported to gloo on CPU ---------------------
def ddp_setup(rank: int, world_size: int, store_port: int) -> None:
    # The tutorial sets MASTER_ADDR=localhost, MASTER_PORT=12355 and uses env://; a fixed
    # port collides with any other job, so the parent holds a store on a port the OS
    # picked and every rank joins it.
    store = TCPStore(_LOOPBACK, store_port, world_size, is_master=False)
    init_process_group(backend="gloo", store=store, rank=rank, world_size=world_size)


class TutorialTrainer:
    """The tutorial's `Trainer` (device `cpu`, so `DDP(model)` takes no device_ids)."""

    def __init__(
        self,
        model: nn.Module,
        train_data: DataLoader[Any],
        optimizer: torch.optim.Optimizer,
        rank: int,
    ) -> None:
        self.rank = rank
        self.device = torch.device("cpu")
        self.model = DDP(model.to(self.device))
        self.train_data = train_data
        self.optimizer = optimizer

    def _run_batch(self, source: torch.Tensor, targets: torch.Tensor) -> None:
        self.optimizer.zero_grad()
        output = self.model(source)
        loss = F.mse_loss(output, targets)
        loss.backward()  # type: ignore[no-untyped-call]
        self.optimizer.step()

    def _run_epoch(self, epoch: int) -> float:
        sampler = self.train_data.sampler
        assert isinstance(sampler, DistributedSampler)
        sampler.set_epoch(epoch)
        start = time.perf_counter()  # timed like ddpkit's Trainer: the batch loop only
        for source, targets in self.train_data:
            source = source.to(self.device)
            targets = targets.to(self.device)
            self._run_batch(source, targets)
        return time.perf_counter() - start

    def train(self, max_epochs: int) -> float:
        train_s = 0.0
        for epoch in range(max_epochs):
            train_s += self._run_epoch(epoch)
        return train_s


def prepare_dataloader(dataset: Dataset[Any], batch_size: int) -> DataLoader[Any]:
    return DataLoader(
        dataset,
        batch_size=batch_size,
        pin_memory=False,  # the tutorial pins for its GPU; torch ignores it on CPU anyway
        shuffle=False,
        sampler=DistributedSampler(dataset),
    )


def hand_main(rank: int, world_size: int, workload: Workload, store_port: int, out: str) -> None:
    """The tutorial's `main(rank, world_size, ...)`; rank 0 writes its measurement."""
    if "OMP_NUM_THREADS" not in os.environ:  # as ddpkit.launch does
        torch.set_num_threads(threads_for(world_size))
    ddp_setup(rank, world_size, store_port)
    try:
        dataset, model, optimizer = load_train_objs(workload)
        train_data = prepare_dataloader(dataset, workload.batch_size)
        trainer = TutorialTrainer(model, train_data, optimizer, rank)
        start = time.perf_counter()
        train_s = trainer.train(workload.epochs)
        wall_s = time.perf_counter() - start
        if rank == 0:
            samples = len(train_data.sampler) * world_size * workload.epochs  # type: ignore[arg-type]
            m = Measurement(
                samples,
                train_s,
                wall_s,
                samples / train_s,
                torch.get_num_threads(),
                digest(trainer.model.module),
            )
            Path(out).write_text(json.dumps(asdict(m)))
    finally:
        destroy_process_group()


def run_hand(workload: Workload, nprocs: int) -> Measurement:
    store = TCPStore(_LOOPBACK, 0, nprocs, is_master=True, wait_for_workers=False)
    try:
        with tempfile.TemporaryDirectory(prefix="ddpkit-bench-") as tmp:
            out = Path(tmp, "rank0.json")
            try:
                mp.spawn(  # type: ignore[attr-defined,no-untyped-call]
                    hand_main, args=(nprocs, workload, store.port, str(out)), nprocs=nprocs
                )
            except Exception as exc:
                if not out.exists():
                    raise
                # Training finished and was measured; a rank died on the way out (gloo
                # can abort at interpreter exit): keep the measurement, note the crash.
                note = f"crashed after training: {type(exc).__name__}: {exc}"
                return replace(Measurement(**json.loads(out.read_text())), note=note)
            return Measurement(**json.loads(out.read_text()))
    finally:
        del store


# -- contestant 2: ddpkit ---------------------------------------------------------------
def ddpkit_worker(ctx: ddpkit.DistContext, workload: Workload) -> Measurement:
    dataset, model, optimizer = load_train_objs(workload)
    config = ddpkit.TrainConfig(
        epochs=workload.epochs, batch_size=workload.batch_size, progress=False
    )
    trainer = ddpkit.Trainer(
        model, optimizer, dataset, ctx, config, loss_fn=F.mse_loss, log_fn=lambda s: None
    )
    start = time.perf_counter()
    result = trainer.fit()
    wall_s = time.perf_counter() - start
    samples = len(trainer.train_loader.sampler) * ctx.world_size * workload.epochs  # type: ignore[arg-type]
    rate = result.samples_per_s
    return Measurement(
        samples,
        samples / rate if rate else 0.0,
        wall_s,
        rate,
        torch.get_num_threads(),
        digest(ddpkit.unwrap(trainer.model)),
    )


def run_ddpkit(workload: Workload, nprocs: int) -> Measurement:
    return ddpkit.launch(ddpkit_worker, workload, nprocs=nprocs, backend="gloo")


RUNNERS: dict[str, Callable[[Workload, int], Measurement]] = {
    "hand": run_hand,
    "ddpkit": run_ddpkit,
}


# -- other load on the machine ----------------------------------------------------------
BUSY_LIMIT = 0.10  # a run is "contended" when other processes used more of the machine


def _machine_busy_s() -> float | None:
    """CPU seconds every process of the machine has used since boot (Linux only)."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    # user nice system idle iowait irq softirq steal ...: all but idle and iowait
    return (sum(ticks[:3]) + sum(ticks[5:8])) / os.sysconf("SC_CLK_TCK")


def _own_busy_s() -> float:
    """CPU seconds of this process and of its finished (reaped) children."""
    me, kids = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


class LoadMeter:
    """The share of the machine's CPU that *other* processes used since `start()`:
    benchmarks on a shared machine are only as good as this number is small."""

    def __init__(self) -> None:
        self.start()

    def start(self) -> None:
        self._t, self._busy, self._own = time.perf_counter(), _machine_busy_s(), _own_busy_s()

    def foreign(self) -> float | None:
        busy = _machine_busy_s()
        if busy is None or self._busy is None:
            return None
        seconds = (time.perf_counter() - self._t) * threads_for(1)
        other = (busy - self._busy) - (_own_busy_s() - self._own)
        return max(0.0, other) / seconds if seconds > 0 else None


def settle(max_s: float, say: Callable[[str], None]) -> None:
    """Wait (at most `max_s`) until other processes leave the CPUs nearly idle."""
    deadline = time.monotonic() + max_s
    meter, told = LoadMeter(), False
    while time.monotonic() < deadline:
        meter.start()
        time.sleep(1.0)
        load = meter.foreign()
        if load is None or load < BUSY_LIMIT:
            return
        if not told:
            say(f"  waiting for other processes to leave the CPUs ({load:.0%} busy)...")
            told = True


# -- the benchmark ----------------------------------------------------------------------
def run_one(
    contestant: str, workload: Workload, nprocs: int, say: Callable[[str], None], tries: int = 3
) -> tuple[Measurement, list[str]]:
    """One run; a run whose processes crash is tried again (the errors are kept)."""
    failures: list[str] = []
    while True:
        try:
            return RUNNERS[contestant](workload, nprocs), failures
        except Exception as exc:  # a crashed worker: mp.spawn's or ddpkit's error
            failures.append(f"{type(exc).__name__}: {exc}")
            if len(failures) >= tries:
                raise
            say(f"  {contestant} run failed ({failures[-1]}): trying again")


def run_pair(
    workload: Workload, nprocs: int, repeat: int, meter: LoadMeter, say: Callable[[str], None]
) -> list[dict[str, Any]]:
    """The hand-written run, then the ddpkit run, of one cell."""
    pair = []
    for contestant in CONTESTANTS:
        meter.start()
        began = time.perf_counter()
        m, failures = run_one(contestant, workload, nprocs, say)
        foreign = meter.foreign()
        elapsed = time.perf_counter() - began
        pair.append(
            {
                "workload": workload.name,
                "nprocs": nprocs,
                "repeat": repeat,
                "contestant": contestant,
                **asdict(m),
                "wall_samples_per_s": m.wall_samples_per_s,
                "foreign_load": foreign,
                "failures": failures,
                "elapsed_s": elapsed,  # the whole run: start-up, training, teardown
            }
        )
        busy = "" if foreign is None else f", other load {foreign:.0%}"
        say(
            f"  [{repeat + 1}] {workload.name:<5} nproc {nprocs} {contestant:<6} "
            f"{m.samples_per_s:>10,.0f} samples/s "
            f"(train {m.train_s:.2f}s, {m.threads} thread(s){busy})"
            + (f" [{m.note}]" if m.note else "")
        )
    return pair


def run_all(
    workloads: Sequence[Workload],
    nprocs_list: Sequence[int],
    repeats: int,
    say: Callable[[str], None],
    settle_s: float = 0.0,
    retries: int = 2,
) -> list[dict[str, Any]]:
    """Every (workload, nprocs) cell `repeats` times; contestants alternate within a
    cell and repeats are spread over the whole run, so slow drift hits both alike.

    With `settle_s`, each pair first waits for a quiet machine, and a pair during which
    other processes took the CPUs is run again (at most `retries` times); the runs it
    replaces stay in the output with `kept: false`.
    """
    runs: list[dict[str, Any]] = []
    meter = LoadMeter()
    for repeat in range(repeats):
        for workload in workloads:
            for nprocs in nprocs_list:
                attempts = 1 + (retries if settle_s > 0 else 0)
                for attempt in range(attempts):
                    if settle_s > 0:
                        settle(settle_s, say)
                    pair = run_pair(workload, nprocs, repeat, meter, say)
                    clean = not any(_contended(r) for r in pair)
                    last = clean or attempt == attempts - 1
                    runs += [{**r, "attempt": attempt, "kept": last} for r in pair]
                    if last:
                        break
                    say("  (other processes took the CPUs during that pair: running it again)")
    return runs


def _cell(runs: list[dict[str, Any]], name: str, nprocs: int, contestant: str) -> list[Any]:
    """The kept runs of one contestant in one cell, in run order."""
    return [
        r
        for r in runs
        if r.get("kept", True)
        and (r["workload"], r["nprocs"], r["contestant"]) == (name, nprocs, contestant)
    ]


def _contended(run: dict[str, Any]) -> bool:
    return (run.get("foreign_load") or 0.0) >= BUSY_LIMIT


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per cell: every rate, the medians, the ratio of medians (the headline), the
    median of the paired ratios (each ddpkit run over the hand-written run just before
    it), the same ratio for the whole-call wall time, and whether the models agree."""
    rows: list[dict[str, Any]] = []
    for name, nprocs in dict.fromkeys((r["workload"], r["nprocs"]) for r in runs):
        hand, ours = _cell(runs, name, nprocs, "hand"), _cell(runs, name, nprocs, "ddpkit")
        hand_rates = [float(r["samples_per_s"]) for r in hand]
        ours_rates = [float(r["samples_per_s"]) for r in ours]
        hand_med, ours_med = statistics.median(hand_rates), statistics.median(ours_rates)
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
                "contended_runs": sum(_contended(r) for r in hand + ours),
                "meets_target": ours_med / hand_med >= TARGET_RATIO,
            }
        )
    return rows


def header(meta: dict[str, Any]) -> str:
    return (
        f"ddpkit overhead benchmark, {meta['date']}: torch {meta['torch']}, "
        f"python {meta['python']}, {meta['cpu_count']} CPU(s), "
        f"load average at start {meta['loadavg_start']:.2f}; "
        f"median of {meta['repeats']} run(s) per cell"
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
        ]
        for r in rows
    ]
    if markdown:
        lines = [
            "| " + " | ".join(head) + " |",
            "|" + "|".join(["---"] + ["--:"] * (len(head) - 1)) + "|",
        ]
        lines += ["| " + " | ".join(row) + " |" for row in body]
        return "\n".join(lines)
    widths = [max(len(x) for x in col) for col in zip(head, *body, strict=True)]

    def fmt(row: list[str]) -> str:
        return "  ".join(
            cell.ljust(w) if i == 0 else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        )

    return "\n".join([fmt(head), "  ".join("-" * w for w in widths), *map(fmt, body)])


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="bench/overhead.py",
        description="ddpkit's Trainer vs. the DDP tutorial's hand-written loop (gloo, CPU).",
    )
    p.add_argument("--repeats", type=int, default=7, help="runs per cell (default 7)")
    p.add_argument("--nprocs", default="1,2", help="process counts, comma-separated (default 1,2)")
    p.add_argument(
        "--workloads", default="seed,mlp", help=f"comma-separated, of {', '.join(WORKLOADS)}"
    )
    p.add_argument(
        "--quick", action="store_true", help="a smoke run: 1 repeat of short runs (~30 s)"
    )
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON file (default %(default)s)")
    p.add_argument("--markdown", action="store_true", help="print the table as markdown")
    p.add_argument(
        "--settle",
        type=float,
        default=0.0,
        metavar="S",
        help="before each pair, wait up to S seconds for other processes to leave the CPUs "
        "(for shared machines; default 0: don't wait)",
    )
    p.add_argument(
        "--retries",
        type=int,
        default=2,
        metavar="N",
        help="with --settle, run a pair again (at most N times) when other processes took "
        "the CPUs during it (default 2)",
    )
    args = p.parse_args(argv)
    try:
        args.nprocs = [int(n) for n in args.nprocs.split(",")]
    except ValueError:
        p.error(f"--nprocs takes integers like 1,2 (got {args.nprocs!r})")
    names = [w for w in args.workloads.split(",") if w]
    unknown = [w for w in names if w not in WORKLOADS]
    if unknown or not names:
        p.error(f"unknown workload(s) {unknown}: pick from {', '.join(WORKLOADS)}")
    if args.repeats < 1 or min(args.nprocs) < 1 or args.retries < 0 or args.settle < 0:
        p.error("--repeats and --nprocs must be >= 1, --retries and --settle >= 0")
    args.workloads = names
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
    runs = run_all(workloads, args.nprocs, args.repeats, say, args.settle, args.retries)
    rows = summarize(runs)
    meta["loadavg_end"] = os.getloadavg()[0]
    meta["elapsed_s"] = round(time.perf_counter() - start, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "rows": rows, "runs": runs}, indent=2) + "\n")
    print(header(meta))
    print(table(rows, args.markdown))
    kept = [r for r in runs if r["kept"]]
    contended = sum(_contended(r) for r in kept)
    if contended:
        say(
            f"warning: in {contended} of {len(kept)} runs other processes used more than "
            f"{BUSY_LIMIT:.0%} of the CPUs (see foreign_load in the JSON): the numbers are "
            "noisy; rerun on a quiet machine, or with --settle 60"
        )
    say(f"wrote {args.out} ({meta['elapsed_s']}s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

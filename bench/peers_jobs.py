"""The contestants of `peers.py`: one job trained four ways, each the way its docs say.

- `hand`: the PyTorch DDP tutorial's loop (`tutorial.py`: `DistributedSampler` +
  `set_epoch`, `DDP(model)`), on gloo.
- `ddpkit`: `ddpkit.Trainer(...).fit()`; on the cnn row with `sync_batchnorm=False`,
  like the others (torch's SyncBatchNorm refuses CPU tensors, so they keep per-rank
  BatchNorm); `ddpkit+syncbn` is ddpkit's default, synchronised BatchNorm.
- `accelerate`: `Accelerator(cpu=True)`, `accelerator.prepare(model, optimizer,
  loader)`, `accelerator.backward(loss)` (HuggingFace's quick tour). `cpu=True` is what
  makes Accelerate run distributed on a machine without a GPU: without it, it sees
  `LOCAL_RANK` but no accelerator and trains every rank alone (no gradient sync).
- `fabric`: `Fabric(accelerator="cpu", devices=N, strategy="ddp")` (one device:
  `strategy="auto"`), `fabric.launch()`, `fabric.setup(model, optimizer)`,
  `fabric.setup_dataloaders(loader)`, `fabric.backward(loss)` (Lightning's docs).
- `floor` (start-up launches only): one process alone, no launcher and no process
  group, the least work any rank does before its first step.

Every contestant trains the same model from the same seed with the same per-rank batch
size, and is timed the same way: the summed time of the epochs' batch loops; beside it,
the whole training call (`wall_s`: `fit()`, `train()`, the loop) and the set-up before it
(`setup_s`: data, model, optimizer, wrapping; not the processes or their group). Where a
workload names a `checkpoint_dir`, `hand` saves the tutorial's checkpoint after each
epoch and `ddpkit` is given the folder (`TrainConfig(checkpoint_dir=...)`).

Run as a script, this module is what one start-up launch of `peers.py` runs, started
the way each contestant's docs start a job (the parent times it from just before it
starts the command):

    python bench/peers_jobs.py hand|ddpkit|ddpkit+syncbn|fabric|floor WORKLOAD NPROCS OUTDIR EPOCHS
        [--samples N] [--checkpoint]
    accelerate launch --multi_gpu --num_processes 2 bench/peers_jobs.py accelerate ...

Each rank writes OUTDIR/rank<R>.json: the wall-clock time of its first optimizer step,
its peak resident memory (`ru_maxrss`) after training, the world size it saw, and how
long its set-up and its training call took. `--samples` sizes the dataset (default:
the workload's); `--checkpoint` checkpoints after each epoch into OUTDIR/checkpoints.
It imports only what its contestant needs, so import time is counted fairly.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from tutorial import (
    WORKLOADS,
    TutorialTrainer,
    Workload,
    ddp_setup,
    digest,
    load_train_objs,
    loopback_store,
    loss_fn,
    prepare_dataloader,
    threads_for,
)

CPU = torch.device("cpu")
# Called once, right after the first optimizer step (start-up launches only).
FirstStep = Callable[[], None]


@dataclass(frozen=True)
class Run:
    """One contestant's training run, as this rank saw it."""

    contestant: str
    round: int
    samples: int  # global samples trained, all epochs
    train_s: float  # summed time of the epochs' batch loops
    wall_s: float  # the whole training call, set-up excluded
    model_digest: str
    world_size: int  # as the contestant's framework reports it
    ddp: bool  # the model it trained was wrapped in DistributedDataParallel
    cpu_s: float = 0.0  # CPU time of this process (all its threads) over the same span
    setup_s: float = 0.0  # data, model, optimizer and wrapping, before the training call

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.train_s if self.train_s else 0.0

    def record(self) -> dict[str, Any]:
        """The run as JSON, with its rates."""
        wall_rate = self.samples / self.wall_s if self.wall_s else 0.0
        return {
            **asdict(self),
            "cpu_us_per_sample": self.cpu_s / self.samples * 1e6 if self.samples else None,
            "samples_per_s": self.samples_per_s,
            "wall_samples_per_s": wall_rate,
        }


Train = Callable[[Workload, int, int, FirstStep | None], Run]


def _on_first_step(optimizer: torch.optim.Optimizer, first_step: FirstStep | None) -> None:
    """Call `first_step` after the optimizer's first step. A hook on the bare torch
    optimizer fires under every wrapper (Accelerate's, Fabric's) alike."""
    if first_step is None:
        return

    def hook(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        handle.remove()
        first_step()

    handle = optimizer.register_step_post_hook(hook)


def _has_ddp(model: nn.Module) -> bool:
    return any(isinstance(m, DDP) for m in model.modules())


def train_hand(
    workload: Workload, world_size: int, round: int = 0, first_step: FirstStep | None = None
) -> Run:
    """The tutorial's `main`, after its `ddp_setup` (on the GPU of its rank under nccl)."""
    setup = time.perf_counter()
    rank = dist.get_rank()
    device = torch.device("cuda", rank) if dist.get_backend() == "nccl" else CPU
    dataset, model, optimizer = load_train_objs(workload)
    _on_first_step(optimizer, first_step)
    train_data = prepare_dataloader(dataset, workload.batch_size, pin=device.type == "cuda")
    folder = workload.checkpoint_dir
    checkpoint = None if folder is None else Path(folder, "checkpoint.pt")
    trainer = TutorialTrainer(
        model, train_data, optimizer, rank, device, loss_fn(workload), checkpoint
    )
    start, cpu = time.perf_counter(), time.process_time()
    train_s = trainer.train(workload.epochs)
    wall_s, cpu_s = time.perf_counter() - start, time.process_time() - cpu
    samples = len(train_data.sampler) * world_size * workload.epochs  # type: ignore[arg-type]
    ddp = _has_ddp(trainer.model)
    return Run(
        "hand",
        round,
        samples,
        train_s,
        wall_s,
        digest(model),
        world_size,
        ddp,
        cpu_s,
        setup_s=start - setup,
    )


def _train_ddpkit(
    workload: Workload,
    round: int,
    first_step: FirstStep | None,
    sync_batchnorm: bool,
    grad_compression: str = "none",
) -> Run:
    import ddpkit

    setup = time.perf_counter()
    ctx = ddpkit.DistContext.current()
    dataset, model, optimizer = load_train_objs(workload)
    _on_first_step(optimizer, first_step)
    config = ddpkit.TrainConfig(
        epochs=workload.epochs,
        batch_size=workload.batch_size,
        sync_batchnorm=sync_batchnorm,
        grad_compression=grad_compression,  # type: ignore[arg-type]
        checkpoint_dir=workload.checkpoint_dir,  # save_every=1: after each epoch
        progress=False,
    )
    trainer = ddpkit.Trainer(
        model, optimizer, dataset, ctx, config, loss_fn=loss_fn(workload), log_fn=_quiet
    )
    start, cpu = time.perf_counter(), time.process_time()
    result = trainer.fit()
    wall_s, cpu_s = time.perf_counter() - start, time.process_time() - cpu
    samples = len(trainer.train_loader.sampler) * ctx.world_size * workload.epochs  # type: ignore[arg-type]
    train_s = samples / result.samples_per_s if result.samples_per_s else 0.0
    name = (
        "ddpkit+syncbn"
        if sync_batchnorm
        else "ddpkit+bf16"
        if grad_compression != "none"
        else "ddpkit"
    )
    bare, ddp = ddpkit.unwrap(trainer.model), _has_ddp(trainer.model)
    return Run(
        name,
        round,
        samples,
        train_s,
        wall_s,
        digest(bare),
        ctx.world_size,
        ddp,
        cpu_s,
        setup_s=start - setup,
    )


def train_ddpkit(
    workload: Workload, world_size: int, round: int = 0, first_step: FirstStep | None = None
) -> Run:
    """Like-for-like: per-rank BatchNorm, as the other contestants have on CPU."""
    return _train_ddpkit(workload, round, first_step, sync_batchnorm=False)


def train_ddpkit_syncbn(
    workload: Workload, world_size: int, round: int = 0, first_step: FirstStep | None = None
) -> Run:
    """ddpkit's default: BatchNorm synchronised over the ranks (ddpkit's CPU kernel)."""
    return _train_ddpkit(workload, round, first_step, sync_batchnorm=True)


def train_ddpkit_bf16(
    workload: Workload, world_size: int, round: int = 0, first_step: FirstStep | None = None
) -> Run:
    """ddpkit with gradients all-reduced in bfloat16 (`grad_compression="bf16"`)."""
    return _train_ddpkit(workload, round, first_step, sync_batchnorm=False, grad_compression="bf16")


def train_accelerate(
    workload: Workload, world_size: int, round: int = 0, first_step: FirstStep | None = None
) -> Run:
    from accelerate import Accelerator

    threads = torch.get_num_threads()  # what the launch gives every contestant's ranks
    accelerator = Accelerator(cpu=True)
    # Accelerate sets its own thread count (physical cores // ranks) the first time;
    # every contestant gets the same share instead.
    torch.set_num_threads(threads)
    dataset, model, optimizer = load_train_objs(workload)
    _on_first_step(optimizer, first_step)
    bare = model
    loader = DataLoader(dataset, batch_size=workload.batch_size, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    criterion = loss_fn(workload)
    train_s = 0.0
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(workload.epochs):
        t = time.perf_counter()
        for inputs, targets in loader:
            optimizer.zero_grad()
            loss = criterion(model(inputs), targets)
            accelerator.backward(loss)
            optimizer.step()
        train_s += time.perf_counter() - t
    wall_s, cpu_s = time.perf_counter() - start, time.process_time() - cpu
    world = accelerator.num_processes
    samples = len(loader) * workload.batch_size * world * workload.epochs
    ddp = _has_ddp(model)
    return Run("accelerate", round, samples, train_s, wall_s, digest(bare), world, ddp, cpu_s)


def train_fabric(
    workload: Workload, world_size: int, round: int = 0, first_step: FirstStep | None = None
) -> Run:
    from lightning_fabric import Fabric

    threads = torch.get_num_threads()  # what the launch gives every contestant's ranks
    strategy = "ddp" if world_size > 1 else "auto"
    fabric = Fabric(accelerator="cpu", devices=world_size, strategy=strategy)
    fabric.launch()  # from a plain `python` command this starts the other ranks
    torch.set_num_threads(threads)  # Fabric may set its own share the first time
    dataset, model, optimizer = load_train_objs(workload)
    _on_first_step(optimizer, first_step)
    bare = model
    model, optimizer = fabric.setup(model, optimizer)
    loader = fabric.setup_dataloaders(
        DataLoader(dataset, batch_size=workload.batch_size, shuffle=True)
    )
    criterion = loss_fn(workload)
    train_s = 0.0
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(workload.epochs):
        t = time.perf_counter()
        for inputs, targets in loader:
            optimizer.zero_grad()
            loss = criterion(model(inputs), targets)
            fabric.backward(loss)
            optimizer.step()
        train_s += time.perf_counter() - t
    wall_s, cpu_s = time.perf_counter() - start, time.process_time() - cpu
    world = fabric.world_size
    samples = len(loader) * workload.batch_size * world * workload.epochs
    ddp = _has_ddp(model)
    return Run("fabric", round, samples, train_s, wall_s, digest(bare), world, ddp, cpu_s)


def train_floor(
    workload: Workload, world_size: int, round: int = 0, first_step: FirstStep | None = None
) -> Run:
    """The least any rank does before its first step, whoever launched it: this process
    alone, with no launcher and no process group, builds the job and trains one rank's
    share of the samples (1/`world_size`) with the hand-written loop's steps. Its time to
    first step is the floor of every contestant's: one interpreter's imports (torch, then
    `torch._dynamo`, which the optimizer's constructor loads), the objects, one step."""
    dataset, model, optimizer = load_train_objs(workload)
    _on_first_step(optimizer, first_step)
    share = Subset(dataset, range(len(dataset) // world_size))  # type: ignore[arg-type]
    loader = DataLoader(share, batch_size=workload.batch_size, shuffle=False)
    criterion = loss_fn(workload)
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(workload.epochs):
        for inputs, targets in loader:
            optimizer.zero_grad()
            criterion(model(inputs), targets).backward()
            optimizer.step()
    wall_s, cpu_s = time.perf_counter() - start, time.process_time() - cpu
    samples = len(share) * workload.epochs
    return Run("floor", round, samples, wall_s, wall_s, digest(model), 1, False, cpu_s)


TRAIN: dict[str, Train] = {
    "hand": train_hand,
    "ddpkit": train_ddpkit,
    "accelerate": train_accelerate,
    "fabric": train_fabric,
    "ddpkit+syncbn": train_ddpkit_syncbn,
    "ddpkit+bf16": train_ddpkit_bf16,
    "floor": train_floor,
}


def _quiet(text: str) -> None:
    """ddpkit's per-epoch line; the others print nothing either."""


def quiet_peers() -> None:
    """Accelerate and Fabric warn about thread counts and loader workers on CPU."""
    warnings.filterwarnings("ignore", module=r"(accelerate|lightning_fabric|lightning)\b")
    warnings.filterwarnings("ignore", message=r".*(num_workers|OMP_NUM_THREADS).*")


# -- one start-up launch (the script) ---------------------------------------------------
def _report(out: Path, first_step_at: float | None, run: Run, rank: int) -> None:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    record = {
        "rank": rank,
        "world_size": run.world_size,
        "first_step_at": first_step_at,
        "max_rss_kb": usage.ru_maxrss,  # kilobytes on Linux
        "pid": os.getpid(),
        "setup_s": run.setup_s,
        "fit_s": run.wall_s,  # the training call, checkpoints included
        "train_s": run.train_s,
        "model_digest": run.model_digest,
    }
    (out / f"rank{rank}.json").write_text(json.dumps(record))


def _timed(contestant: str, workload: Workload, world_size: int, out: Path) -> None:
    """Train with a clock on the first step, then write this rank's record."""
    torch.set_num_threads(threads_for(world_size))  # every contestant alike
    first: list[float] = []
    run = TRAIN[contestant](workload, world_size, 0, lambda: first.append(time.time()))
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    _report(out, first[0] if first else None, run, rank)


def _hand_rank(rank: int, world_size: int, workload: Workload, port: int, out: str) -> None:
    """The tutorial's `main(rank, world_size, ...)`, run by `mp.spawn`."""
    ddp_setup(rank, world_size, port)
    try:
        _timed("hand", workload, world_size, Path(out))
    finally:
        dist.destroy_process_group()


def _ddpkit_rank(ctx: Any, contestant: str, workload: Workload, out: str) -> None:
    _timed(contestant, workload, ctx.world_size, Path(out))


def start(contestant: str, workload: Workload, nprocs: int, out: Path) -> None:
    """One job, started the way the contestant's docs start one."""
    if contestant == "hand":
        import torch.multiprocessing as mp

        store = loopback_store(nprocs)
        args = (nprocs, workload, store.port, str(out))
        mp.spawn(_hand_rank, args=args, nprocs=nprocs)  # type: ignore[attr-defined,no-untyped-call]
    elif contestant.startswith("ddpkit"):
        import ddpkit

        ddpkit.launch(_ddpkit_rank, contestant, workload, str(out), nprocs=nprocs)
    else:  # accelerate (under `accelerate launch`), fabric (which launches itself), floor
        quiet_peers()
        _timed(contestant, workload, nprocs, out)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="peers_jobs.py", description="one launch of peers.py")
    p.add_argument("contestant", choices=list(TRAIN))
    p.add_argument("workload", choices=list(WORKLOADS))
    p.add_argument("nprocs", type=int)
    p.add_argument("out", type=Path, help="the folder each rank writes rank<R>.json to")
    p.add_argument("epochs", type=int)
    p.add_argument("--samples", type=int, help="dataset size (default: the workload's)")
    p.add_argument("--checkpoint", action="store_true", help="checkpoint after each epoch")
    args = p.parse_args(argv)
    workload = replace(WORKLOADS[args.workload], epochs=args.epochs)
    if args.samples is not None:
        workload = replace(workload, samples=args.samples)
    if args.checkpoint:
        folder = args.out / "checkpoints"
        folder.mkdir(parents=True, exist_ok=True)  # the tutorial's torch.save needs it
        workload = replace(workload, checkpoint_dir=str(folder))
    start(args.contestant, workload, args.nprocs, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

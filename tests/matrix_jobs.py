"""The jobs of the strategy x feature matrix (tests/test_matrix.py, issue 26).

One small job (an MLP with dropout, AdamW, a StepLR stepped per optimizer step, 2 epochs
of 48 samples in batches of 4), changed in one way per feature. `run_cell` runs it on
every rank, as `launch` calls it, in one of two phases:

- "straight": trains 2 epochs and checkpoints once mid-epoch on the way (from a callback,
  after the second epoch's last optimizer step but one: with uneven shards the shorter
  one has run out by then; the `save_every_steps` cell uses its own checkpoints, the
  hand loop `save_state`);
- "resume": resumes from the checkpoint the test copied to `FOLDER/ckpt-resume` and
  trains to the end.

At the end every rank writes what it holds (parameters, buffers, optimizer, scheduler,
its random streams; FSDP's shards gathered whole, a collective every rank calls) to
`FOLDER/PHASE-rankR.pt`. After a barrier rank 0 compares the ranks with each other and,
when resuming, each rank with the same rank of the straight run, and returns the
differences as text: the test process itself runs no torch op (so that `launch` keeps
forking its workers).

The "indexed" job (not a matrix feature) returns each sample's index in its batch and
records, per rank, which indices each optimizer step trained, for the cells that resume
on another number of ranks.
"""

from __future__ import annotations

import functools
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset, IterableDataset, Sampler

import ddpkit
from ddpkit.seed import rank_seed, rng_state
from ddpkit.verification.runs import leaves, same, whole

SEED = 7
SAMPLES = 48  # per epoch: 6 batches of 4 per rank on 2 ranks, 12 on one
BATCH = 4
EPOCHS = 2
EVAL_SAMPLES = 9  # batches of 4: rank 0 gets 5 samples (2 batches), rank 1 gets 4 (1)
SAVE_EVERY_STEPS = 4  # the save_every_steps cell: mid-epoch checkpoints at 8 (2 ranks), 20 (1)
VERIFY_STEPS = 4  # optimizer steps of each `ddpkit verify` run (the resume check cuts at 3)

# strategy -> (processes, TrainConfig.strategy)
STRATEGIES: dict[str, tuple[int, str]] = {
    "single": (1, "ddp"),
    "ddp": (2, "ddp"),
    "fsdp": (2, "fsdp"),
}

FEATURES = (
    "run_log",  # run_dir, progress bar, a step line every step
    "eval_uneven",  # an eval set of 9 samples in batches of 4: ranks get 2 and 1 batches
    "accumulate",  # 3 micro-batches per optimizer step
    "uneven_map",  # a train_sampler that shards itself unevenly (20 and 28 samples)
    "uneven_accumulate",  # the same uneven train_sampler, with 3 micro-batches per step
    "uneven_iterable",  # an IterableDataset that yields 20 samples on rank 0, 28 on rank 1
    "dict_batches",  # {"x", "labels"} batches, model(**batch) returns {"loss", "logits"}
    "bf16",  # precision="bf16"
    "clip",  # clip_grad_norm=0.5
    "save_every_steps",  # checkpoints every 4 steps; the resume starts from one of them
    "batchnorm_nosync",  # a BatchNorm model, sync_batchnorm=False
    "workers_augment",  # num_workers=2, torch.rand noise added in __getitem__
    "hand_loop",  # no Trainer: accumulate, Precision("bf16"), clipping, save_state/load_state
    # Trained by steps: max_steps ends inside the third epoch (no epochs given), draws
    # with replacement, an evaluation every 2 steps that keeps the best checkpoint.
    "by_steps",
)


# -- data ---------------------------------------------------------------------------------
def _table(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    labels = (x[:, 0] + x[:, 1] > 0).long() + (x[:, 2] > 0.5).long()  # 3 classes
    return x, labels


class Samples(Dataset[Any]):
    """`(x, label)` pairs; or dicts `{"x", "labels"}`; or `(x, label, index)` triples;
    `augment` adds uniform noise drawn at each fetch from the fetching process's stream."""

    def __init__(
        self, n: int = SAMPLES, *, seed: int = 1, kind: str = "pair", augment: bool = False
    ) -> None:
        self.x, self.labels = _table(n, seed)
        self.kind, self.augment = kind, augment

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> Any:
        x = self.x[i]
        if self.augment:
            x = x + 0.1 * torch.rand(8)
        if self.kind == "dict":
            return {"x": x, "labels": self.labels[i]}
        if self.kind == "indexed":
            return x, self.labels[i], i
        return x, self.labels[i]


def uneven_split(n: int, rank: int, world_size: int) -> tuple[int, int]:
    """[start, end) of rank's share: every rank but the last 4 samples short of an even
    share, the last the rest (20 and 28 of 48 on 2 ranks; all 48 on one)."""
    short = n // world_size - 4 if world_size > 1 else n
    start = rank * short
    return start, n if rank == world_size - 1 else start + short


class UnevenSampler(Sampler[int]):
    """Shards by itself, unevenly (see `uneven_split`), over a new permutation each epoch."""

    def __init__(self, n: int, rank: int, world_size: int) -> None:
        self.n, self.rank, self.world_size, self.epoch = n, rank, world_size, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        g = torch.Generator().manual_seed(SEED * 1000 + self.epoch)
        order = torch.randperm(self.n, generator=g).tolist()
        start, end = uneven_split(self.n, self.rank, self.world_size)
        return iter(order[start:end])

    def __len__(self) -> int:
        start, end = uneven_split(self.n, self.rank, self.world_size)
        return end - start


class UnevenStream(IterableDataset[Any]):
    """A stream that shards itself unevenly: rank 0 yields 20 samples, rank 1 yields 28."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.data = Samples()
        self.range = range(*uneven_split(len(self.data), rank, world_size))

    def __iter__(self) -> Iterator[Any]:
        return (self.data[i] for i in self.range)


# -- the model ----------------------------------------------------------------------------
class Net(nn.Module):
    """8 -> 16 (-> BatchNorm) -> ReLU -> Dropout -> 3 classes. Given `labels` it returns
    `{"loss", "logits"}`, as a HuggingFace model does."""

    def __init__(self, batchnorm: bool = False) -> None:
        super().__init__()
        norm: nn.Module = nn.BatchNorm1d(16) if batchnorm else nn.Identity()
        self.body = nn.Sequential(nn.Linear(8, 16), norm, nn.ReLU(), nn.Dropout(0.2))
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> Any:
        logits = self.head(self.body(x))
        if labels is None:
            return logits
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)


def step_lr(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.8)


# -- the job and its options, per feature ------------------------------------------------
def build(
    ctx: ddpkit.DistContext, config: ddpkit.TrainConfig, *, feature: str = "plain"
) -> ddpkit.Job:
    """The job of `feature` (a `build(ctx, config)` for `ddpkit.verify` through
    `functools.partial`); its optimizer and scheduler are factories, as FSDP needs."""
    job = ddpkit.Job(
        model=Net(batchnorm=feature == "batchnorm_nosync"),
        optimizer=adamw,
        train_set=Samples(augment=feature == "workers_augment"),
        scheduler=step_lr,
    )
    if feature in ("eval_uneven", "by_steps"):
        job.eval_set = Samples(EVAL_SAMPLES, seed=2)
    elif feature in ("uneven_map", "uneven_accumulate"):
        job.train_sampler = UnevenSampler(SAMPLES, ctx.rank, ctx.world_size)
    elif feature == "uneven_iterable":
        job.train_set = UnevenStream(ctx.rank, ctx.world_size)
    elif feature == "dict_batches":
        job.train_set = Samples(kind="dict")
    return job


def job_for(feature: str) -> Any:
    """`build` for `feature`, as a job reference `ddpkit.verify` can send to its workers."""
    return functools.partial(build, feature=feature)


# The TrainConfig fields each feature sets (the others change the job: see `build`).
FEATURE_OPTIONS: dict[str, dict[str, Any]] = {
    "run_log": {"progress": True, "log_every": 1},
    "accumulate": {"accumulate": 3},
    "uneven_accumulate": {"accumulate": 3},
    "bf16": {"precision": "bf16"},
    "clip": {"clip_grad_norm": 0.5},
    "save_every_steps": {"save_every_steps": SAVE_EVERY_STEPS},
    "batchnorm_nosync": {"sync_batchnorm": False},
    "workers_augment": {"num_workers": 2},
}


def options(strategy: str, feature: str) -> dict[str, Any]:
    """The TrainConfig fields of a cell, without its folders."""
    opts: dict[str, Any] = {
        "epochs": EPOCHS,
        "batch_size": BATCH,
        "seed": SEED,
        "scheduler_interval": "step",
        "strategy": STRATEGIES[strategy][1],
        "progress": False,
    }
    opts.update(FEATURE_OPTIONS.get(feature, {}))
    if feature == "by_steps":
        per_epoch = SAMPLES // (BATCH * STRATEGIES[strategy][0])
        opts.update(
            epochs=None,
            max_steps=EPOCHS * per_epoch + per_epoch // 2,
            eval_every_steps=2,
            keep_best="eval_loss",
            replacement=True,
        )
    return opts


# -- what each rank holds ------------------------------------------------------------------
def _whole(value: Any) -> Any:
    """`value` with every tensor replaced by a CPU copy of all of it (FSDP shards are
    gathered: a collective, so every rank walks the same structure in the same order)."""
    if isinstance(value, torch.Tensor):
        return whole(value)
    if isinstance(value, dict):
        return {k: _whole(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_whole(v) for v in value)
    return value


def held_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any
) -> dict[str, Any]:
    """Parameters and buffers, optimizer and scheduler state, whole; and this rank's RNGs."""
    return {
        "model": _whole(dict(ddpkit.unwrap(model).state_dict())),
        "optimizer": _whole(optimizer.state_dict()),
        "scheduler": None if scheduler is None else _whole(scheduler.state_dict()),
        "rng": rng_state(),
    }


def differences(a: dict[str, Any], b: dict[str, Any], *, rng: bool = True) -> list[str]:
    """The dotted names whose values differ between two `held_state`s (the RNG streams
    left out with `rng=False`: ranks draw streams of their own by design)."""
    if not rng:
        a, b = (
            {k: v for k, v in a.items() if k != "rng"},
            {k: v for k, v in b.items() if k != "rng"},
        )
    left, right = dict(leaves(a)), dict(leaves(b))
    out = [f"{k} (only in one)" for k in sorted(left.keys() ^ right.keys())]
    out += [k for k in left if k in right and not same(left[k], right[k])]
    return out


def _compare(ctx: ddpkit.DistContext, folder: Path, phase: str) -> dict[str, list[str]]:
    """On rank 0 (after every rank wrote its file): how the ranks differ from rank 0, and,
    after a resume, how each rank differs from the same rank of the straight run."""
    ddpkit.barrier()
    if not ctx.is_main:
        return {}
    mine = [torch.load(folder / f"{phase}-rank{r}.pt") for r in range(ctx.world_size)]
    out: dict[str, list[str]] = {"ranks": [], "resume": []}
    for r in range(1, ctx.world_size):
        out["ranks"] += [f"rank {r}: {d}" for d in differences(mine[0], mine[r], rng=False)]
    straight = sorted(folder.glob("straight-rank*.pt"))
    if phase == "resume" and len(straight) == ctx.world_size:
        for r in range(ctx.world_size):
            before = torch.load(folder / f"straight-rank{r}.pt")
            out["resume"] += [f"rank {r}: {d}" for d in differences(before, mine[r])]
    return out


# -- the Trainer cells ---------------------------------------------------------------------
class _Checkpoints(ddpkit.Callback):
    """Saves (if `cut`) after the second epoch's last step but one: mid-epoch, and, with
    uneven shards, after the shorter shard ran out. Records where each checkpoint was
    written: (global step, epoch, batches of it done, path)."""

    def __init__(self, cut: bool) -> None:
        self.cut = cut
        self.per_epoch = 0  # optimizer steps in an epoch, known after the first
        self.written: list[tuple[int, int, int, str]] = []

    def on_epoch_end(self, trainer: ddpkit.Trainer, epoch: int, metrics: dict[str, float]) -> None:
        if epoch == 0:
            self.per_epoch = trainer.global_step

    def on_step_end(self, trainer: ddpkit.Trainer, step: int) -> None:
        if self.cut and trainer.epoch == 1 and step == 2 * self.per_epoch - 1:
            trainer.save()  # every rank, after the same step (a collective)

    def on_checkpoint(self, trainer: ddpkit.Trainer, path: Path) -> None:
        self.written.append((trainer.global_step, trainer.epoch, trainer.batch, str(path)))


class _Indices:
    """A training_step for `(x, label, index)` batches that records, per optimizer step,
    which sample indices this rank trained (not a zero-weighted stand-in batch)."""

    def __init__(self) -> None:
        self.trainer: ddpkit.Trainer | None = None
        self.trained: list[tuple[int, int, list[int]]] = []  # (epoch, steps before, indices)

    def __call__(self, model: nn.Module, batch: Any) -> torch.Tensor:
        x, labels, index = batch
        if model.training and self.trainer is not None:
            t = self.trainer
            self.trained.append((t.epoch, t.global_step, [int(i) for i in index]))
        return nn.functional.cross_entropy(model(x), labels)


def _quiet(_: str) -> None:
    pass


def _trainer_cell(
    ctx: ddpkit.DistContext, strategy: str, feature: str, phase: str, folder: Path
) -> dict[str, Any]:
    resume = phase == "resume"
    opts = options(strategy, feature)
    ckpt = folder / ("ckpt-resume" if resume else "ckpt")
    opts.update(checkpoint_dir=str(ckpt), resume=resume, save_every=0, keep_last=100)
    if feature == "run_log":
        opts["run_dir"] = str(folder / f"run-{phase}")
    config = ddpkit.TrainConfig(**opts)
    ddpkit.seed_everything(config.seed)  # the same model on every rank
    job = build(ctx, config, feature=feature)
    recorder = None
    if feature == "indexed":
        job.train_set = Samples(kind="indexed")
        job.training_step = recorder = _Indices()
    checkpoints = _Checkpoints(cut=not resume and feature != "save_every_steps")
    trainer = job.trainer(ctx, config, callbacks=[checkpoints], log_fn=_quiet)
    if recorder is not None:
        recorder.trainer = trainer
    result = trainer.fit()
    held = held_state(trainer.model, trainer.optimizer, trainer.scheduler)
    torch.save(held, folder / f"{phase}-rank{ctx.rank}.pt")
    if recorder is not None:
        (folder / f"{phase}-indices-rank{ctx.rank}.json").write_text(json.dumps(recorder.trained))
    return {
        "global_step": result.global_step,
        "epochs": result.epochs,
        "checkpoints": checkpoints.written,
        "eval": result.eval,
        "diffs": _compare(ctx, folder, phase),
    }


# -- the hand-written loop -----------------------------------------------------------------
HAND_ACCUMULATE = 2


def _hand_cell(ctx: ddpkit.DistContext, strategy: str, phase: str, folder: Path) -> dict[str, Any]:
    """The tutorial's loop with ddpkit's helpers: `accumulate`, `Precision("bf16")` with
    clipping, and `save_state`/`load_state` (saved after the second epoch's last step but
    one, as the Trainer cells save)."""
    ddpkit.seed_everything(SEED)  # the same model on every rank
    model = ddpkit.prepare_model(Net(), ctx, strategy=STRATEGIES[strategy][1])
    opt = adamw(model.parameters())  # after sharding
    sched = step_lr(opt)
    loader = ddpkit.prepare_loader(Samples(), ctx, batch_size=BATCH, seed=SEED)
    batches = len(loader)  # of an epoch: before a resume makes the loader skip some
    acc = ddpkit.accumulate(model, HAND_ACCUMULATE, batches)
    prec = ddpkit.Precision("bf16", ctx)
    ddpkit.seed_everything(rank_seed(SEED, ctx.rank))  # each rank its own stream
    ckpt = folder / ("ckpt-resume" if phase == "resume" else "ckpt")
    start: dict[str, Any] | None = None
    if phase == "resume":
        start = ddpkit.load_state(
            ckpt, ctx, model=model, optimizer=opt, scheduler=sched, loader=loader
        )
        assert start is not None, f"nothing to resume in {ckpt}"
    start = start or {"epoch": 0, "batch": 0, "step": 0}
    step, written = int(start["step"]), []
    per_epoch = -(-batches // HAND_ACCUMULATE)  # optimizer steps in an epoch
    for epoch in range(int(start["epoch"]), EPOCHS):
        loader.set_epoch(epoch)
        first = int(start["batch"]) if epoch == start["epoch"] else 0
        model.train()
        for i, (x, y) in enumerate(loader, start=first):
            with acc.step(i):
                with prec.autocast():
                    loss = nn.functional.cross_entropy(model(x.to(ctx.device)), y.to(ctx.device))
                prec.backward(loss / acc.group_size(i))
            if not acc.should_step(i):
                continue
            prec.clip_gradients(model, opt, max_norm=0.5)
            prec.step(opt)
            opt.zero_grad(set_to_none=True)
            sched.step()
            step += 1
            if phase == "straight" and step == 2 * per_epoch - 1:
                path = ddpkit.save_state(
                    ckpt,
                    ctx,
                    model=model,
                    optimizer=opt,
                    scheduler=sched,
                    loader=loader,
                    epoch=epoch,
                    batch=i + 1,
                    step=step,
                    keep_last=None,
                )
                written.append((step, epoch, i + 1, str(path)))
    held = held_state(model, opt, sched)
    torch.save(held, folder / f"{phase}-rank{ctx.rank}.pt")
    return {
        "global_step": step,
        "epochs": EPOCHS,
        "checkpoints": written,
        "eval": {},
        "diffs": _compare(ctx, folder, phase),
    }


def run_cell(
    ctx: ddpkit.DistContext, strategy: str, feature: str, phase: str, folder: str
) -> dict[str, Any]:
    """One phase ("straight" or "resume") of one cell, on every rank; see the module."""
    if feature == "hand_loop":
        return _hand_cell(ctx, strategy, phase, Path(folder))
    return _trainer_cell(ctx, strategy, feature, phase, Path(folder))


def copy_checkpoint(path: str, folder: Path) -> None:
    """Put one checkpoint (a `.pt` file or a sharded `.dcp` folder) alone in `folder`."""
    source = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    if source.is_dir():
        shutil.copytree(source, folder / source.name)
    else:
        shutil.copy2(source, folder / source.name)


def verify_cell(strategy: str, feature: str, resume: bool) -> tuple[bool, str]:
    """`ddpkit verify` of a cell's job on 2 ranks (the equivalence with one process, or
    with `resume` the exact resume): whether it passed, and its report."""
    config = ddpkit.TrainConfig(**options(strategy, feature))
    report = ddpkit.verify(job_for(feature), config, nproc=2, steps=VERIFY_STEPS, resume=resume)
    return report.passed, str(report)

"""The jobs of the strategy x feature matrix (tests/test_matrix.py, issues 26 and 43).

One small job (an MLP with dropout, AdamW, a StepLR stepped per optimizer step, 2 epochs
of 48 samples in batches of 4), changed in one way per feature. `run_cell` runs it on
every rank, as `launch` calls it, in one of three phases:

- "straight": trains to the end and checkpoints once mid-epoch on the way (from a
  callback, after the second epoch's last optimizer step but one: with uneven shards
  the shorter one has run out by then; in a run that never ends an epoch, 3 steps before
  its last; the `save_every_steps` cell uses its own checkpoints, the hand loop
  `save_state`);
- "resume": resumes from what the test put in `FOLDER/ckpt-resume` (and in
  `FOLDER/run-resume`) and trains to the end;
- "elsewhere": the same, on another number of ranks or with another batch size.

Every Trainer cell keeps a run log (`FOLDER/run-PHASE`, a step line every step) and, on
rank 0, copies of best.pt as it stood after each checkpoint (`FOLDER/best-after`). Each
sample carries its index (x's 9th column, which the model records and leaves out), so
every rank writes which indices each optimizer step trained to
`FOLDER/PHASE-indices-rankR.json`.

At the end every rank writes what it holds (parameters, buffers, optimizer, scheduler,
its random streams; FSDP's shards gathered whole, a collective every rank calls) to
`FOLDER/PHASE-rankR.pt`. After a barrier rank 0 compares the ranks with each other and,
when resuming, each rank with the same rank of the straight run, and returns the
differences as text: the test process itself runs no torch op (so that `launch` keeps
forking its workers).

A new feature is a name in `FEATURES` and its change to the job in `build` (and its
options in `FEATURE_OPTIONS`).
"""

from __future__ import annotations

import functools
import itertools
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset, RandomSampler, Sampler
from torch.utils.data.distributed import DistributedSampler

import ddpkit
from ddpkit.seed import rank_seed, rng_state
from ddpkit.training.trainer import FitResult
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
    # The features added since (issue 43), each a column of its own:
    "endless_steps",  # max_steps over an IterableDataset that never ends (it shards itself)
    "keep_best",  # keep_best="eval_loss" with an evaluation every step (the cut's too)
    "early_stopping",  # patience 1 on eval_loss, 3 epochs
    "callbacks",  # a user Callback with state; the resume adds another callback before it
    "sampler_subclass",  # a DistributedSampler subclass with its own order (length buckets)
    "random_sampler",  # hand loop: DataLoader(sampler=RandomSampler(num_samples=30, replacement))
    "tuple_targets",  # (x, (label, aux)) batches, a loss_fn of both, an eval set
    "dict_targets",  # (x, {"label", "aux"}) batches, a loss_fn of both, an eval set
    "metrics_fn",  # uneven eval batches and a metrics_fn that runs the model
    "eval_max_batches",  # the metrics_fn cell, evaluating at most 1 batch a rank
    "plateau",  # ReduceLROnPlateau, stepped per epoch
    "profile",  # profile=True (issue 47): each rank's step time, in the run log
    # Pairs ddpkit refuses before training (test_matrix.REFUSED says where):
    "early_stop_no_eval",  # early stopping on eval_loss without an eval set
    "uneven_syncbn",  # BatchNorm synchronised over a sampler that shards unevenly
)
RANDOM_SAMPLES = 30  # the random_sampler cell's epoch: draws over all ranks
# Cut inside the second epoch, except a run that never ends an epoch: `cut_at`.
ENDLESS = ("endless_steps",)


# -- data ---------------------------------------------------------------------------------
def _table(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    labels = (x[:, 0] + x[:, 1] > 0).long() + (x[:, 2] > 0.5).long()  # 3 classes
    return x, labels


class Samples(Dataset[Any]):
    """`(x, label)` pairs; or dicts `{"x", "labels"}`; or `(x, (label, aux))`, or
    `(x, {"label", "aux"})` (`kind` "tuple", "dict_targets"); `augment` adds uniform noise
    drawn at each fetch from the fetching process's stream. x carries the sample's index
    as a 9th column, which `Net` records and leaves out."""

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
        x = torch.cat([x, torch.tensor([float(i)])])
        label, aux = self.labels[i], self.x[i, 3]
        if self.kind == "dict":
            return {"x": x, "labels": label}
        if self.kind == "tuple":
            return x, (label, aux)
        if self.kind == "dict_targets":
            return x, {"label": label, "aux": aux}
        return x, label


class EndlessStream(IterableDataset[Any]):
    """A stream that never ends and shards itself: pass p goes over `Samples` in an
    order drawn from p alone, and rank r takes every W-th sample of it from r."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.data, self.rank, self.world_size = Samples(), rank, world_size

    def __iter__(self) -> Iterator[Any]:
        for p in itertools.count():
            order = torch.randperm(len(self.data), generator=torch.Generator().manual_seed(p))
            for i in order[self.rank :: self.world_size].tolist():
                yield self.data[i]


class LengthBuckets(DistributedSampler[Any]):
    """A DistributedSampler with its own order, as a text job's length buckets: the
    samples sorted by a "length" (here |x_0|), cut in buckets of 8, the buckets in an
    order drawn from seed + epoch; rank r takes every W-th index from r."""

    def __iter__(self) -> Iterator[int]:
        data = cast(Samples, self.dataset)
        by_length = torch.argsort(data.x[:, 0].abs()).tolist()
        buckets = [by_length[i : i + 8] for i in range(0, len(by_length), 8)]
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        order = [i for b in torch.randperm(len(buckets), generator=g).tolist() for i in buckets[b]]
        order += order[: self.total_size - len(order)]
        return iter(order[self.rank : self.total_size : self.num_replicas])


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
# The sample indices this rank's model trained on since the last optimizer step (its
# forwards in training mode: not evaluation, not a stand-in batch of a rank whose uneven
# shard ran out, which ddpkit runs in eval mode). One list per rank process.
TRAINED: list[int] = []


class Net(nn.Module):
    """8 -> 16 (-> BatchNorm) -> ReLU -> Dropout -> 3 classes. Given `labels` it returns
    `{"loss", "logits"}`, as a HuggingFace model does. x's 9th column is the sample's
    index: recorded in `TRAINED` when training, never an input."""

    def __init__(self, batchnorm: bool = False) -> None:
        super().__init__()
        norm: nn.Module = nn.BatchNorm1d(16) if batchnorm else nn.Identity()
        self.body = nn.Sequential(nn.Linear(8, 16), norm, nn.ReLU(), nn.Dropout(0.2))
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> Any:
        if self.training:
            TRAINED.extend(round(i) for i in x[:, 8].tolist())
        logits = self.head(self.body(x[:, :8]))
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
        model=Net(batchnorm=feature in ("batchnorm_nosync", "uneven_syncbn")),
        optimizer=adamw,
        train_set=Samples(augment=feature == "workers_augment"),
        scheduler=step_lr,
    )
    if feature in EVALUATED:
        job.eval_set = Samples(EVAL_SAMPLES, seed=2, kind=TARGETS.get(feature, "pair"))
    if feature in ("uneven_map", "uneven_accumulate", "uneven_syncbn"):
        job.train_sampler = UnevenSampler(SAMPLES, ctx.rank, ctx.world_size)
    elif feature == "uneven_iterable":
        job.train_set = UnevenStream(ctx.rank, ctx.world_size)
    elif feature == "endless_steps":
        job.train_set = EndlessStream(ctx.rank, ctx.world_size)
    elif feature == "dict_batches":
        job.train_set = Samples(kind="dict")
    elif feature in TARGETS:
        job.train_set = Samples(kind=TARGETS[feature])
        job.loss_fn = two_targets
    elif feature == "sampler_subclass":
        job.train_sampler = LengthBuckets(
            job.train_set, num_replicas=ctx.world_size, rank=ctx.rank, seed=config.seed
        )
    elif feature in ("metrics_fn", "eval_max_batches"):
        job.metrics_fn = top2_and_margin
    elif feature == "callbacks":
        job.callbacks = [Tally()]
    elif feature == "plateau":
        job.scheduler = plateau
    return job


# The features whose job has an eval set (9 samples: uneven batches on 2 ranks).
EVALUATED = (
    "eval_uneven",
    "by_steps",
    "endless_steps",
    "keep_best",
    "early_stopping",
    "tuple_targets",
    "dict_targets",
    "metrics_fn",
    "eval_max_batches",
    "plateau",
)
TARGETS = {"tuple_targets": "tuple", "dict_targets": "dict_targets"}  # feature -> Samples kind


def two_targets(logits: torch.Tensor, targets: Any) -> torch.Tensor:
    """Cross-entropy on the label plus a small regression of the aux target, for
    `(label, aux)` or `{"label", "aux"}` targets."""
    label, aux = (targets["label"], targets["aux"]) if isinstance(targets, dict) else targets
    ce = nn.functional.cross_entropy(logits, label)
    return ce + 0.1 * nn.functional.mse_loss(logits[:, 0], aux.to(logits.dtype))


def top2_and_margin(model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
    """Metrics that run the model again (as a user's metrics_fn does): top-2 accuracy
    and the mean margin of the true class over the best other one."""
    x, labels = batch
    logits = model(x)
    top2 = (logits.topk(2, dim=1).indices == labels[:, None]).any(dim=1).float().mean()
    true = logits.gather(1, labels[:, None]).squeeze(1)
    others = logits.scatter(1, labels[:, None], float("-inf")).amax(dim=1)
    return {"top2": top2, "margin": (true - others).mean()}


def plateau(opt: torch.optim.Optimizer) -> Any:
    return torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0)


class Tally(ddpkit.Callback):
    """A user's callback with state: steps seen, and the sum of the learning rates
    at them (changed by the scheduler), kept in checkpoints."""

    def __init__(self) -> None:
        self.steps, self.lr_sum = 0, 0.0

    def on_step_end(self, trainer: ddpkit.Trainer, step: int) -> None:
        self.steps += 1
        self.lr_sum += trainer.optimizer.param_groups[0]["lr"]

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "lr_sum": self.lr_sum}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps, self.lr_sum = int(state["steps"]), float(state["lr_sum"])


class Unkept(ddpkit.Callback):
    """A callback the resumed run adds before `Tally` (a changed callback list): it has
    no state, and the saved states must still find their own callbacks."""


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
    "keep_best": {"keep_best": "eval_loss", "eval_every_steps": 1},
    "early_stopping": {"epochs": 3, "early_stopping_patience": 1},
    "early_stop_no_eval": {"early_stopping_patience": 1},
    "plateau": {"scheduler_interval": "epoch"},
    "eval_max_batches": {"eval_max_batches": 1},
    "profile": {"profile": True},
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
    if feature in ("by_steps", "endless_steps"):
        opts.update(epochs=None, max_steps=max_steps(strategy), eval_every_steps=2)
    if feature == "by_steps":
        opts.update(keep_best="eval_loss", replacement=True)
    return opts


def max_steps(strategy: str) -> int:
    """The by-steps cells' max_steps: inside the third epoch of 48 samples."""
    per_epoch = SAMPLES // (BATCH * STRATEGIES[strategy][0])
    return EPOCHS * per_epoch + per_epoch // 2


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
class _Cell(ddpkit.Callback):
    """The cell's own hooks. Saves (if `cut`) after the second epoch's last step but
    one: mid-epoch, and, with uneven shards, after the shorter shard ran out (or, in a
    run that never ends an epoch, after step `cut_at`). Records where each checkpoint
    was written: (global step, epoch, batches of it done, path); and, on rank 0, keeps
    best.pt as it stood once that step was over (keep_best acts after the save), in
    FOLDER/best-after/CHECKPOINT, for a resume to start from. Records, per optimizer
    step, which sample indices this rank trained (see `TRAINED`)."""

    def __init__(self, folder: Path, phase: str, *, cut: bool, cut_at: int | None) -> None:
        self.folder, self.phase, self.cut, self.cut_at = folder, phase, cut, cut_at
        self.per_epoch = 0  # optimizer steps in an epoch, known after the first
        self.written: list[tuple[int, int, int, str]] = []
        self.trained: list[tuple[int, int, list[int]]] = []  # (epoch, steps before, indices)
        self._unsnapped: Path | None = None  # a checkpoint whose best.pt is not kept yet
        self.cut_path: str | None = None

    def on_fit_start(self, trainer: ddpkit.Trainer) -> None:
        TRAINED.clear()

    def on_epoch_start(self, trainer: ddpkit.Trainer, epoch: int) -> None:
        self._snap(trainer)

    def on_epoch_end(self, trainer: ddpkit.Trainer, epoch: int, metrics: dict[str, float]) -> None:
        if epoch == 0:
            self.per_epoch = trainer.global_step

    def on_step_end(self, trainer: ddpkit.Trainer, step: int) -> None:
        self._snap(trainer)
        self.trained.append((trainer.epoch, step - 1, TRAINED[:]))
        TRAINED.clear()
        if step == 1 and trainer.ctx.is_main:
            (self.folder / f"{self.phase}-trained").touch()  # see test_matrix.REFUSED
        due = 2 * self.per_epoch - 1 if self.cut_at is None else self.cut_at
        if self.cut and step == due and (self.cut_at is not None or trainer.epoch == 1):
            # Every rank, after the same step (a collective).
            self.cut_path = str(trainer.save())

    def on_checkpoint(self, trainer: ddpkit.Trainer, path: Path) -> None:
        self.written.append((trainer.global_step, trainer.epoch, trainer.batch, str(path)))
        self._unsnapped = path

    def on_fit_end(self, trainer: ddpkit.Trainer, result: FitResult) -> None:
        self._snap(trainer)

    def _snap(self, trainer: ddpkit.Trainer) -> None:
        path, self._unsnapped = self._unsnapped, None
        if path is None or not trainer.ctx.is_main:
            return
        for best in path.parent.glob("best.*"):
            kept = self.folder / "best-after" / path.name / best.name
            if kept.is_dir():  # the step's checkpoint was written again (keep_best, then the end)
                shutil.rmtree(kept)
            kept.parent.mkdir(parents=True, exist_ok=True)
            copy = shutil.copytree if best.is_dir() else shutil.copy2
            copy(best, kept)


def best_checkpoint(folder: Path) -> tuple[int, float] | None:
    """(global step, value) of the best.pt (or best.dcp) in `folder`; None without one."""
    for best in folder.glob("best.*"):
        state = torch.load(best / "meta.pt" if best.is_dir() else best, weights_only=False)
        return int(state["global_step"]), float(state["extra"]["best"])
    return None


def _quiet(_: str) -> None:
    pass


def _trainer_cell(
    ctx: ddpkit.DistContext, strategy: str, feature: str, phase: str, folder: Path, batch: int
) -> dict[str, Any]:
    resume = phase != "straight"
    opts = options(strategy, feature)
    ckpt = folder / ("ckpt-resume" if resume else "ckpt")
    opts.update(checkpoint_dir=str(ckpt), resume=resume, save_every=0, keep_last=100)
    # Every cell keeps a run log, a step line every step; a resume appends to the copy
    # the test put in its folder.
    opts.update(run_dir=str(folder / f"run-{phase}"), batch_size=batch, log_every=1)
    config = ddpkit.TrainConfig(**opts)
    ddpkit.seed_everything(config.seed)  # the same model on every rank
    job = build(ctx, config, feature=feature)
    if feature == "callbacks" and resume:
        job.callbacks = [Unkept(), *job.callbacks]  # the resumed run has one more
    cell = _Cell(
        folder,
        phase,
        cut=not resume and feature != "save_every_steps",
        cut_at=max_steps(strategy) - 3 if feature in ENDLESS else None,
    )
    trainer = job.trainer(ctx, config, callbacks=[cell], log_fn=_quiet)
    result = trainer.fit()
    held = held_state(trainer.model, trainer.optimizer, trainer.scheduler)
    torch.save(held, folder / f"{phase}-rank{ctx.rank}.pt")
    (folder / f"{phase}-indices-rank{ctx.rank}.json").write_text(json.dumps(cell.trained))
    tally = [cb for cb in trainer.callbacks if isinstance(cb, Tally)]
    return {
        "global_step": result.global_step,
        "epochs": result.epochs,
        "stopped_early": result.stopped_early,
        "checkpoints": cell.written,
        "cut": cell.cut_path,
        "eval": result.eval,
        "best": best_checkpoint(ckpt) if ctx.is_main else None,
        "callback": tally[0].state_dict() if tally else None,
        "diffs": _compare(ctx, folder, phase),
    }


# -- the hand-written loop -----------------------------------------------------------------
HAND_ACCUMULATE = 2


def _hand_loader(ctx: ddpkit.DistContext, feature: str, batch: int) -> Any:
    """The hand loop's data: a dataset given to prepare_loader; or (random_sampler) a
    one-GPU script's DataLoader that draws `RANDOM_SAMPLES` with replacement."""
    if feature != "random_sampler":
        return ddpkit.prepare_loader(Samples(), ctx, batch_size=batch, seed=SEED)
    data = Samples()
    draws = RandomSampler(data, replacement=True, num_samples=RANDOM_SAMPLES)
    return ddpkit.prepare_loader(DataLoader(data, batch_size=batch, sampler=draws), ctx, seed=SEED)


def _hand_cell(
    ctx: ddpkit.DistContext, strategy: str, feature: str, phase: str, folder: Path, batch: int
) -> dict[str, Any]:
    """The tutorial's loop with ddpkit's helpers: `accumulate`, `Precision("bf16")` with
    clipping, and `save_state`/`load_state` (saved after the second epoch's last step but
    one, as the Trainer cells save)."""
    ddpkit.seed_everything(SEED)  # the same model on every rank
    model = ddpkit.prepare_model(Net(), ctx, strategy=STRATEGIES[strategy][1])
    opt = adamw(model.parameters())  # after sharding
    sched = step_lr(opt)
    loader = _hand_loader(ctx, feature, batch)
    per_epoch = -(-len(loader) // HAND_ACCUMULATE)  # optimizer steps in a whole epoch
    prec = ddpkit.Precision("bf16", ctx)
    ddpkit.seed_everything(rank_seed(SEED, ctx.rank))  # each rank its own stream
    ckpt = folder / ("ckpt" if phase == "straight" else "ckpt-resume")
    start: dict[str, Any] | None = None
    if phase != "straight":
        start = ddpkit.load_state(
            ckpt, ctx, model=model, optimizer=opt, scheduler=sched, loader=loader
        )
        assert start is not None, f"nothing to resume in {ckpt}"
    start = start or {"epoch": 0, "batch": 0, "step": 0}
    step, written, trained = int(start["step"]), [], []
    TRAINED.clear()
    for epoch in range(int(start["epoch"]), EPOCHS):
        loader.set_epoch(epoch)
        first = int(start["batch"]) if epoch == start["epoch"] else 0
        # The epoch's batches: those done before a resume and those the loader has left
        # (on other ranks or batches, a resume re-shards the rest and counts none done).
        acc = ddpkit.accumulate(model, HAND_ACCUMULATE, first + len(loader))
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
            trained.append((epoch, step, TRAINED[:]))
            TRAINED.clear()
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
    (folder / f"{phase}-indices-rank{ctx.rank}.json").write_text(json.dumps(trained))
    return {
        "global_step": step,
        "epochs": EPOCHS,
        "stopped_early": False,
        "checkpoints": written,
        "cut": written[0][3] if written else None,
        "eval": {},
        "best": None,
        "callback": None,
        "diffs": _compare(ctx, folder, phase),
    }


HAND = ("hand_loop", "random_sampler")  # the features of the hand-written loop


def run_cell(
    ctx: ddpkit.DistContext,
    strategy: str,
    feature: str,
    phase: str,
    folder: str,
    batch: int = BATCH,
) -> dict[str, Any]:
    """One phase ("straight", "resume" or "elsewhere") of one cell, on every rank, in
    micro-batches of `batch`; see the module."""
    cell = _hand_cell if feature in HAND else _trainer_cell
    return cell(ctx, strategy, feature, phase, Path(folder), batch)


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

"""Verification: prove that N ranks compute what one process computes, and that resume is exact.

DDP bugs are silent: a BatchNorm that normalises each rank's batch alone, a loss summed
instead of averaged, randomness seeded with the rank, data every rank reads whole, a
resume that forgets part of the state. Each trains "fine" and gives a worse model. The
two checks here run the user's own job through `Trainer` and compare numbers:

- `check_equivalence`: K optimizer steps as N processes with batch b each, then as one
  process with batch N*b whose every batch is the union of the ranks' batches (the
  ranks' sampler order, recorded). After each step every parameter and buffer of the
  one-process run is compared with rank 0's.
- `check_resume`: K steps straight, and K/2 steps + checkpoint + a fresh launch that
  resumes + K/2 steps, on N processes; parameters, buffers, optimizer, scheduler and
  every RNG state must be bit-for-bit equal on every rank.

Both run on CPU with gloo, so a GPU job can be checked on a laptop.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset, Sampler

from ddpkit.callbacks import Callback
from ddpkit.config import TrainConfig
from ddpkit.context import DistContext
from ddpkit.errors import ConfigError
from ddpkit.job import Job, JobRef, build_job
from ddpkit.launcher import launch, under_torchrun
from ddpkit.model import unwrap
from ddpkit.seed import rng_state
from ddpkit.syncbn import SyncBatchNorm
from ddpkit.trainer import Trainer

DEFAULT_STEPS = 8
# Sums in another order differ in the last bits, and optimizer steps can grow that (by
# the learning rate over the gradient's scale), so allow room above rounding.
TOLERANCES = {"float64": (1e-9, 1e-7), "float32": (1e-5, 1e-4)}  # (atol, rtol)
MAX_LISTED = 6  # differences listed per rank
LogFn = Callable[[str], None] | None


@dataclass
class VerifyReport:
    """The outcome of one check; `str(report)` is the text `ddpkit verify` prints."""

    check: str  # "equivalence" or "resume"
    passed: bool
    nproc: int
    steps: int
    batch_size: int  # per rank
    dtype: str | None = None
    atol: float | None = None
    rtol: float | None = None
    # equivalence: the first (step, tensor) out of tolerance, and the worst per step
    first_divergence: dict[str, Any] | None = None
    max_abs_diff: list[float] = field(default_factory=list)
    tolerance_used: list[float] = field(default_factory=list)  # max |a-b| / (atol+rtol|b|)
    # resume: what differs between the straight and the resumed run
    differences: list[str] = field(default_factory=list)
    causes: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def __str__(self) -> str:
        verdict = "PASS" if self.passed else "FAIL"
        if self.check == "equivalence":
            what = (
                f"{self.nproc} processes x batch {self.batch_size} vs 1 process x batch "
                f"{self.nproc * self.batch_size}, {self.steps} steps, "
                f"{self.dtype}, atol {self.atol:g}, rtol {self.rtol:g}"
            )
        else:
            what = (
                f"{self.steps} steps straight vs {resume_cut(self.steps)} + resume + "
                f"{self.steps - resume_cut(self.steps)}, {self.nproc} processes, bit for bit"
            )
        lines = [f"{verdict}  {self.check}: {what}"]
        if self.max_abs_diff:
            step = max(range(len(self.max_abs_diff)), key=self.max_abs_diff.__getitem__)
            used = max(self.tolerance_used)
            share = f"{used:.0%} of" if used <= 1 else f"{used:.2g}x"
            lines.append(
                f"  largest difference: {self.max_abs_diff[step]:.2g} after step {step} "
                f"({share} the tolerance)"
            )
        if self.first_divergence:
            d = self.first_divergence
            lines.append(
                f"  first divergence: step {d['step']}, {d['tensor']}: max abs diff "
                f"{d['max_abs']:.3g}, max rel diff {d['max_rel']:.3g}"
            )
        lines += [f"  differs: {d}" for d in self.differences]
        lines += [f"  likely cause: {c}" for c in self.causes]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def verify(
    job: JobRef,
    config: TrainConfig | None = None,
    *,
    nproc: int = 2,
    steps: int = DEFAULT_STEPS,
    resume: bool = False,
    dtype: str = "float64",
    atol: float | None = None,
    rtol: float | None = None,
    log_fn: LogFn = None,
) -> VerifyReport:
    """`ddpkit verify` from Python: `check_equivalence`, or with `resume=True`
    `check_resume` (which ignores dtype and tolerances: it asks for equal bits)."""
    if resume:
        return check_resume(job, config, nproc=nproc, steps=steps, log_fn=log_fn)
    return check_equivalence(
        job, config, nproc=nproc, steps=steps, dtype=dtype, atol=atol, rtol=rtol, log_fn=log_fn
    )


def check_equivalence(
    job: JobRef,
    config: TrainConfig | None = None,
    *,
    nproc: int = 2,
    steps: int = DEFAULT_STEPS,
    dtype: str = "float64",
    atol: float | None = None,
    rtol: float | None = None,
    log_fn: LogFn = None,
) -> VerifyReport:
    """Does `job` on `nproc` ranks with `config.batch_size` each compute what one process
    computes with the global batch? `job` is a module-level `build(ctx) -> Job` (it is
    pickled to the workers), a built-in example's name, or a `MODULE:FUNCTION` spec.

    `dtype="float64"` (the default) promotes the model and the data, so rounding stays
    near 1e-16 and cannot pass for a bug: in float32, Adam turns the rounding noise of a
    gradient that should be zero (a bias before BatchNorm) into steps of the learning
    rate. `dtype="float32"` compares the job as it trains. `atol`/`rtol` default to
    TOLERANCES[dtype]. `log_fn` hears what runs (the command line prints it)."""
    config = _check_args(config, nproc, steps, minimum=1)
    if dtype not in TOLERANCES:
        raise ConfigError(f"dtype must be float64 or float32 (got {dtype!r})")
    atol = TOLERANCES[dtype][0] if atol is None else atol
    rtol = TOLERANCES[dtype][1] if rtol is None else rtol
    if not (atol >= 0 and rtol >= 0):
        raise ConfigError(f"atol and rtol must be >= 0 (got {atol}, {rtol}): pass --atol 1e-6")
    precision = config.precision
    # Autocast would round both runs to 16 bits and hide what this check looks for.
    config = replace(config, epochs=steps, precision="32")  # each epoch has a step
    say = log_fn or _silent
    with tempfile.TemporaryDirectory(prefix="ddpkit-verify-") as tmp:
        folder = Path(tmp)
        say(f"{steps} steps on {nproc} processes, batch {config.batch_size} each...")
        launch(
            _equivalence_rank, job, config, steps, dtype, str(folder), nprocs=nproc, backend="gloo"
        )
        ranks = [json.loads((folder / f"rank-{r}.json").read_text()) for r in range(nproc)]
        if len({len(o) for r in ranks for o in r["orders"]}) > 1:
            raise ConfigError(
                "verify needs every rank to get the same number of samples per epoch, but "
                "the job's train_sampler gives ranks shards of different lengths: check it "
                "with ddpkit's own sharding (no train_sampler)"
            )
        union = _union_orders([r["orders"] for r in ranks], config.batch_size)
        say(f"the same {steps} steps on 1 process, batch {nproc * config.batch_size}...")
        compared = launch(
            _reference_rank,
            job,
            config,
            steps,
            dtype,
            str(folder),
            union,
            nproc,
            atol,
            rtol,
            nprocs=1,
            backend="gloo",
        )
    report = VerifyReport(
        "equivalence",
        passed=True,
        nproc=nproc,
        steps=steps,
        batch_size=config.batch_size,
        dtype=dtype,
        atol=atol,
        rtol=rtol,
        first_divergence=compared["first"],
        max_abs_diff=compared["max_abs"],
        tolerance_used=compared["used"],
    )
    if precision != "32":
        report.notes.append(f"precision {precision} compared without autocast, in {dtype}")
    _diagnose_equivalence(report, ranks, compared)
    report.passed = report.first_divergence is None and not report.causes
    return report


def check_resume(
    job: JobRef,
    config: TrainConfig | None = None,
    *,
    nproc: int = 2,
    steps: int = DEFAULT_STEPS,
    log_fn: LogFn = None,
) -> VerifyReport:
    """Is K/2 steps + checkpoint + resume in a fresh launch + K/2 steps bit-for-bit the
    same as K steps straight, on every rank (model, optimizer, scheduler, RNG)?"""
    config = _check_args(config, nproc, steps, minimum=2)
    config = replace(config, epochs=steps, save_every=0)
    with tempfile.TemporaryDirectory(prefix="ddpkit-verify-") as tmp:
        # The straight run and the first half share a launch; the resume gets its own.
        cut = resume_cut(steps)
        for phases, what in (
            (("straight", "first-half"), f"{steps} steps, then {cut} steps + checkpoint"),
            (("resumed",), f"a fresh launch: resume + {steps - cut} steps"),
        ):
            (log_fn or _silent)(f"{what} on {nproc} processes...")
            launch(_resume_rank, job, config, steps, tmp, phases, nprocs=nproc, backend="gloo")
        report = VerifyReport(
            "resume", passed=True, nproc=nproc, steps=steps, batch_size=config.batch_size
        )
        for rank in range(nproc):
            straight, resumed = (
                torch.load(Path(tmp, f"{phase}-rank{rank}.pt"), weights_only=True)
                for phase in ("straight", "resumed")
            )
            diffs = _state_differences(straight, resumed)
            if len(diffs) > MAX_LISTED:
                diffs[MAX_LISTED:] = [f"... and {len(diffs) - MAX_LISTED} more"]
            report.differences += [f"rank {rank}: {d}" for d in diffs]
            report.causes += [
                c for c in _resume_causes(straight, resumed) if c not in report.causes
            ]
    report.passed = not report.differences
    return report


def _check_args(config: TrainConfig | None, nproc: int, steps: int, minimum: int) -> TrainConfig:
    if under_torchrun():
        raise ConfigError(
            "verify starts its own processes: run it directly (python or ddpkit verify), "
            "not under torchrun"
        )
    if not isinstance(nproc, int) or nproc < 2:
        raise ConfigError(f"verify compares N >= 2 processes with one (got --nproc {nproc})")
    if not isinstance(steps, int) or steps < minimum:
        raise ConfigError(f"steps must be >= {minimum} for this check (got --steps {steps})")
    config = config or TrainConfig()
    return replace(
        config,
        checkpoint_dir=None,
        resume=False,
        run_dir=None,
        progress=False,
        early_stopping_patience=None,
    )


# -- the job, built the way `ddpkit train` builds it ------------------------------------
def _build(ctx: DistContext, job: JobRef, seed: int, dtype: str) -> tuple[Job, int]:
    """The job as `ddpkit train` builds it, promoted to float64 if asked, with Dropout
    switched off (one process cannot draw the random masks that N ranks draw); returns
    how many Dropout layers were switched off."""
    built = build_job(ctx, job, seed)
    if dtype == "float64":
        # In place: the optimizer keeps pointing at the same Parameter objects.
        built.model.double()
        built.train_set = _Float64(built.train_set)
    switched = 0
    for module in built.model.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0:
            module.p, switched = 0.0, switched + 1
    return built, switched


def _trainer(
    ctx: DistContext,
    job: Job,
    config: TrainConfig,
    callbacks: Sequence[Callback],
    sampler: Sampler[Any] | None = None,
) -> Trainer:
    # Ours run after the job's callbacks (they may stop the run); no evaluation: the
    # eval set is not promoted to float64, and it changes nothing that is compared.
    return job.trainer(
        ctx, config, callbacks=callbacks, train_sampler=sampler, evaluate=False, log_fn=_silent
    )


class _Float64(Dataset[Any]):
    """The job's dataset with floating-point tensors promoted to float64."""

    def __init__(self, data: Dataset[Any]) -> None:
        self.data = data

    def __len__(self) -> int:
        return len(self.data)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> Any:
        return _promote(self.data[index])


def _promote(item: Any) -> Any:
    if isinstance(item, torch.Tensor):
        return item.double() if item.is_floating_point() else item
    if isinstance(item, (tuple, list)):
        return type(item)(_promote(x) for x in item)
    if isinstance(item, dict):
        return {k: _promote(v) for k, v in item.items()}
    return item


def _silent(_: str) -> None:
    pass


class _Stop(Exception):
    """Raised on every rank after the same step, to end `fit` there."""


def _fit(trainer: Trainer) -> None:
    with contextlib.suppress(_Stop):
        trainer.fit()


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in unwrap(model).state_dict().items()}


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()[:16]


# -- equivalence ------------------------------------------------------------------------
class _Record(Callback):
    """N-rank run: rank 0 saves the model before the first step and after each one;
    every rank keeps digests of its parameters, to show whether the ranks agree."""

    def __init__(self, folder: Path, steps: int) -> None:
        self.folder, self.steps = folder, steps
        self.digests: list[dict[str, str]] = []

    def _snap(self, trainer: Trainer, step: int) -> None:
        state = _state(trainer.model)
        params = dict(unwrap(trainer.model).named_parameters())
        self.digests.append({k: _digest(v) for k, v in state.items() if k in params})
        if trainer.ctx.is_main:
            torch.save(state, self.folder / f"step-{step}.pt")

    def on_fit_start(self, trainer: Trainer) -> None:
        self._snap(trainer, 0)

    def on_step_end(self, trainer: Trainer, step: int) -> None:
        self._snap(trainer, step)
        if step >= self.steps:
            raise _Stop


def _equivalence_rank(
    ctx: DistContext, job: JobRef, config: TrainConfig, steps: int, dtype: str, folder: str
) -> None:
    built, switched = _build(ctx, job, config.seed, dtype)
    rng = _digest(torch.get_rng_state())  # as training starts: must match across ranks
    record = _Record(Path(folder), steps)
    trainer = _trainer(ctx, built, config, [record])
    batches = len(trainer.train_loader)
    per_epoch = math.ceil(batches / config.accumulate)
    orders, repeatable = _orders(trainer.train_loader.sampler, math.ceil(steps / per_epoch))
    plain_bn = [
        name
        for name, m in unwrap(trainer.model).named_modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and not isinstance(m, SyncBatchNorm)
    ]
    _fit(trainer)
    facts = {
        "rank": ctx.rank,
        "rng": rng,
        "dropout": switched,
        "plain_batchnorm": plain_bn,
        "orders": orders,
        "repeatable": repeatable,
        "digests": record.digests,
    }
    Path(folder, f"rank-{ctx.rank}.json").write_text(json.dumps(facts))


def _orders(sampler: Any, epochs: int) -> tuple[list[list[int]], bool]:
    """The sampler's order in each of the first `epochs` epochs, and whether iterating it
    twice gives the same order (a RandomSampler without a generator does not)."""
    if not hasattr(sampler, "__len__"):
        raise ConfigError(
            "verify needs a map-style dataset (with __len__ and __getitem__): an "
            "IterableDataset's order cannot be recorded and replayed"
        )
    orders, repeatable = [], True
    for epoch in range(epochs):
        set_epoch = getattr(sampler, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)
        order = [int(i) for i in sampler]
        repeatable = repeatable and order == [int(i) for i in sampler]
        orders.append(order)
    return orders, repeatable


def _union_orders(orders: list[list[list[int]]], batch: int) -> list[list[int]]:
    """Per epoch, one process's order: batch i is rank 0's batch i, then rank 1's, ..."""
    union = []
    for epoch in zip(*orders, strict=True):
        flat: list[int] = []
        for start in range(0, len(epoch[0]), batch):
            for rank_order in epoch:
                flat += rank_order[start : start + batch]
        union.append(flat)
    return union


class _Replay(Sampler[int]):
    """Yields a recorded order per epoch."""

    def __init__(self, orders: list[list[int]]) -> None:
        self.orders, self.epoch = orders, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = min(epoch, len(self.orders) - 1)

    def __iter__(self) -> Iterator[int]:
        return iter(self.orders[self.epoch])

    def __len__(self) -> int:
        return len(self.orders[self.epoch])


class _Compare(Callback):
    """One-process run: after each step, compare with the N-rank run's saved state."""

    def __init__(self, folder: Path, steps: int, atol: float, rtol: float) -> None:
        self.folder, self.steps, self.atol, self.rtol = folder, steps, atol, rtol
        self.max_abs: list[float] = []
        self.used: list[float] = []
        self.first: dict[str, Any] | None = None
        self.previous: dict[str, torch.Tensor] | None = None

    def _compare(self, trainer: Trainer, step: int) -> None:
        ours = _state(trainer.model)
        theirs = torch.load(self.folder / f"step-{step}.pt", weights_only=True)
        if set(ours) != set(theirs):
            raise ConfigError(
                "the one-process model has other state keys than the N-rank one: "
                f"{sorted(set(ours) ^ set(theirs))[:5]} (does build(ctx) depend on the rank?)"
            )
        worst = used = 0.0
        for name, a in ours.items():
            b = theirs[name]
            if a.numel() == 0:
                continue
            if a.is_floating_point():
                diff = (a.double() - b.double()).abs()
                max_abs = float(diff.max())
                fraction = float((diff / (self.atol + self.rtol * b.double().abs())).max())
                close = fraction <= 1.0  # torch.allclose's rule
                max_rel = max_abs / max(float(b.abs().max()), 1e-12)
            else:  # counters such as num_batches_tracked
                close = torch.equal(a, b)
                max_abs = max_rel = fraction = 0.0 if close else math.inf
            worst, used = max(worst, max_abs), max(used, fraction)
            if not close and self.first is None:
                self.first = {"step": step, "tensor": name, "max_abs": max_abs, "max_rel": max_rel}
                self.first.update(self._update_ratio(trainer, ours, theirs))
        self.max_abs.append(worst)
        self.used.append(used)
        self.previous = ours
        if step >= self.steps:
            raise _Stop

    def _update_ratio(
        self, trainer: Trainer, ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]
    ) -> dict[str, float]:
        """How this step's update of the parameters compares between the two runs: a
        ratio of N (or 1/N) in the same direction means the gradient's scale is off."""
        if self.previous is None:
            return {}
        names = [n for n, p in unwrap(trainer.model).named_parameters() if p.is_floating_point()]
        one = torch.cat([(ours[n] - self.previous[n]).double().flatten() for n in names])
        many = torch.cat([(theirs[n] - self.previous[n]).double().flatten() for n in names])
        norms = float(one.norm()) * float(many.norm())
        if norms == 0:
            return {}
        return {
            "update_ratio": float(one.norm()) / float(many.norm()),
            "update_cosine": float(one @ many) / norms,
        }

    def on_fit_start(self, trainer: Trainer) -> None:
        self._compare(trainer, 0)

    def on_step_end(self, trainer: Trainer, step: int) -> None:
        self._compare(trainer, step)


def _reference_rank(
    ctx: DistContext,
    job: JobRef,
    config: TrainConfig,
    steps: int,
    dtype: str,
    folder: str,
    union: list[list[int]],
    nproc: int,
    atol: float,
    rtol: float,
) -> dict[str, Any]:
    built, _ = _build(ctx, job, config.seed, dtype)
    compare = _Compare(Path(folder), steps, atol, rtol)
    single = replace(config, batch_size=config.batch_size * nproc)
    _fit(_trainer(ctx, built, single, [compare], sampler=_Replay(union)))
    return {"first": compare.first, "max_abs": compare.max_abs, "used": compare.used}


def _diagnose_equivalence(
    report: VerifyReport, ranks: list[dict[str, Any]], compared: dict[str, Any]
) -> None:
    """Name the likely cause from what the runs recorded; problems that do not show in
    the numbers (unsharded data, per-rank randomness) are causes on their own."""
    n, b = report.nproc, report.batch_size
    causes, first = report.causes, report.first_divergence
    dropout = ranks[0]["dropout"]
    if dropout:
        report.notes.append(
            f"{dropout} Dropout layer(s) switched off in both runs: one process cannot draw "
            "the random masks that N ranks draw"
        )
    if not all(r["repeatable"] for r in ranks):
        causes.append(
            "the training sampler gives another order each time it is iterated (a "
            "RandomSampler without a generator?): the data order is not reproducible and "
            "cannot be compared; seed it, or let ddpkit shard and shuffle (no train_sampler)"
        )
    shared = set(ranks[0]["orders"][0]).intersection(*(r["orders"][0] for r in ranks[1:]))
    if len(shared) >= n:  # DistributedSampler repeats at most n - 1 samples as padding
        causes.append(
            f"data is not sharded: all {n} ranks train on the same {len(shared)} samples "
            f"of their {len(ranks[0]['orders'][0])} in epoch 1, so {n} ranks do the work "
            "of one: let ddpkit shard the data (no train_sampler) or use a "
            "DistributedSampler"
        )
    if len({r["rng"] for r in ranks}) > 1 and dropout:
        causes.append(
            f"randomness differs between ranks: the ranks start training with different "
            f"torch RNG states (seeded with the rank?) and the model has {dropout} "
            "Dropout layer(s), so the masks, and the trained model, depend on the rank "
            "and the number of ranks: seed every rank alike (ddpkit seeds all ranks with "
            "--seed before build; do not reseed with ctx.rank)"
        )
    if first is None:
        return
    step = first["step"]
    ratio, cosine = first.get("update_ratio"), first.get("update_cosine", 0.0)
    plain_bn = ranks[0]["plain_batchnorm"]
    if step == 0:
        causes.append(
            "the two runs start from different models: build(ctx) depends on the rank or "
            "the number of ranks, or on randomness that seed_everything does not cover"
        )
    elif plain_bn:
        causes.append(
            f"BatchNorm not synchronised: {len(plain_bn)} BatchNorm layer(s) (e.g. "
            f"{plain_bn[0]!r}) normalise each rank's batch of {b} alone, while one process "
            f"normalises the global batch of {n * b}: leave sync_batchnorm on (the default), "
            "or convert with ddpkit.convert_sync_batchnorm"
        )
    elif ratio is not None and cosine > 0.99 and abs(ratio / n - 1) < 0.05:
        causes.append(
            f"gradient not averaged over the global batch: one process's update is "
            f"{ratio:.2f}x the {n}-rank update, as with a loss summed over the batch "
            f"(DDP averages over ranks, so a summed loss shrinks {n}-fold): average the "
            "loss over the batch (reduction='mean')"
        )
    elif ratio is not None and cosine > 0.99 and abs(ratio * n - 1) < 0.05:
        causes.append(
            f"gradients summed over ranks instead of averaged: the {n}-rank update is "
            f"{1 / ratio:.2f}x one process's (an extra all_reduce without dividing by the "
            "world size?)"
        )
    elif _ranks_disagree(ranks, step):
        causes.append(
            f"the ranks hold different parameters after step {step}: something changes "
            "the parameters outside DDP's gradient averaging (a rank-dependent update?)"
        )
    else:
        causes.append(
            "no known cause matched: look for ops whose result depends on the batch "
            "size or the rank (a loss normalised by a fixed count, non-deterministic "
            "kernels), or loosen --atol/--rtol if the difference is rounding"
        )


def _ranks_disagree(ranks: list[dict[str, Any]], step: int) -> bool:
    """Do the ranks hold different parameters after `step` (or the last one recorded)?"""
    snaps = [r["digests"][min(step, len(r["digests"]) - 1)] for r in ranks]
    return any(s != snaps[0] for s in snaps[1:])


# -- resume -----------------------------------------------------------------------------
def resume_cut(steps: int) -> int:
    """Where the resume check stops and resumes: about half way, at an odd step, so that
    state the checkpoint misses cannot hide behind a period that divides the cut (a
    StepLR of step_size 2 restarted at step 4 happens to keep the same learning rates)."""
    half = steps // 2
    return half if half % 2 or half + 1 >= steps else half + 1


class _StopAt(Callback):
    def __init__(self, step: int, save: bool = False) -> None:
        self.step, self.save = step, save

    def on_step_end(self, trainer: Trainer, step: int) -> None:
        if step >= self.step:
            if self.save:
                trainer.save()
            raise _Stop


def _resume_rank(
    ctx: DistContext,
    job: JobRef,
    config: TrainConfig,
    steps: int,
    folder: str,
    phases: Sequence[str],
) -> None:
    checkpoints = str(Path(folder, "checkpoints"))
    for phase in phases:  # each builds the job afresh, seeded as `ddpkit train` does
        built = build_job(ctx, job, config.seed)
        if phase == "straight":
            trainer = _trainer(ctx, built, config, [_StopAt(steps)])
        elif phase == "first-half":
            half = replace(config, checkpoint_dir=checkpoints)
            trainer = _trainer(ctx, built, half, [_StopAt(resume_cut(steps), save=True)])
        else:
            again = replace(config, checkpoint_dir=checkpoints, resume=True)
            trainer = _trainer(ctx, built, again, [_StopAt(steps)])
        _fit(trainer)
        if phase == "first-half":
            continue
        state = {
            "model": _state(trainer.model),
            "optimizer": trainer.optimizer.state_dict(),
            "scheduler": trainer.scheduler.state_dict() if trainer.scheduler else None,
            "callbacks": [cb.state_dict() for cb in built.callbacks],
            "rng": rng_state(),
            "global_step": trainer.global_step,
        }
        torch.save(state, Path(folder, f"{phase}-rank{ctx.rank}.pt"))


def _leaves(obj: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted name, value) for every tensor or plain value in a nested state."""
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield from _leaves(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(obj, (list, tuple)) and any(
        isinstance(v, (dict, list, tuple, torch.Tensor)) for v in obj
    ):
        for i, value in enumerate(obj):
            yield from _leaves(value, f"{prefix}.{i}")
    else:
        yield prefix, obj


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a, b)
        )
    return bool(a == b)


def _state_differences(straight: dict[str, Any], resumed: dict[str, Any]) -> list[str]:
    a, b = dict(_leaves(straight)), dict(_leaves(resumed))
    found = []
    for name in sorted(set(a) | set(b)):
        if name not in a or name not in b:
            found.append(f"{name}: only in the {'straight' if name in a else 'resumed'} run")
        elif not _same(a[name], b[name]):
            x, y = a[name], b[name]
            if (
                isinstance(x, torch.Tensor)
                and isinstance(y, torch.Tensor)
                and x.is_floating_point()
                and x.shape == y.shape
            ):
                found.append(f"{name}: max abs diff {float((x - y).abs().max()):.3g}")
            elif isinstance(x, torch.Tensor):
                found.append(f"{name}")
            else:
                found.append(f"{name}: {x!r} straight, {y!r} resumed")
    return found


def _resume_causes(straight: dict[str, Any], resumed: dict[str, Any]) -> list[str]:
    lr = [
        (g1.get("lr"), g2.get("lr"))
        for g1, g2 in zip(
            straight["optimizer"]["param_groups"],
            resumed["optimizer"]["param_groups"],
            strict=False,
        )
    ]
    causes = []
    if any(x != y for x, y in lr):
        causes.append(
            "the learning rate after resume is not the uninterrupted run's: an LR scheduler "
            "whose state is not in the checkpoint; give it to ddpkit (Job.scheduler or "
            "Trainer(scheduler=...)) or keep its state in your Callback's state_dict()"
        )
    if not all(
        _same(x, y)
        for (_, x), (_, y) in zip(_leaves(straight["rng"]), _leaves(resumed["rng"]), strict=False)
    ):
        causes.append(
            "random state not restored: an RNG the checkpoint does not hold (a "
            "torch.Generator of your own?), or one drawn from outside the training steps"
        )
    return causes

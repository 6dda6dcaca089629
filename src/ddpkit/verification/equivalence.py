"""The equivalence check: do N ranks compute what one process computes?

K optimizer steps as N processes with batch b each, then as one process with batch N*b
whose every batch is the union of the ranks' batches: the samples each rank fetched
(random augmentation included) are recorded, and replayed in the ranks' order. After
each step every parameter and buffer of the one-process run is compared with rank 0's.
"""

from __future__ import annotations

import contextlib
import json
import math
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)
from torch.utils.data import IterableDataset
from torch.utils.data.distributed import DistributedSampler

from ddpkit.checkpoint.digest import state_digest, tensor_digest
from ddpkit.context import DistContext
from ddpkit.errors import ConfigError
from ddpkit.parallel.data import ReplacementSampler
from ddpkit.parallel.model import unwrap
from ddpkit.parallel.syncbn import SyncBatchNorm
from ddpkit.parallel.watch import TrainingData, watching
from ddpkit.processes.launcher import launch
from ddpkit.seed import rng_state
from ddpkit.storage import write_json
from ddpkit.training.config import TrainConfig
from ddpkit.training.job import JobRef
from ddpkit.training.trainer import Callback, Trainer
from ddpkit.verification.causes import datasets_differ, equivalence_causes
from ddpkit.verification.probe import probe_dataset
from ddpkit.verification.recording import (
    OrderOfPasses,
    Recorder,
    Replay,
    ReplaySampler,
    SampleKey,
    replay_keys,
)
from ddpkit.verification.report import VerifyReport
from ddpkit.verification.runs import (
    DEFAULT_STEPS,
    LogFn,
    LoopRef,
    Stop,
    build,
    check_args,
    comparable_model,
    fit,
    make_trainer,
    promote_data,
    resolve_loop,
    silent,
    snapshot,
)

# Sums in another order differ in the last bits, and optimizer steps can grow that (by
# the learning rate over the gradient's scale), so allow room above rounding.
TOLERANCES = {"float64": (1e-9, 1e-7), "float32": (1e-5, 1e-4)}  # (atol, rtol)
# With gradients all-reduced in bfloat16 (8 significant bits), whatever the dtype.
BF16_GRADS = (1e-4, 1e-2)
_NOT_MAP_STYLE = (
    "verify needs a map-style dataset (with __len__ and __getitem__): an "
    "IterableDataset's samples cannot be recorded by index and replayed"
)


def check_equivalence(
    job: JobRef | None,
    config: TrainConfig | None = None,
    *,
    loop: LoopRef | None = None,
    loop_args: tuple[Any, ...] = (),
    nproc: int = 2,
    steps: int = DEFAULT_STEPS,
    dtype: str = "float64",
    atol: float | None = None,
    rtol: float | None = None,
    log_fn: LogFn = None,
) -> VerifyReport:
    """Does `job` (or a hand-written `loop`) on `nproc` ranks with a batch each compute
    what one process computes with the global batch? `verify` describes the arguments;
    `atol`/`rtol` default to TOLERANCES[dtype]."""
    config = check_args(config, nproc, steps, minimum=1)
    atol, rtol = _tolerances(config, dtype, atol, rtol)
    precision = config.precision
    # Autocast would round both runs to 16 bits and hide what this check looks for.
    config = replace(config, epochs=steps, precision="32")  # each epoch has a step
    with tempfile.TemporaryDirectory(prefix="ddpkit-verify-") as tmp:
        ran = _run_both(
            job, config, (loop, loop_args), nproc, steps, dtype, (atol, rtol), Path(tmp), log_fn
        )
    ranks, batch, steps, compared = ran
    report = VerifyReport(
        "equivalence",
        passed=True,
        nproc=nproc,
        steps=steps,
        batch_size=batch,
        dtype=dtype,
        atol=atol,
        rtol=rtol,
        first_divergence=compared["first"],
        max_abs_diff=compared["max_abs"],
        tolerance_used=compared["used"],
    )
    report.notes += _notes(report, config, ranks, precision)
    report.causes = equivalence_causes(
        report,
        ranks,
        reference_draws=compared["draws"],
        maker="build(ctx)" if loop is None else "the loop",
    )
    # Runs that move no parameter agree whatever the job does wrong: no proof.
    report.trained = any(d != r["digests"][0] for r in ranks for d in r["digests"][1:])
    report.passed = report.first_divergence is None and not report.causes and report.trained
    return report


def _tolerances(
    config: TrainConfig, dtype: str, atol: float | None, rtol: float | None
) -> tuple[float, float]:
    """(atol, rtol): as given, else the defaults for `dtype` (or for gradients
    all-reduced in bf16)."""
    if dtype not in TOLERANCES:
        raise ConfigError(f"dtype must be float64 or float32 (got {dtype!r})")
    compressed = config.grad_compression != "none"
    default_atol, default_rtol = BF16_GRADS if compressed else TOLERANCES[dtype]
    atol = default_atol if atol is None else atol
    rtol = default_rtol if rtol is None else rtol
    if not (atol >= 0 and rtol >= 0):
        raise ConfigError(f"atol and rtol must be >= 0 (got {atol}, {rtol}): pass --atol 1e-6")
    return atol, rtol


def _run_both(
    job: JobRef | None,
    config: TrainConfig,
    loop_and_args: tuple[LoopRef | None, tuple[Any, ...]],
    nproc: int,
    steps: int,
    dtype: str,
    tolerances: tuple[float, float],
    folder: Path,
    log_fn: LogFn,
) -> tuple[list[dict[str, Any]], int, int, dict[str, Any]]:
    """Run `steps` steps on `nproc` ranks, recording their samples in `folder`, then the
    same steps on one process, replaying them; (what each rank recorded, the batch size
    of a rank, the steps taken, the one process's comparison with rank 0)."""
    loop = loop_and_args[0]
    say = log_fn or silent
    (folder / "samples").mkdir()
    if loop is None:
        say(f"{steps} steps on {nproc} processes, batch {config.batch_size} each...")
        launch(
            _equivalence_rank, job, config, steps, dtype, str(folder), nprocs=nproc, backend="gloo"
        )
    else:
        say(f"{steps} steps of the loop on {nproc} processes...")
        launch(_loop_rank, loop_and_args, steps, dtype, str(folder), nprocs=nproc, backend="gloo")
    ranks = [json.loads((folder / f"rank-{r}.json").read_text()) for r in range(nproc)]
    # A loop's batch size is the one it gave prepare_loader, and its steps may be fewer.
    batch = config.batch_size if loop is None else ranks[0]["batch_size"]
    steps = steps if loop is None else len(ranks[0]["digests"]) - 1
    if len({len(o) for r in ranks for o in r["orders"]}) > 1:
        raise ConfigError(
            "verify needs every rank to get the same number of samples per epoch, but "
            "the job's train_sampler gives ranks shards of different lengths: check it "
            "with ddpkit's own sharding (no train_sampler)"
        )
    keys = replay_keys([r["orders"] for r in ranks], batch)
    say(f"the same {steps} steps on 1 process, batch {nproc * batch}...")
    args = (steps, dtype, str(folder), keys, nproc, *tolerances)
    if loop is None:
        compared = launch(_reference_rank, job, config, *args, nprocs=1, backend="gloo")
    else:
        compared = launch(_loop_reference, loop_and_args, *args, nprocs=1, backend="gloo")
    return ranks, batch, steps, compared


def _notes(
    report: VerifyReport, config: TrainConfig, ranks: list[dict[str, Any]], precision: str
) -> list[str]:
    """What the report should say about how the runs were made comparable."""
    notes = []
    if precision != "32":
        notes.append(f"precision {precision} compared without autocast, in {report.dtype}")
    if config.grad_compression != "none":
        worst = max(report.max_abs_diff, default=0.0)
        notes.append(
            f"the {report.nproc} ranks all-reduced gradients in bf16 (grad_compression): the "
            f"largest parameter difference, {worst:.2e}, is that rounding's effect after "
            f"{report.steps} steps; tolerance atol {report.atol:g}, rtol {report.rtol:g}"
        )
    dropout = ranks[0]["dropout"]
    if dropout:
        notes.append(
            f"{dropout} Dropout layer(s) switched off in both runs: one process cannot draw "
            "the random masks that N ranks draw"
        )
    if config.num_workers and any(len(set(o)) < len(o) for r in ranks for o in r["orders"]):
        notes.append(
            "the sampler gives a rank the same index twice in an epoch, and worker "
            "processes fetch in parallel: the copies of such a sample may be replayed in "
            "each other's place (check with --num-workers 0 if this run FAILs)"
        )
    if datasets_differ(ranks) and not ranks[0]["shards_by_index"]:
        notes.append(
            "the ranks build different datasets; taken as each rank's own shard, since "
            "the job's train_sampler is not a DistributedSampler"
        )
    return notes


# -- the N-rank run ---------------------------------------------------------------------
class _Record(Callback):
    """N-rank run: rank 0 saves the model before the first step and after each one;
    every rank keeps digests of its parameters, to show whether the ranks agree."""

    def __init__(self, folder: Path, steps: int) -> None:
        self.folder, self.steps = folder, steps
        self.digests: list[dict[str, str]] = []

    def snap(self, model: nn.Module, ctx: DistContext, step: int) -> None:
        """Keep the model as it is after `step` (0: before the first)."""
        state = snapshot(model)
        params = dict(unwrap(model).named_parameters())
        if not ctx.is_main:
            self.digests.append({k: tensor_digest(v) for k, v in state.items() if k in params})
            return
        # sha256 lets go of the GIL on large buffers: rank 0 hashes while it saves,
        # which costs a large model half the time of one after the other.
        with ThreadPoolExecutor(1, thread_name_prefix="ddpkit-digest") as pool:
            digests = pool.submit(
                lambda: {k: tensor_digest(v) for k, v in state.items() if k in params}
            )
            torch.save(state, self.folder / f"step-{step}.pt")
            self.digests.append(digests.result())

    def at(self, model: nn.Module, ctx: DistContext, step: int) -> None:
        """`snap`, then raise Stop after the last step."""
        self.snap(model, ctx, step)
        if step >= self.steps:
            raise Stop

    def on_fit_start(self, trainer: Trainer) -> None:
        self.at(trainer.model, trainer.ctx, 0)

    def on_step_end(self, trainer: Trainer, step: int) -> None:
        self.at(trainer.model, trainer.ctx, step)


def _equivalence_rank(
    ctx: DistContext, job: JobRef, config: TrainConfig, steps: int, dtype: str, folder: str
) -> None:
    built, switched = build(ctx, job, config, dtype)
    if isinstance(built.train_set, IterableDataset):
        raise ConfigError(_NOT_MAP_STYLE)
    probe = probe_dataset(built.train_set)  # leaves the RNGs as they were
    # Recorded before promotion to float64: half the bytes, and the same samples.
    recorder = Recorder(built.train_set, Path(folder, "samples"), ctx.rank)
    built.train_set = promote_data(recorder, dtype)
    record = _Record(Path(folder), steps)
    trainer = make_trainer(ctx, built, config, [recorder.epoch_callback(), record])
    batches = len(trainer.train_loader)
    per_epoch = math.ceil(batches / config.accumulate)
    orders, repeatable = _orders(trainer.train_loader.base_sampler, math.ceil(steps / per_epoch))
    plain_bn = _plain_batchnorm(trainer.model)
    fit(trainer)
    facts = {
        "rank": ctx.rank,
        "probe": probe,
        "shards_by_index": isinstance(trainer.train_loader.base_sampler, DistributedSampler),
        "replacement": isinstance(trainer.train_loader.base_sampler, ReplacementSampler),
        "dropout": switched,
        "plain_batchnorm": plain_bn,
        "orders": orders,
        "repeatable": repeatable,
        "digests": record.digests,
    }
    write_json(Path(folder, f"rank-{ctx.rank}.json"), facts)


def _plain_batchnorm(model: nn.Module) -> list[str]:
    """The BatchNorm layers that normalise each rank's batch alone."""
    return [
        name
        for name, m in unwrap(model).named_modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and not isinstance(m, SyncBatchNorm)
    ]


def _orders(sampler: Any, epochs: int) -> tuple[list[list[int]], bool]:
    """The sampler's order in each of the first `epochs` epochs, and whether iterating it
    twice gives the same order (a RandomSampler without a generator does not)."""
    if not hasattr(sampler, "__len__"):
        raise ConfigError(_NOT_MAP_STYLE)
    orders, repeatable = [], True
    for epoch in range(epochs):
        set_epoch = getattr(sampler, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)
        order = [int(i) for i in sampler]
        repeatable = repeatable and order == [int(i) for i in sampler]
        orders.append(order)
    return orders, repeatable


# -- the one-process run ----------------------------------------------------------------
class _Compare(Callback):
    """One-process run: after each step, compare with the N-rank run's saved state, and
    note whether the step drew random numbers (the replayed data draws none)."""

    def __init__(self, folder: Path, steps: int, atol: float, rtol: float) -> None:
        self.folder, self.steps, self.atol, self.rtol = folder, steps, atol, rtol
        self.max_abs: list[float] = []
        self.used: list[float] = []
        self.first: dict[str, Any] | None = None
        self.previous: dict[str, torch.Tensor] | None = None
        self.draws = False  # did a step draw from torch's, random's or numpy's RNG?
        self._rng = ""

    def compare(self, model: nn.Module, step: int) -> None:
        """Compare the model after `step` (0: before the first) with the N-rank run's;
        raise Stop after the last step."""
        ours = snapshot(model)
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
                self.first.update(self._update_ratio(model, ours, theirs))
        self.max_abs.append(worst)
        self.used.append(used)
        self.previous = ours
        if step >= self.steps:
            raise Stop

    def _update_ratio(
        self, model: nn.Module, ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]
    ) -> dict[str, float]:
        """How this step's update of the parameters compares between the two runs: a
        ratio of N (or 1/N) in the same direction means the gradient's scale is off."""
        if self.previous is None:
            return {}
        names = [n for n, p in unwrap(model).named_parameters() if p.is_floating_point()]
        one = torch.cat([(ours[n] - self.previous[n]).double().flatten() for n in names])
        many = torch.cat([(theirs[n] - self.previous[n]).double().flatten() for n in names])
        norms = float(one.norm()) * float(many.norm())
        if norms == 0:
            return {}
        return {
            "update_ratio": float(one.norm()) / float(many.norm()),
            "update_cosine": float(one @ many) / norms,
        }

    def result(self) -> dict[str, Any]:
        """What the comparisons found, for the report."""
        return {
            "first": self.first,
            "max_abs": self.max_abs,
            "used": self.used,
            "draws": self.draws,
        }

    def on_fit_start(self, trainer: Trainer) -> None:
        self.compare(trainer.model, 0)

    def on_epoch_start(self, trainer: Trainer, epoch: int) -> None:
        self.mark_rng()

    def on_step_end(self, trainer: Trainer, step: int) -> None:
        self.after_step(trainer.model, step)

    def mark_rng(self) -> None:
        """Note the random state: a step that changes it drew random numbers."""
        self._rng = state_digest(rng_state())

    def after_step(self, model: nn.Module, step: int) -> None:
        rng = state_digest(rng_state())
        self.draws, self._rng = self.draws or rng != self._rng, rng
        self.compare(model, step)


def _reference_rank(
    ctx: DistContext,
    job: JobRef,
    config: TrainConfig,
    steps: int,
    dtype: str,
    folder: str,
    keys: list[list[SampleKey]],
    nproc: int,
    atol: float,
    rtol: float,
) -> dict[str, Any]:
    # Loading files needs no worker processes, and draws no random numbers. The job is
    # built with the config it runs with: a build(ctx, config) may size its schedule
    # from the batch size.
    # The replayed order is the N ranks' draws: none of its own (replacement).
    single = replace(config, batch_size=config.batch_size * nproc, num_workers=0, replacement=False)
    built, _ = build(ctx, job, single, dtype)
    built.train_set = promote_data(Replay(Path(folder, "samples"), keys), dtype)
    compare = _Compare(Path(folder), steps, atol, rtol)
    fit(make_trainer(ctx, built, single, [compare], sampler=ReplaySampler(keys)))
    return compare.result()


# -- a loop written by hand with prepare_model and prepare_loader ----------------------
class _LoopWatch:
    """Sees what a hand-written loop prepares (see `ddpkit.parallel.watch`): its model,
    with Dropout switched off and promoted to `dtype`, and its training data, recorded
    on N ranks or `replayed` in one process; `on_step` runs after each optimizer step."""

    def __init__(
        self,
        folder: Path,
        rank: int,
        dtype: str,
        on_step: Callable[[nn.Module, int], None],
        replay: tuple[list[list[SampleKey]], int] | None = None,
    ) -> None:
        self.folder, self.rank, self.dtype, self.on_step = folder, rank, dtype, on_step
        self.replay = replay  # the keys of the recorded samples, and N
        self.bare: nn.Module | None = None
        self.switched = 0
        self.data: dict[str, Any] = {}  # what the N-rank run learns about the data
        self.unseen: list[str] = []  # where the loop built DataLoaders verify cannot replay
        self.step = 0

    def model(self, model: nn.Module) -> nn.Module:
        if self.bare is not None:
            raise ConfigError(_ONE_MODEL)
        self.switched = comparable_model(model, self.dtype)
        model.register_forward_pre_hook(self._before_forward)
        self.bare = model
        return model

    def own_loader(self, data: TrainingData) -> TrainingData | None:
        return None if self.data else self.training_data(data)

    def other_loader(self, site: str) -> None:
        self.unseen.append(site)

    def _before_forward(self, module: nn.Module, args: Any) -> None:
        # Before the model meets a batch that verify cannot replay (in float64, a
        # float32 batch would stop it with a dtype error first).
        if not self.data:
            raise ConfigError(self._no_data())

    def _no_data(self) -> str:
        if self.unseen:
            return (
                "verify --loop replays the batches of ddpkit.prepare_loader or of a DataLoader "
                f"over a DistributedSampler, and this loop trains on the DataLoader built at "
                f"{self.unseen[0]}, which is neither: pass it through "
                "ddpkit.prepare_loader(loader, ctx) there"
            )
        return (
            "verify --loop replays the batches of ddpkit.prepare_loader, and this loop's "
            "model ran before it built a loader with it: build its training data with "
            "ddpkit.prepare_loader(dataset, ctx, batch_size=...)"
        )

    def training_data(self, data: TrainingData) -> TrainingData:
        if isinstance(data.dataset, IterableDataset):
            raise ConfigError(_NOT_MAP_STYLE)
        if self.data:
            raise ConfigError(
                "verify checks a loop with one training loader, and this one called "
                "prepare_loader twice for training: pass evaluation=True to the other"
            )
        self.data["batch_size"] = data.batch_size
        if self.replay is not None:  # one process: what the N ranks fetched, in their order
            keys, nproc = self.replay
            replayed = promote_data(Replay(self.folder / "samples", keys), self.dtype)
            return TrainingData(
                replayed, ReplaySampler(keys, by_pass=True), data.batch_size * nproc, 0
            )
        assert data.sampler is not None  # a map-style dataset gets ddpkit's sampler
        self.data["probe"] = probe_dataset(data.dataset)  # leaves the RNGs as they were
        self.data["shards_by_index"] = isinstance(data.sampler, DistributedSampler)
        self.data["replacement"] = isinstance(data.sampler, ReplacementSampler)
        self.data["sampler"] = order = OrderOfPasses(data.sampler)
        recorder = Recorder(data.dataset, self.folder / "samples", self.rank, by_pass=True)
        return TrainingData(
            promote_data(recorder, self.dtype), order, data.batch_size, data.num_workers
        )

    def _before(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.bare is None:
            raise ConfigError(_ONE_MODEL)
        if not self.data:
            raise ConfigError(self._no_data())
        if self.step == 0:  # the model that the first update starts from
            self.on_step(self.bare, 0)

    def _after(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        assert self.bare is not None
        self.step += 1
        self.on_step(self.bare, self.step)

    def run(self, loop: tuple[LoopRef, tuple[Any, ...]], ctx: DistContext) -> None:
        """Run the loop function with `ctx` and its arguments until `on_step` raises
        Stop (or the loop ends)."""
        hooks = [
            register_optimizer_step_pre_hook(self._before),
            register_optimizer_step_post_hook(self._after),
        ]
        try:
            with watching(self), contextlib.suppress(Stop):
                resolve_loop(loop[0])(ctx, *loop[1])
        finally:
            for hook in hooks:
                hook.remove()
        if self.bare is None or not self.data:
            raise ConfigError(_ONE_MODEL)


_ONE_MODEL = (
    "verify checks a loop that builds one model with ddpkit.prepare_model and its "
    "training data with ddpkit.prepare_loader, and steps an optimizer: use those in it"
)


def _loop_rank(
    ctx: DistContext, loop: tuple[LoopRef, tuple[Any, ...]], steps: int, dtype: str, folder: str
) -> None:
    record = _Record(Path(folder), steps)
    watch = _LoopWatch(
        Path(folder), ctx.rank, dtype, lambda model, step: record.at(model, ctx, step)
    )
    watch.run(loop, ctx)
    assert watch.bare is not None
    facts = {
        "rank": ctx.rank,
        "batch_size": watch.data["batch_size"],
        "probe": watch.data["probe"],
        "shards_by_index": watch.data["shards_by_index"],
        "replacement": watch.data["replacement"],
        "dropout": watch.switched,
        "plain_batchnorm": _plain_batchnorm(watch.bare),
        "orders": watch.data["sampler"].orders,
        "repeatable": True,  # the orders are those the sampler gave, pass by pass
        "digests": record.digests,
    }
    write_json(Path(folder, f"rank-{ctx.rank}.json"), facts)


def _loop_reference(
    ctx: DistContext,
    loop: tuple[LoopRef, tuple[Any, ...]],
    steps: int,
    dtype: str,
    folder: str,
    keys: list[list[SampleKey]],
    nproc: int,
    atol: float,
    rtol: float,
) -> dict[str, Any]:
    compare = _Compare(Path(folder), steps, atol, rtol)

    def on_step(model: nn.Module, step: int) -> None:
        if step == 0:
            compare.compare(model, 0)
            compare.mark_rng()
        else:
            compare.after_step(model, step)

    watch = _LoopWatch(Path(folder), ctx.rank, dtype, on_step, replay=(keys, nproc))
    watch.run(loop, ctx)
    return compare.result()

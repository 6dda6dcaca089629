"""Trainer: the training loop of a DDP job, with everything around it (accumulation,
mixed precision, evaluation, logging, checkpoints and exact resume).

Read `fit` top to bottom: it is the loop, over the step plan (`ddpkit.parallel.steps`)
that a hand-written loop uses too. What it shows is in `progress`, its evaluation in
`evaluation`."""

from __future__ import annotations

import contextlib
import itertools
import math
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn
from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau
from torch.utils.data import Dataset, Sampler

from ddpkit.checkpoint.pt import lock_folder
from ddpkit.context import DistContext
from ddpkit.errors import ConfigError, Preempted
from ddpkit.inrank.preemption import StopVote, ddpkit_job, saving_on_signal
from ddpkit.parallel.batches import (
    LossFn,
    MetricsFn,
    StepFn,
    count_samples,
    default_step,
    to_device,
)
from ddpkit.parallel.model import sync_buffers, unwrap
from ddpkit.parallel.precision import Precision, use_deterministic, use_tf32
from ddpkit.parallel.steps import MicroBatch, StepPlan
from ddpkit.parallel.strategy import Strategy
from ddpkit.records.runlog import RunLog
from ddpkit.seed import rank_seed, seed_everything
from ddpkit.storage import PENDING
from ddpkit.training import build
from ddpkit.training.checkpointing import Checkpoints
from ddpkit.training.config import TrainConfig
from ddpkit.training.decisions import (
    better,
    check_decisions,
    from_evaluation,
    higher_is_better,
    reported,
)
from ddpkit.training.evaluation import Evaluation
from ddpkit.training.profiling import StepProfile
from ddpkit.training.progress import (
    Bar,
    EpochSums,
    Window,
    epoch_line,
    epoch_name,
    eval_parts,
    print_line,
    start_line,
)

# Built on the parameters of the prepared model (needed with strategy "fsdp").
OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer], LRScheduler]
# Steps enter a few contexts that are mostly no-ops: share one instead of making many.
_NOTHING = contextlib.nullcontext()


class Callback:
    """Override the hooks you need; each default does nothing."""

    def on_fit_start(self, trainer: Trainer) -> None: ...
    def on_fit_end(self, trainer: Trainer, result: FitResult) -> None: ...
    def on_epoch_start(self, trainer: Trainer, epoch: int) -> None: ...
    def on_epoch_end(self, trainer: Trainer, epoch: int, metrics: dict[str, float]) -> None: ...
    def on_step_end(self, trainer: Trainer, step: int) -> None: ...
    def on_evaluate(self, trainer: Trainer, metrics: dict[str, float]) -> None: ...
    def on_checkpoint(self, trainer: Trainer, path: Path) -> None: ...

    def state_dict(self) -> dict[str, Any]:
        """What to keep in checkpoints, so a resumed run continues the same decision."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    @property
    def state_key(self) -> str:
        """The name this callback's state is kept under in checkpoints: its class's name
        (a second callback of one key gets `#1`, a third `#2`, ...). A resumed run gives
        each callback the state saved under its key, whatever callbacks were added,
        dropped or moved. Override it to tell apart callbacks of one class that a
        resumed run may reorder."""
        return type(self).__qualname__


class EarlyStopping(Callback):
    """Stop when `monitor` has not improved by `min_delta` in `patience` checks.

    It checks at each epoch's end and, with `eval_every_steps`, at each evaluation (once
    for one that is both), so that it also acts in a run by `max_steps` over data that
    never ends; every rank stops after the same step. `monitor` is any epoch metric:
    `loss`, `eval_loss`, `accuracy`, ... (at an evaluation inside an epoch, `loss` is
    the epoch's mean training loss so far). An evaluation's metric needs an eval set:
    without one the Trainer refuses it before training. With `mode="auto"`, metrics
    named like accuracy are maximised, the others minimised.
    """

    def __init__(
        self,
        monitor: str = "eval_loss",
        patience: int = 3,
        min_delta: float = 0.0,
        mode: str = "auto",
    ) -> None:
        if patience < 1:
            raise ConfigError(f"patience must be >= 1 (got {patience})")
        if mode not in ("auto", "min", "max"):
            raise ConfigError(f"mode must be 'auto', 'min' or 'max' (got {mode!r})")
        if mode == "auto":
            mode = "max" if higher_is_better(monitor) else "min"
        self.monitor, self.patience, self.min_delta, self.mode = monitor, patience, min_delta, mode
        self.best = math.inf if mode == "min" else -math.inf
        self.bad_epochs = 0
        self.stopped_epoch: int | None = None

    def on_epoch_end(self, trainer: Trainer, epoch: int, metrics: dict[str, float]) -> None:
        # Unless an evaluation at this same step was checked already (the epoch's last).
        if trainer._judged_step != trainer.global_step:
            self.check(trainer, metrics, epoch)

    def check(self, trainer: Trainer, metrics: dict[str, float], epoch: int | None = None) -> None:
        """Judge `metrics` of the step `trainer` is at: the end of `epoch`, or an
        evaluation in the epoch running (the Trainer calls it once per step)."""
        value = reported(metrics, self.monitor, "early stopping watches")
        if better(value, self.best, self.mode == "max", self.min_delta):
            self.best, self.bad_epochs = value, 0
            return
        self.bad_epochs += 1
        if self.bad_epochs >= self.patience:
            self.stopped_epoch = trainer.epoch if epoch is None else epoch
            trainer.should_stop = True
            trainer.say(
                f"early stopping after step {trainer.global_step}: {self.monitor} has not "
                f"improved in {self.patience} check(s) (best {self.best:.4g})"
            )

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "bad_epochs": self.bad_epochs}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best, self.bad_epochs = float(state["best"]), int(state["bad_epochs"])


@dataclass
class FitResult:
    """What `fit` returns (on every rank; the numbers are global, not per rank)."""

    epochs: int
    global_step: int
    samples_per_s: float
    final_loss: float
    eval: dict[str, float] = field(default_factory=dict)
    checkpoint: Path | None = None
    stopped_early: bool = False


@dataclass
class _Pass:
    """A pass over the training data under way (`Trainer._start_epoch`)."""

    epoch: int
    micro_batches: Iterator[MicroBatch]
    window: Window | None  # the step log's numbers, when someone reads them
    seen_at_start: int  # samples seen (all ranks) before the pass
    start: float = field(default_factory=time.perf_counter)
    step_samples: int = 0  # this rank's samples in the step running
    whole: bool = True  # False once an early stop or max_steps ends it inside the epoch


@dataclass
class _Totals:
    """What `fit` returns of its passes: samples and seconds trained, the last ones."""

    samples: int = 0
    seconds: float = 0.0
    loss: float = math.nan
    metrics: dict[str, float] = field(default_factory=dict)


class Trainer(Checkpoints):
    """Trains a model with DDP over all ranks of `ctx`; `fit()` runs the loop.

    Build it on every rank with the same arguments. The model is moved,
    BatchNorm-synchronised and wrapped here (`prepare_model`), and compiled with
    `config.compile`; build the optimizer on the bare model's parameters first, as in
    a one-GPU script.

    A batch may be any nesting of tensors, tuples, lists, dicts and dataclasses; it is
    moved to the device as it is. Its loss, the mean over the batch, is:

    - `training_step(model, batch)` when you give one;
    - for an `(inputs, targets)` pair, `loss_fn(model(inputs), targets)`;
    - for a dict, `model(**batch)`, which returns its own loss (`outputs.loss`,
      `outputs["loss"]` or a single number), as HuggingFace models do given labels;
    - for anything else, `model(batch)`, which returns its own loss.

    Args:
        model: the bare model.
        optimizer: its optimizer, built on the bare model's parameters; or a factory
            `params -> optimizer`, called on the prepared model's parameters (needed
            with `config.strategy == "fsdp"`, which replaces them).
        train_set: the training data; each rank trains on its own shard.
        ctx: this rank's `DistContext` (from `launch`).
        config: the run's options (epochs, batch size, precision, checkpoints, ...);
            `TrainConfig()` if None.
        loss_fn: `loss_fn(outputs, targets) -> mean loss` for `(inputs, targets)`
            batches (default: cross-entropy).
        eval_set: data evaluated after each epoch; every sample counts exactly once.
        scheduler: a learning-rate scheduler, stepped per epoch or per step
            (`config.scheduler_interval`); or a factory `optimizer -> scheduler`. A
            `ReduceLROnPlateau` steps at each evaluation instead (epoch ends and
            `config.eval_every_steps`), with the metric `config.keep_best` keeps, else
            the one early stopping watches, else `eval_loss`; it needs an eval set, and
            its `mode` must match that metric ("max" for accuracy and the like).
        train_sampler: your own sampler instead of ddpkit's DistributedSampler; it must
            shard by itself. Ranks may then get different numbers of batches (also with
            an IterableDataset); the ranks then agree on every step, so that none hangs
            and all stay identical.
        callbacks: `Callback` objects whose hooks run at fit, epoch and step events.
        collate_fn: how samples become a batch, in training and evaluation
            (DataLoader's default if None).
        training_step: `training_step(model, batch) -> mean loss`, used instead of the
            rules above, in training and in evaluation.
        metrics_fn: `metrics_fn(model, batch) -> {name: mean over the batch}`, called in
            evaluation; each is averaged over every sample of the eval set, all ranks
            together, and reported as `eval_<name>` (your "accuracy" is
            `eval_accuracy`, beside ddpkit's top-1 `accuracy`; "loss" and "samples" are
            refused, as `eval_loss` and `eval_samples` are the evaluation's own).
        log_fn: where rank 0's progress lines go (default: print).
    """

    callbacks: list[Callback]  # the job's, then EarlyStopping from the config

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | OptimizerFactory,
        train_set: Dataset[Any],
        ctx: DistContext,
        config: TrainConfig | None = None,
        *,
        loss_fn: LossFn = nn.functional.cross_entropy,
        eval_set: Dataset[Any] | None = None,
        scheduler: torch.optim.lr_scheduler.LRScheduler | SchedulerFactory | None = None,
        train_sampler: Sampler[Any] | None = None,
        callbacks: Sequence[Callback] = (),
        collate_fn: Callable[[list[Any]], Any] | None = None,
        training_step: StepFn | None = None,
        metrics_fn: MetricsFn | None = None,
        log_fn: Callable[[str], None] | None = None,
    ) -> None:
        ddpkit_job()  # under ddpkit run, a stop signal before the first step ends it with 75
        self.ctx = ctx
        self.config = config = config or TrainConfig()
        # Before anything runs on the device: cuBLAS reads its workspace setting at its
        # first call, and cuDNN its switches at the first convolution.
        if config.deterministic:
            use_deterministic()
        if config.tf32 is not None:
            use_tf32(config.tf32)
        # Chosen once: everything that depends on the strategy asks this object.
        self.strategy = Strategy(config.strategy, ctx)
        self.strategy.check_optimizer(optimizer)
        self.model, eval_model = build.models(model, config, ctx, self.strategy)
        if not isinstance(optimizer, torch.optim.Optimizer):
            optimizer = optimizer(self.model.parameters())
        self.optimizer = optimizer
        self._params = [p for group in optimizer.param_groups for p in group["params"]]
        if scheduler is not None and not isinstance(scheduler, LRScheduler):
            scheduler = scheduler(optimizer)
        self.scheduler = scheduler
        self.loss_fn = loss_fn
        self.training_step = training_step
        self.metrics_fn = metrics_fn
        self.train_loader, self.eval_loader = build.loaders(
            config, ctx, train_set, eval_set, train_sampler, collate_fn
        )
        # Autocast, fp16's loss scaling, clipping and the optimizer step: the helper a
        # hand-written loop uses.
        self.precision = Precision(config.precision, ctx)
        self._evaluation = None
        if self.eval_loader is not None:
            self._evaluation = Evaluation(
                eval_model,
                self.eval_loader,
                ctx,
                config,
                self.precision,
                self._loss,
                metrics_fn,
                pairs=training_step is None,
                strategy=self.strategy,
            )
        self._decide_with(callbacks, eval_set)
        self.log_fn = log_fn or print_line
        self._bar = Bar(config, ctx)  # the training pass's (evaluate draws its own)
        self._start_state()
        # Which micro-batches make each optimizer step, with what weight: a hand-written
        # loop's too. Over uneven shards the ranks agree on every step.
        self.plan = StepPlan(self.train_loader, self.model, config.accumulate, ctx)
        if self.plan.uneven and config.sync_batchnorm and _has_batchnorm(unwrap(self.model)):
            raise ConfigError(
                "a custom sampler or an IterableDataset can give ranks unequal numbers of "
                "batches, and synchronized BatchNorm cannot run on a rank whose data has "
                "run out while the others train: pass "
                "sync_batchnorm=False, or let ddpkit shard the data (no train_sampler)"
            )

    def _decide_with(self, callbacks: Sequence[Callback], eval_set: Dataset[Any] | None) -> None:
        """Take the callbacks (and the config's early stopping), and check what the run
        decides from its evaluations now (`check_decisions`)."""
        config = self.config
        self.callbacks = list(callbacks)
        if config.early_stopping_patience is not None:
            self.callbacks.append(
                EarlyStopping(config.early_stopping_metric, config.early_stopping_patience)
            )
        watched = [cb.monitor for cb in self.callbacks if isinstance(cb, EarlyStopping)]
        # The metric ReduceLROnPlateau steps with, at each evaluation; None for others.
        self._plateau = check_decisions(config, self.scheduler, watched, eval_set)
        # The step whose evaluation ReduceLROnPlateau and early stopping have judged: the
        # last step of an epoch may be due for two evaluations, which are one.
        self._judged_step = -1

    def _start_state(self) -> None:
        """Where a new run stands: before its first step."""
        self.epoch = 0  # the epoch running, or the next one to run
        self.batch = 0  # batches of `epoch` trained: a checkpoint mid-epoch resumes there
        self.global_step = 0
        # Training samples seen, all ranks together, after each optimizer step.
        self.samples_seen = 0
        self._sums = EpochSums(self.ctx)  # the running epoch's loss and samples
        self.should_stop = False
        self.best: float | None = None  # the best value of `config.keep_best` so far
        self._saved_step = -1  # the step of this run's newest checkpoint
        self._evaluated: tuple[int, dict[str, float]] = (-1, {})  # the newest evaluation
        self._totals = _Totals()
        self._started = False  # fit() seeds (and resumes) once; a second fit() continues
        self._resumed_step: int | None = None  # the run log drops its records after it, once
        self._resumed_inside = False  # ... and that epoch's record: it resumed inside it
        self._vote: StopVote | None = None  # agrees on a stop signal (see preemption)
        self._profile = StepProfile(self.ctx, self.config.profile, self.say)
        self.last_checkpoint: Path | None = None

    # -- the loop -------------------------------------------------------------------
    def fit(self) -> FitResult:
        """Train (or, with `config.resume`, continue) to `config.epochs` or
        `config.max_steps`. Call on every rank.

        While it runs, the job holds the lock of `config.checkpoint_dir`: a second job
        given the same folder stops with an error naming this one. With that folder, a
        stop signal (SIGTERM, SIGUSR1, Ctrl-C) to any rank or to `launch` makes every
        rank save after the same step and raise `Preempted` (`config.on_signal`).
        """
        cfg, model, device = self.config, self.model, self.ctx.device
        lock = None if cfg.checkpoint_dir is None else lock_folder(cfg.checkpoint_dir, self.ctx)
        runlog: RunLog | None = None
        try:
            self._profile.start(self.model)
            runlog = self._start()
            with saving_on_signal() if self._vote else _NOTHING:
                for epoch in self._epochs_left():
                    run = self._start_epoch(epoch, runlog)
                    try:  # the plan: which micro-batches make each step, with what weight
                        for micro in run.micro_batches:
                            batch = to_device(micro.batch, device)
                            if micro.stand_in:  # no data left here: take part, change nothing
                                model.eval()
                            with self.strategy.skip_gradient_sync(model, not micro.ends_step):
                                with self.precision.autocast():
                                    loss, _ = self._loss(model, batch)
                                # Uneven shards: the step's total over all ranks arrives
                                # while the forward runs; the backward first needs it.
                                self.precision.backward(micro.weighted(loss))
                            if micro.stand_in:
                                model.train()
                            self._tally(run, micro, loss.detach())
                            if micro.ends_step:
                                self._optimizer_step(run.window)
                                with self._profile.own():
                                    done = self._after_step(run, runlog)
                                if done:
                                    break
                    finally:  # also on Ctrl-C: no half-drawn bar left on the screen
                        self._bar.close()
                    with self._profile.own():
                        done = self._end_epoch(run, runlog)
                    if done:
                        break
                result = self._finish(runlog)
            PENDING.wait()  # its checkpoints on disk while the folder is still locked
            self._profile.finish()
            return result
        except BaseException:
            PENDING.wait(quiet=True)  # the first error stays the one raised
            raise
        finally:
            if runlog is not None:
                runlog.close()  # closed already unless an error is on its way out
            if lock is not None:
                lock.release()

    def _start(self) -> RunLog:
        """Seed (and resume) once, open the run log, and say how the run trains."""
        cfg = self.config
        if not self._started:
            # The model was built from one seed on every rank; from here on each rank
            # draws its own reproducible stream (dropout, augmentation, noise).
            seed_everything(rank_seed(cfg.seed, self.ctx.rank))
            self._started = True
            if cfg.resume:
                self._resume()  # restores every rank's own stream as it was saved
            if cfg.checkpoint_dir and cfg.on_signal == "save":
                self._vote = StopVote(self.ctx)
        # A resume from an older checkpoint trains its later steps again: their records go;
        # so does the record of the epoch it resumes inside, which it writes again.
        resumed, self._resumed_step = self._resumed_step, None
        inside = self._resumed_inside and not self._done()
        runlog = RunLog(
            cfg.run_dir,
            cfg.to_dict(),
            enabled=self.ctx.is_main,
            resumed_step=resumed,
            resumed_inside=inside,
        )
        if runlog.dropped:
            again = f" and the record of epoch {self.epoch + 1}" if inside else ""
            self.say(
                f"{cfg.run_dir}: dropped {runlog.dropped} record(s) after step {resumed}, "
                f"the step this run resumed from{again}"
            )
        if not self._done():  # else resume said why not
            self.say(start_line(cfg, self.ctx))
        if runlog.kept is not None:
            self.say(f"{cfg.run_dir} held another run's records: kept as {runlog.kept.name}")
        self._call("on_fit_start")
        self._totals = _Totals()
        return runlog

    def _epochs_left(self) -> Iterable[int]:
        """The epochs to train; none for a resumed run that had stopped early (or
        trained every step): it stays stopped."""
        if self._done():
            return ()
        limit = self.config.epoch_limit()
        return itertools.count(self.epoch) if limit is None else range(self.epoch, limit)

    def _done(self) -> bool:
        """Whether the run has nothing left to train: every epoch or step, or an early stop."""
        cfg, limit = self.config, self.config.epoch_limit()
        return (
            self.should_stop
            or (limit is not None and self.epoch >= limit)
            or (cfg.max_steps is not None and self.global_step >= cfg.max_steps)
        )

    def _start_epoch(self, epoch: int, runlog: RunLog) -> _Pass:
        """A pass over this rank's shard (or what is left of `max_steps`) begins."""
        self._call("on_epoch_start", epoch)
        self.train_loader.set_epoch(epoch)  # a new shuffle each epoch
        self.model.train()
        self._sums.start(epoch, self.samples_seen)
        # Resumed from a checkpoint written mid-epoch: the loader starts after the
        # batches it had trained (`_resume`).
        skip, total = self.train_loader.next_pass()
        # A run by steps counts steps of max_steps; one by epochs, the epoch's batches.
        steps = self.config.max_steps

        def bar(batch_iter: Iterator[Any]) -> Iterable[Any]:
            return self._bar.wrap(
                batch_iter,
                epoch_name(self.config, epoch),
                total if steps is None else steps,
                initial=skip if steps is None else self.global_step,
                per_step=steps is not None,
            )

        # Step logs cost a host sync each; keep their window only if someone reads it.
        window = None
        if runlog.active or self._bar.shown():
            window = Window(self.ctx.device, self.ctx.world_size)
        return _Pass(epoch, self.plan.micro_batches(bar), window, self.samples_seen)

    def _tally(self, run: _Pass, micro: MicroBatch, loss: torch.Tensor) -> None:
        """Add a micro-batch's loss and samples to the epoch's sums; at a step's end,
        the step's samples (all ranks) and where a checkpoint written now resumes."""
        if not micro.stand_in:
            n = count_samples(micro.batch)
            self._sums.add(loss, n)
            run.step_samples += n
            if run.window is not None:
                run.window.add(loss, n)
        if micro.ends_step:
            self.batch = micro.position
            # Agreed on shards of unequal length (already read), else as many on every rank.
            agreed = micro.step_samples
            world = self.ctx.world_size
            self.samples_seen += run.step_samples * world if agreed is None else agreed
            run.step_samples = 0

    def _end_epoch(self, run: _Pass, runlog: RunLog) -> bool:
        """The pass is over: log, evaluate, judge and checkpoint the epoch; whether the
        run is done."""
        cfg, device, epoch = self.config, self.ctx.device, run.epoch
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # time the GPU's work, not just its queueing
        seconds = time.perf_counter() - run.start
        # One collective for the epoch's log, run by every rank (all ranks end together).
        total_loss, n = self._sums.reduce()
        trained = self._sums.seen_before + n - run.seen_at_start
        self._totals.samples += trained
        self._totals.seconds += seconds
        self._totals.loss = loss = total_loss / max(n, 1)
        self.samples_seen = self._sums.seen_before + n
        # A run by steps may end inside an epoch, which a resume then continues.
        if run.whole:
            self.epoch, self.batch = epoch + 1, 0
            # ReduceLROnPlateau steps at each evaluation instead (`_step_plateau`).
            if self.scheduler and cfg.scheduler_interval == "epoch" and self._plateau is None:
                self.scheduler.step()
        # The whole epoch's loss and samples, also when this run resumed inside it; the
        # rate of what this run trained.
        metrics: dict[str, float] = {
            "loss": loss,
            "samples": int(n),
            "samples_per_s": trained / max(seconds, 1e-9),
            "lr": self._lr(),
            "samples_seen": self.samples_seen,
        }
        if self.eval_loader is not None:
            metrics.update(self._evaluate_once())
        self._totals.metrics = metrics
        runlog.write("epoch", self.global_step, {"epoch": epoch + 1, **metrics})
        self.say(epoch_line(cfg, epoch, self.global_step, seconds, metrics))
        if self._judged_step != self.global_step:  # else judged as it evaluated
            self._step_plateau(metrics)
        self._call("on_epoch_end", epoch, metrics)  # early stopping checks here
        self._judged_step = self.global_step  # all before the checkpoint holds it
        improved = self._new_best(metrics)  # before the checkpoint that keeps it
        last = self._done()
        if cfg.checkpoint_dir and (
            last or (run.whole and cfg.save_every and self.epoch % cfg.save_every == 0)
        ):
            self.save()
        if improved:
            self._keep_best()
        self._profile.epoch_end(self.global_step, runlog)
        return last

    def _finish(self, runlog: RunLog) -> FitResult:
        signum = self._vote.close() if self._vote is not None else 0
        if signum:  # after the last step: its checkpoint is the one to resume from
            raise Preempted(self._checkpoint_now(), self.global_step, signum)
        # Without synchronized BatchNorm (or under FSDP, which never broadcasts buffers)
        # each rank's running statistics drifted: end with rank 0's.
        sync_buffers(self.model, self.ctx)
        runlog.close()
        totals = self._totals
        result = FitResult(
            epochs=self.epoch,
            global_step=self.global_step,
            samples_per_s=totals.samples / totals.seconds if totals.seconds else 0.0,
            final_loss=totals.loss,
            eval={k: v for k, v in totals.metrics.items() if from_evaluation(k)},
            checkpoint=self.last_checkpoint,
            stopped_early=self.should_stop,
        )
        self._call("on_fit_end", result)
        return result

    def _after_step(self, run: _Pass, runlog: RunLog) -> bool:
        """What follows an optimizer step: its log line, evaluation, checkpoint and stop
        vote; whether the pass ends here (an early stop, or `max_steps` reached)."""
        cfg, window = self.config, run.window
        if window is not None and self.global_step % cfg.log_every == 0:
            # Before this step's checkpoint: a run that ends right after it resumes with
            # the next step, and the line would be lost. One host sync per log interval,
            # on rank 0 only: no rank waits for another.
            values = window.flush()
            values.update(epoch=run.epoch, lr=self._lr(), samples_seen=self.samples_seen)
            runlog.write("step", self.global_step, values)
        if self.callbacks:
            self._call("on_step_end", self.global_step)
        # Evaluated before this step's checkpoint, so that the checkpoint holds the best
        # (and every callback's state) as of this evaluation: a resume from it goes on
        # from there, and never takes a worse step for the best.
        every = cfg.eval_every_steps
        improved = False
        if every and self.eval_loader is not None and self.global_step % every == 0:
            evaluation = self._evaluate_once()
            runlog.write("eval", self.global_step, {"epoch": run.epoch, **evaluation})
            self.say(" | ".join([f"step {self.global_step}", *eval_parts(evaluation)]))
            # Judged as at an epoch's end, the training loss by the same name: the
            # epoch's mean so far (at the epoch's last step, the epoch line's).
            total, n = self._sums.reduce()  # a collective, as every rank evaluates
            metrics = {"loss": total / max(n, 1), **evaluation}
            improved = self._new_best(metrics)
            self._step_plateau(metrics)
            for stopper in self.callbacks:
                if isinstance(stopper, EarlyStopping):
                    stopper.check(self, metrics)
            self._judged_step = self.global_step
        saves = cfg.save_every_steps
        if saves and cfg.checkpoint_dir and self.global_step % saves == 0:
            self.save()  # every rank, after the same step
        if improved:
            self._keep_best()
        self._bar.step_done(window)
        signum = self._vote.step() if self._vote is not None else 0
        if signum:  # every rank, after this same step
            raise Preempted(self._checkpoint_now(), self.global_step, signum)
        # On every rank: an early stop is decided from numbers of all ranks.
        steps = cfg.max_steps
        run.whole = not (self.should_stop or (steps is not None and self.global_step >= steps))
        return not run.whole

    def _optimizer_step(self, window: Window | None) -> None:
        prec, norm = self.precision, None
        if self.config.clip_grad_norm is not None:  # of the true (unscaled) gradient
            norm = prec.clip_gradients(self._params, self.optimizer, self.config.clip_grad_norm)
        elif self._logs_grad_norm(window):
            prec.unscale_gradients(self.optimizer)  # log the true gradient's norm
            norm = self.strategy.gradient_norm(self._params)
        if window is not None and norm is not None:
            window.grad_norm = norm
        prec.step(self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)
        if self.scheduler is not None and self.config.scheduler_interval == "step":
            self.scheduler.step()
        self.global_step += 1

    def _logs_grad_norm(self, window: Window | None) -> bool:
        """Whether this rank computes this step's gradient norm for the run log: rank 0's
        window wants it, and under FSDP (a collective) every rank computes it when the
        config, which every rank shares, keeps a run log."""
        if (self.global_step + 1) % self.config.log_every:
            return False
        return self.strategy.takes_part(window is not None, self.config.run_dir is not None)

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Exact loss (and accuracy for class logits) over the whole eval set.

        Each sample is counted once (no padding), so ranks may hold one batch more than
        others. With DDP they run no collective per batch; under FSDP every forward
        gathers parameters, so a rank with fewer batches runs a stand-in batch through
        the same forwards (the loss's and metrics_fn's), uncounted. Call on every rank.
        """
        if self._evaluation is None:
            raise ConfigError("evaluate() needs an eval_set: pass Trainer(..., eval_set=...)")
        sync_buffers(self.model, self.ctx)  # rank 0's BatchNorm statistics on every rank
        metrics = self._evaluation.run()
        self._call("on_evaluate", metrics)
        return metrics

    def _step_plateau(self, metrics: dict[str, float]) -> None:
        """Step a ReduceLROnPlateau with its metric (`check_decisions`)."""
        name = self._plateau
        if name is None:
            return
        value = reported(
            metrics, name, "ReduceLROnPlateau steps with", "keep the best by one of those"
        )
        cast(ReduceLROnPlateau, self.scheduler).step(value)

    def _evaluate_once(self) -> dict[str, float]:
        """`evaluate()`, unless it already ran after this step (the last of a run by
        steps is due for both evaluations): then what it gave."""
        if self._evaluated[0] != self.global_step:
            with self._profile.outside():
                self._evaluated = self.global_step, self.evaluate()
        return self._evaluated[1]

    # -- pieces of a step -------------------------------------------------------------
    def _loss(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, Any]:
        """(mean loss of `batch`, the model's outputs or None): see the class docstring."""
        if self.training_step is not None:
            return self.training_step(model, batch), None
        return default_step(model, batch, self.loss_fn)

    def _lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def _call(self, hook: str, *args: Any) -> None:
        for cb in self.callbacks:
            getattr(cb, hook)(self, *args)

    # -- output (rank 0 only; never wraps a collective) ------------------------------
    def say(self, text: str) -> None:
        if self.ctx.is_main:
            self.log_fn(text)


def _has_batchnorm(model: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())

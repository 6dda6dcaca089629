"""What a run shows while it trains: rank 0's progress lines, the progress bar, the
window of numbers behind the step log, and the epoch's sums behind the epoch's record.
Only `EpochSums` runs collectives."""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any, cast

import torch

from ddpkit.context import DistContext
from ddpkit.parallel.ranks import all_gather, reduce_sums
from ddpkit.training.config import TrainConfig

# Seconds between updates of the progress bar's loss (each costs a host sync).
BAR_SECONDS = 1.0


class Window:
    """Loss, samples and time since the last step log, kept on the device. Step logs
    are rank 0's own numbers (no collective); samples/s assumes equal shards."""

    def __init__(self, device: torch.device, world_size: int) -> None:
        self.loss = torch.zeros((), device=device)
        self.world_size = world_size
        self.samples = 0
        self.start = time.perf_counter()
        self.grad_norm: torch.Tensor | None = None
        self.last = (math.nan, 0.0)  # what peek() gives before the first batch

    def add(self, loss: torch.Tensor, n: int) -> None:
        self.loss.add_(loss.float(), alpha=n)
        self.samples += n

    def peek(self) -> tuple[float, float]:
        """(mean loss, samples/s) since the last flush, or as of it when none since."""
        if self.samples:
            seconds = max(time.perf_counter() - self.start, 1e-9)
            self.last = float(self.loss) / self.samples, self.samples * self.world_size / seconds
        return self.last

    def flush(self) -> dict[str, Any]:
        now = time.perf_counter()
        values: dict[str, Any] = {
            "loss": float(self.loss) / max(self.samples, 1),
            "samples_per_s": self.samples * self.world_size / max(now - self.start, 1e-9),
            "grad_norm": None if self.grad_norm is None else float(self.grad_norm),
        }
        self.last = values["loss"], values["samples_per_s"]
        self.loss.zero_()
        self.samples, self.start, self.grad_norm = 0, now, None
        return values


class EpochSums:
    """The running epoch's sums on this rank: its training loss times samples, and its
    samples, kept on the device (calling .item() each step would stall the GPU). A
    checkpoint written inside the epoch keeps every rank's (`gather`), so that the
    epoch's record after a resume covers all of it (`resume`)."""

    def __init__(self, ctx: DistContext) -> None:
        self.ctx = ctx
        self.loss = torch.zeros((), device=ctx.device)
        self.count = 0
        self.epoch: int | None = None  # the epoch they are of
        self.seen_before = 0  # samples seen (all ranks) before that epoch

    def start(self, epoch: int, seen: int) -> None:
        """Epoch `epoch` begins, after `seen` samples; unless these are its sums already
        (resumed, or continued by a second `fit`, inside it): then they go on."""
        if self.epoch != epoch:
            self.loss = torch.zeros((), device=self.ctx.device)
            self.count, self.epoch, self.seen_before = 0, epoch, seen

    def add(self, loss: torch.Tensor, n: int) -> None:
        self.loss.add_(loss.float(), alpha=n)
        self.count += n

    def reduce(self) -> tuple[float, int]:
        """(loss times samples, samples) of the epoch so far, all ranks (a collective)."""
        total, n = reduce_sums([self.loss, self.count], self.ctx)
        return total, int(n)

    def gather(self) -> list[list[float]]:
        """Every rank's sums, [loss times samples, samples] by rank (a collective: every
        rank calls it). float32 sums as float64: exact."""
        count = torch.tensor(self.count, dtype=torch.float64, device=self.ctx.device)
        mine = torch.stack([self.loss.double(), count])
        return [[float(loss), int(n)] for loss, n in all_gather(mine).tolist()]

    def resume(self, sums: list[list[float]] | None, epoch: int, seen: int) -> None:
        """Go on with the sums of `epoch` that a checkpoint written inside it keeps
        (`gather`), the run having seen `seen` samples: on as many ranks as saved, each
        rank its own, so the epoch's record is bit for bit the uninterrupted run's; on
        another number, rank 0 holds them all (the same samples, the loss up to the
        order of the float sums). Without them (an older checkpoint), the epoch's
        record covers what this run trains of it."""
        if not sums:
            return
        ctx = self.ctx
        if len(sums) == ctx.world_size:
            loss, n = sums[ctx.rank]
        else:
            mine = ctx.is_main
            loss, n = (sum(s[0] for s in sums), sum(s[1] for s in sums)) if mine else (0.0, 0.0)
        self.loss = torch.tensor(loss, dtype=torch.float32, device=ctx.device)
        self.count, self.epoch = int(n), epoch
        self.seen_before = seen - int(sum(s[1] for s in sums))


class Bar:
    """A progress bar, drawn on rank 0 when `config.progress` asks for one (by
    default: when stdout is a terminal)."""

    def __init__(self, config: TrainConfig, ctx: DistContext) -> None:
        self.config, self.ctx = config, ctx
        self.tqdm: Any = None
        self.per_step = False  # it counts optimizer steps, not the batches it wraps
        self.due = 0.0

    def wrap(
        self,
        batches: Iterable[Any],
        desc: str,
        total: int | None,
        initial: int = 0,
        *,
        per_step: bool = False,
    ) -> Iterable[Any]:
        """`batches`, drawn as the bar. `per_step`: the bar counts the optimizer steps
        that `step_done` reports, and `batches` is returned as it is."""
        self.tqdm, self.per_step = None, per_step
        if not self.shown():
            return batches
        from tqdm import tqdm

        self.due = time.perf_counter() + BAR_SECONDS
        self.tqdm = tqdm(
            None if per_step else batches,
            desc=desc,
            total=total,
            initial=initial,  # a resumed epoch shows the batches it had trained
            leave=False,
            dynamic_ncols=True,
        )
        return batches if per_step else cast(Iterable[Any], self.tqdm)

    def shown(self) -> bool:
        """Whether this rank draws the bar."""
        show = self.config.progress
        if show is None:
            show = sys.stdout.isatty()
        return bool(show and self.ctx.is_main)

    def step_done(self, window: Window | None) -> None:
        """After an optimizer step: count it (`per_step`), and show the loss and rate
        (a host sync, so at most once a second)."""
        if self.tqdm is None:
            return
        if self.per_step:
            self.tqdm.update()
        if window is not None and time.perf_counter() >= self.due:
            loss, rate = window.peek()
            self.tqdm.set_postfix(loss=f"{loss:.4f}", samples_s=f"{rate:,.0f}", refresh=False)
            self.due = time.perf_counter() + BAR_SECONDS

    def close(self) -> None:
        if self.tqdm is not None:
            self.tqdm.close()  # leave=False: the bar is erased
            self.tqdm = None


def epoch_name(config: TrainConfig, epoch: int) -> str:
    """ "epoch 3/10"; "epoch 3" when only max_steps ends the run."""
    limit = config.epoch_limit()
    return f"epoch {epoch + 1}" + ("" if limit is None else f"/{limit}")


def epoch_line(
    config: TrainConfig, epoch: int, step: int, seconds: float, metrics: dict[str, float]
) -> str:
    """An epoch's line: its loss, rate, time and evaluation."""
    parts = [epoch_name(config, epoch)]
    if config.max_steps is not None:
        parts.append(f"step {step}/{config.max_steps}")
    parts += [
        f"loss {metrics['loss']:.4f}",
        f"{metrics['samples_per_s']:,.0f} samples/s",
        f"{seconds:.2f}s",
        *eval_parts(metrics),
    ]
    return " | ".join(parts)


def start_line(config: TrainConfig, ctx: DistContext) -> str:
    """How the run trains, in one line: processes, device, precision, batches, folders."""
    cfg = config
    per_step = cfg.batch_size * cfg.accumulate * ctx.world_size
    how = f"{cfg.batch_size} per rank"
    if cfg.accumulate > 1:
        how += f" x {cfg.accumulate} accumulated"
    procs = f"{ctx.world_size} process{'es' if ctx.world_size > 1 else ''}"
    parts = [
        f"training: {procs} ({ctx.backend}, {ctx.device.type})",
        f"{cfg.strategy}",
        f"precision {cfg.precision}",
        f"batch {how}, {per_step} per step",
        f"checkpoints {cfg.checkpoint_dir or 'off (no --checkpoint-dir)'}",
    ]
    if cfg.run_dir:
        parts.append(f"run log {cfg.run_dir}")
    return ", ".join(parts)


def resume_line(
    config: TrainConfig, path: Path, epoch: int, batch: int, step: int, stopped: bool
) -> str:
    """Where a run resumed from checkpoint `path` goes on (`epoch` to run, `batch` of it
    done, `step`), or why it has nothing to do."""
    epochs, steps = config.epoch_limit(), config.max_steps
    if stopped:
        done = f"stopped early after epoch {epoch}"
    elif steps is not None and step >= steps:
        done = f"has trained {step} steps, of {steps} asked for"
    elif epochs is not None and epoch == epochs:
        done = f"finished all {epochs} epochs"
    elif epochs is not None and epoch > epochs:
        done = f"has trained {epoch} epochs, more than the {epochs} asked for"
    else:
        where = f" after batch {batch}" if batch else ""
        return f"resumed from {path} at epoch {epoch + 1}{where} (step {step})"
    return f"nothing to do: {path} {done}"


def eval_parts(metrics: dict[str, float]) -> list[str]:
    """The evaluation's numbers for a log line: eval_loss, the metrics_fn's, accuracy."""
    parts = [
        f"{name} {value:.4f}"
        for name, value in metrics.items()
        if name.startswith("eval_") and name != "eval_samples"
    ]
    if "accuracy" in metrics:
        parts.append(f"accuracy {metrics['accuracy']:.2%}")
    return parts


def print_line(text: str) -> None:
    """Where rank 0's lines go by default."""
    print(text, flush=True)

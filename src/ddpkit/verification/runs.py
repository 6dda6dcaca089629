"""What both checks' runs share: the arguments they accept, the job built the way
`ddpkit train` builds it, a `Trainer` stopped after a given step, and snapshots of the
model's state (with the means to walk and compare nested states)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import Any, cast

import torch
from torch import nn
from torch.utils.data import Dataset, Sampler

from ddpkit.context import DistContext
from ddpkit.errors import ConfigError
from ddpkit.parallel.batches import map_tensors
from ddpkit.parallel.fsdp import gathered
from ddpkit.parallel.model import unwrap
from ddpkit.processes.machine import under_torchrun
from ddpkit.training.config import TrainConfig
from ddpkit.training.job import Job, JobRef, build_job
from ddpkit.training.jobspec import load_function
from ddpkit.training.trainer import Callback, Trainer

DEFAULT_STEPS = 8
LogFn = Callable[[str], None] | None
# A training loop written by hand, `main(ctx)`, or "MODULE:FUNCTION" / "file.py:FUNCTION".
LoopRef = Callable[[DistContext], Any] | str


def resolve_loop(loop: LoopRef) -> Callable[[DistContext], Any]:
    """The loop function that `loop` is or names (loaded as `--job` specs are)."""
    if callable(loop):
        return loop
    try:
        return cast(Callable[[DistContext], Any], load_function(loop)[0])
    except ConfigError as exc:  # the loader's words are a job's: say them of a loop
        text = str(exc).replace("--job", "--loop").replace(":build", ":main")
        text = text.replace("build(ctx) returns a ddpkit.Job", "main(ctx) trains")
        raise ConfigError(text) from None


def check_args(config: TrainConfig | None, nproc: int, steps: int, minimum: int) -> TrainConfig:
    """Reject what no check can run; return `config` without the options that write
    files, resume or stop early (each check sets those itself)."""
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


def resume_cut(steps: int) -> int:
    """Where the resume check stops and resumes: about half way, at an odd step, so that
    state the checkpoint misses cannot hide behind a period that divides the cut (a
    StepLR of step_size 2 restarted at step 4 happens to keep the same learning rates)."""
    half = steps // 2
    return half if half % 2 or half + 1 >= steps else half + 1


# -- the job, built the way `ddpkit train` builds it ------------------------------------
def build(ctx: DistContext, job: JobRef, config: TrainConfig, dtype: str) -> tuple[Job, int]:
    """The job as `ddpkit train` builds it, its model promoted to float64 if asked
    (`promote_data` does the same for data), with Dropout switched off (one process
    cannot draw the random masks that N ranks draw); returns how many Dropout layers
    were switched off."""
    built = build_job(ctx, job, config)
    if dtype == "float64":
        # In place: the optimizer keeps pointing at the same Parameter objects.
        built.model.double()
    switched = 0
    for module in built.model.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0:
            module.p, switched = 0.0, switched + 1
    return built, switched


def make_trainer(
    ctx: DistContext,
    job: Job,
    config: TrainConfig,
    callbacks: Sequence[Callback],
    sampler: Sampler[Any] | None = None,
) -> Trainer:
    """The job's `Trainer`, silent and without evaluation, with `callbacks` added."""
    # Ours run after the job's callbacks (they may stop the run); no evaluation: the
    # eval set is not promoted to float64, and it changes nothing that is compared.
    return job.trainer(
        ctx, config, callbacks=callbacks, train_sampler=sampler, evaluate=False, log_fn=silent
    )


def promote_data(data: Dataset[Any], dtype: str) -> Dataset[Any]:
    """`data` with floating-point tensors promoted to float64 if `dtype` says so."""
    return _Float64(data) if dtype == "float64" else data


class _Float64(Dataset[Any]):
    """The job's dataset with floating-point tensors promoted to float64."""

    def __init__(self, data: Dataset[Any]) -> None:
        self.data = data

    def __len__(self) -> int:
        return len(self.data)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> Any:
        return _promote(self.data[index])


def _promote(item: Any) -> Any:
    return map_tensors(item, lambda t: t.double() if t.is_floating_point() else t)


def silent(_: str) -> None:
    """A `log_fn` that prints nothing."""


# -- stopping after a step --------------------------------------------------------------
class Stop(Exception):
    """Raised on every rank after the same step, to end `fit` there."""


def fit(trainer: Trainer) -> None:
    """`trainer.fit()`, ended early by `Stop`."""
    with contextlib.suppress(Stop):
        trainer.fit()


# -- state ------------------------------------------------------------------------------
def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    """A copy on the CPU of the unwrapped model's state dict; a sharded model's shards
    are gathered (a collective: every rank calls it)."""
    return {k: whole(v) for k, v in unwrap(model).state_dict().items()}


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """A copy on the CPU of `tensor`; of a shard (FSDP's DTensor), the whole tensor (a
    collective)."""
    return gathered(tensor).detach().cpu().clone()


def leaves(obj: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted name, value) for every tensor or plain value in a nested state."""
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield from leaves(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(obj, (list, tuple)) and any(
        isinstance(v, (dict, list, tuple, torch.Tensor)) for v in obj
    ):
        for i, value in enumerate(obj):
            yield from leaves(value, f"{prefix}.{i}")
    else:
        yield prefix, obj


def same(a: Any, b: Any) -> bool:
    """Equal values; for tensors, the same dtype, shape and bits."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a, b)
        )
    return bool(a == b)

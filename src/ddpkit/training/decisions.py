"""What a run keeps of its callbacks in a checkpoint, and how it judges a metric: the
Trainer's bookkeeping around its decisions (the best, early stopping, ReduceLROnPlateau)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from torch.optim.lr_scheduler import ReduceLROnPlateau
from torch.utils.data import Dataset

from ddpkit.errors import CheckpointError, ConfigError
from ddpkit.training.config import TrainConfig


class Stateful(Protocol):
    """What a checkpoint keeps of a callback (`ddpkit.Callback` has all three)."""

    @property
    def state_key(self) -> str: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def callback_keys(callbacks: Sequence[Stateful]) -> list[str]:
    """Each callback's key in a checkpoint: its `state_key`, then `#1`, `#2`, ... for
    the second, third, ... callback of the same key."""
    seen: dict[str, int] = {}
    keys = []
    for cb in callbacks:
        key = cb.state_key
        seen[key] = n = seen.get(key, -1) + 1
        keys.append(f"{key}#{n}" if n else key)
    return keys


def callback_states(callbacks: Sequence[Stateful]) -> dict[str, dict[str, Any]]:
    """What a checkpoint keeps of `callbacks`: each one's state under its key."""
    return {
        key: cb.state_dict() for key, cb in zip(callback_keys(callbacks), callbacks, strict=True)
    }


def load_callback_states(callbacks: Sequence[Stateful], saved: Any, path: Path) -> list[str]:
    """Give each of `callbacks` the state checkpoint `path` keeps under its key (one
    with none starts afresh); return the keys of saved states that no callback took.

    An older checkpoint keeps a list by position: its states that hold something go,
    in order, to the callbacks whose state holds something, where they pair up one for
    one with the same names in each pair; otherwise CheckpointError."""
    if isinstance(saved, list):
        saved = _by_position(callbacks, saved, path)
    saved = dict(saved or {})
    keys = callback_keys(callbacks)
    for key, cb in zip(keys, callbacks, strict=True):
        if key in saved:
            cb.load_state_dict(saved[key])
    return [key for key, state in saved.items() if state and key not in keys]


def _by_position(
    callbacks: Sequence[Stateful], saved: list[Any], path: Path
) -> dict[str, dict[str, Any]]:
    """An older checkpoint's list of callback states, keyed as `load_callback_states`
    says it may be."""
    states = [s for s in saved if s]
    keyed = [
        (k, cb.state_dict()) for k, cb in zip(callback_keys(callbacks), callbacks, strict=True)
    ]
    takers = [(key, state) for key, state in keyed if state]
    if len(states) != len(takers) or any(
        set(state) != set(mine) for state, (_, mine) in zip(states, takers, strict=True)
    ):
        raise CheckpointError(
            f"{path} keeps its callbacks' states by position (an older ddpkit), and this "
            "run's callbacks do not match them: resume once with the callbacks that saved "
            "it, in the same order (its next checkpoints keep them by name)"
        )
    return {key: state for (key, _), state in zip(takers, states, strict=True)}


def reported(
    metrics: dict[str, float], name: str, decider: str, fix: str = "choose one of those"
) -> float:
    """`metrics[name]`, which `decider` ("keep_best watches", ...) decides by; if this
    run does not report it, a ConfigError that names what it reports and `fix`."""
    if name not in metrics:
        raise ConfigError(
            f"{decider} {name!r}, which this run does not report (it has: "
            f"{', '.join(sorted(metrics))}): {fix}"
        )
    return metrics[name]


def better(value: float, than: float, higher: bool, margin: float = 0.0) -> bool:
    """Whether `value` beats `than` by more than `margin` (a NaN never does)."""
    return value > than + margin if higher else value < than - margin


def higher_is_better(metric: str) -> bool:
    """Whether a larger `metric` is better: accuracy and the like; a loss is not."""
    return any(w in metric for w in ("acc", "f1", "auc", "precision"))


def check_decisions(
    config: TrainConfig,
    scheduler: object,
    watched: Sequence[str],
    eval_set: Dataset[Any] | None,
) -> str | None:
    """Check what a run decides from its evaluations (the best, early stopping watching
    the metrics `watched`, a ReduceLROnPlateau `scheduler`) before it trains, not when
    the first epoch ends (before its checkpoint) and finds nothing to decide from.
    Return the metric a ReduceLROnPlateau steps with, at each evaluation: the one the
    run keeps its best by, else the first that early stopping watches, else the eval
    loss (None for any other scheduler)."""
    best = config.keep_best or ""
    if eval_set is None and from_evaluation(best):
        raise ConfigError(
            f"keep_best={best!r} is an evaluation's metric and this job has no eval set: "
            "give the job an eval_set, or keep the best by 'loss'"
        )
    for monitor in watched:
        if eval_set is None and from_evaluation(monitor):
            raise ConfigError(
                f"early stopping watches {monitor!r}, an evaluation's metric, and "
                "this job has no eval set: give the job an eval_set, or watch 'loss' "
                "(--early-stopping-metric loss)"
            )
    if not isinstance(scheduler, ReduceLROnPlateau):
        return None
    name = config.keep_best or (watched[0] if watched else None) or "eval_loss"
    if eval_set is None:
        raise ConfigError(
            f"ReduceLROnPlateau steps at each evaluation, with {name}, and this job has no "
            "eval set: give the job an eval_set, or use another scheduler"
        )
    if config.scheduler_interval != "epoch":
        raise ConfigError(
            f"ReduceLROnPlateau steps at each evaluation, with {name}, not after each "
            "optimizer step: leave scheduler_interval at 'epoch'"
        )
    mode = "max" if higher_is_better(name) else "min"
    if scheduler.mode != mode:
        raise ConfigError(
            f"ReduceLROnPlateau(mode={scheduler.mode!r}) would step with {name!r}, which is "
            f"better {'higher' if mode == 'max' else 'lower'}: pass mode={mode!r}"
        )
    return name


def from_evaluation(metric: str) -> bool:
    """Whether `metric` is one only an evaluation reports (a metrics_fn's are eval_*)."""
    return metric.startswith("eval_") or metric == "accuracy"

"""What both checks' runs share: the arguments they accept, the job built the way
`ddpkit train` builds it, a `Trainer` stopped after a given step, and snapshots of the
model's state (with the means to walk and compare nested states)."""

from __future__ import annotations

import ast
import contextlib
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn
from torch.utils.data import Dataset, Sampler

from ddpkit.context import DistContext
from ddpkit.errors import ConfigError
from ddpkit.parallel.batches import map_tensors
from ddpkit.parallel.fsdp import gathered
from ddpkit.parallel.strategy import Strategy
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


def script_loop_args(loop: str, argv: Sequence[str]) -> tuple[Any, ...] | None:
    """What `main` gets after `ctx` when its file runs as `python FILE ARGV...`: the
    arguments its `if __name__ == "__main__":` block passes to `ddpkit.launch(main, ...)`
    (an argparse namespace, or values read from it). The block runs in this process,
    with `argv` as its command line, up to that call, which starts nothing. None when
    the block does not call `launch(main, ...)`: then `argv` is main's own arguments.

    Raises:
        ConfigError: the block calls `main(...)` itself (verify passes `ctx` first, as
            launch does), its own parser refused `argv`, or it ended before the call.
    """
    fn = resolve_loop(loop)
    path, name = fn.__code__.co_filename, fn.__name__
    try:
        tree = ast.parse(Path(path).read_text(), path)
    except (OSError, SyntaxError, ValueError):
        return None  # not a file of Python source: main's own arguments, then
    launches, direct = [], []
    for block in tree.body:
        if isinstance(block, ast.If) and _is_main_test(block.test):
            for node in ast.walk(block):
                if isinstance(node, ast.Call) and _names(node.func, name):
                    direct.append(node)
                elif (
                    isinstance(node, ast.Call)
                    and _names(node.func, "launch", attribute=True)
                    and node.args
                    and _names(node.args[0], name)
                ):
                    launches.append(node)
    if not launches:
        if direct:
            raise ConfigError(
                f"{path}:{direct[0].lineno} calls {name}(...) itself, and verify --loop "
                f"calls {name}(ctx, ...) as ddpkit.launch does: call "
                f"ddpkit.launch({name}, ...) there"
            )
        return None
    for call in launches:  # the call starts nothing: it hands its arguments over
        call.func = ast.copy_location(ast.Name("__ddpkit_launched__", ast.Load()), call.func)
    code = compile(ast.fix_missing_locations(tree), path, "exec")
    scope = {"__name__": "__main__", "__file__": path, "__ddpkit_launched__": _launched}
    saved = sys.argv
    sys.argv = [path, *argv]
    try:
        exec(code, scope)
    except _Launched as launched:
        return launched.args
    except SystemExit as exc:  # its parser printed why (or its --help)
        raise ConfigError(
            f"{path} stopped with status {exc.code} on the command line "
            f"{' '.join(argv)!r}: pass after --loop {loop} what python {path} takes"
        ) from None
    finally:
        sys.argv = saved
    raise ConfigError(
        f"the __main__ block of {path} ended without calling ddpkit.launch({name}, ...) on "
        f"the command line {' '.join(argv)!r}: pass the arguments that make it train"
    )


class _Launched(Exception):
    """Ends a script's `__main__` block at its `launch(main, ...)`, with main's arguments."""


def _launched(fn: Any, *args: Any, **_: Any) -> None:
    raise _Launched(*args)


def _is_main_test(test: ast.expr) -> bool:
    """`__name__ == "__main__"`, either way round."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1):
        return False
    sides = [test.left, test.comparators[0]]
    return isinstance(test.ops[0], ast.Eq) and any(_names(s, "__name__") for s in sides)


def _names(node: ast.expr, name: str, *, attribute: bool = False) -> bool:
    """`node` is the name `name` (with `attribute`, also `anything.name`)."""
    if isinstance(node, ast.Name):
        return node.id == name
    return attribute and isinstance(node, ast.Attribute) and node.attr == name


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
    """The job as `ddpkit train` builds it, its model made comparable
    (`comparable_model`); returns how many Dropout layers were switched off."""
    built = build_job(ctx, job, config)
    return built, comparable_model(built.model, dtype)


def comparable_model(model: nn.Module, dtype: str) -> int:
    """Promote `model` to float64 if `dtype` asks (`promote_data` does the same for
    data) and switch its Dropout off (one process cannot draw the random masks that N
    ranks draw); how many Dropout layers were switched off."""
    if dtype == "float64":
        # In place: an optimizer built before keeps pointing at the same Parameters.
        model.double()
    switched = 0
    for module in model.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0:
            module.p, switched = 0.0, switched + 1
    return switched


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
    full = Strategy.of(model, DistContext.current()).full_state(model)
    return {k: v.detach().cpu().clone() for k, v in full.items()}


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """A copy on the CPU of `tensor`; of a shard (FSDP's DTensor, in an optimizer's
    state too), the whole tensor (a collective)."""
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

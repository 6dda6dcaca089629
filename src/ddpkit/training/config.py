"""TrainConfig: every option of a training run, and the one place that checks them.

Each field declares its type (`int`, `float`, `str`, `bool`, `X | None`, a `Literal`
of strings, or a `Sequence` of such strings: a list, stored as a tuple) and, in its
metadata, its `help` and its range (`ge`, `gt`). A value is checked by `check_option`
however it arrives: `TrainConfig(...)` in Python, a TOML file or a job's `DEFAULTS`
(`validate_options`), or a command-line flag (`parse_option`), so a bad value gets the
same message from each.

It imports nothing heavy, so the command line can build its flags from it without
loading torch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from ddpkit.errors import ConfigError

__all__ = [
    "LOGGERS",
    "LoggerName",
    "TrainConfig",
    "check_option",
    "describe",
    "field_type",
    "parse_option",
    "validate_options",
]


# What `loggers` may name, besides the metrics.jsonl that every run folder gets.
LoggerName = Literal["csv", "tensorboard", "mlflow", "wandb"]
LOGGERS: tuple[LoggerName, ...] = typing.get_args(LoggerName)


def _opt(
    default: Any,
    help: str,
    *,
    ge: float | None = None,
    gt: float | None = None,
    example: Any = None,
) -> Any:
    """A field with its `--help` text, its range, and the value an error suggests
    (`example`, else the default)."""
    return field(default=default, metadata={"help": help, "ge": ge, "gt": gt, "example": example})


@dataclass(frozen=True)
class TrainConfig:
    """Every option of a training run, checked when it is constructed.

    Each option is also a flag of `ddpkit train` (`batch_size` is `--batch-size`) and a
    key of the TOML file that `--config` reads. A bad value raises `ConfigError`.
    """

    epochs: int | None = _opt(
        None,
        "epochs to train (with --max-steps: as many as it takes)",
        ge=1,
        example=10,
    )
    """Passes over the training data: 10 when neither this nor `max_steps` is set. With
    both, training ends at whichever limit comes first."""
    max_steps: int | None = _opt(
        None, "train this many optimizer steps (then --epochs is optional)", ge=1, example=5000
    )
    """Optimizer steps to train, counted over the whole run (nanoGPT's `max_iters`).
    Without `epochs`, the data is passed over as often as it takes, so an
    IterableDataset that never ends trains too. Size a per-step scheduler with
    `total_steps()`."""
    batch_size: int = _opt(32, "samples per rank per micro-batch", ge=1)
    """Samples each process takes per forward pass. An optimizer step sees
    `batch_size * accumulate * world_size` samples."""
    seed: int = _opt(0, "seed of every RNG and of the data order (0 to 2**63 - 1)", ge=0)
    """Seeds Python, NumPy and torch on every rank, and the order of the data."""
    save_every: int = _opt(1, "checkpoint every N epochs (0: only after the last)", ge=0)
    """Epochs between checkpoints; one is also written after the last epoch."""
    save_every_steps: int = _opt(
        0, "also checkpoint every N optimizer steps (0: never mid-epoch)", ge=0, example=500
    )
    """Optimizer steps between checkpoints, counted over the whole run, for epochs too
    long to lose; 0 checkpoints only at epoch ends (`save_every`). A run resumed from a
    mid-epoch checkpoint continues with the next batch."""
    eval_every_steps: int = _opt(
        0, "also evaluate every N optimizer steps (0: at epoch ends only)", ge=0, example=500
    )
    """Optimizer steps between evaluations of the eval set, for long epochs or a run by
    `max_steps`; each is logged and, as an epoch's end does, may update the `keep_best`
    checkpoint, step a ReduceLROnPlateau and count for early stopping (`loss` is then the
    epoch's mean training loss so far). 0 evaluates at epoch ends only (as it does
    anyway)."""
    eval_max_batches: int | None = _opt(
        None,
        "evaluate at most N batches on each rank (default: the whole eval set)",
        ge=1,
        example=200,
    )
    """A cap on each evaluation, for an eval set too large to pass over every time
    (nanoGPT's `eval_iters`): each rank evaluates the first N batches of its shard, the
    same ones every time, and `eval_samples` says how many samples that was."""
    keep_best: str | None = _opt(
        None,
        "also keep the checkpoint with the best value of this metric, as best.pt",
        example="eval_loss",
    )
    """After each epoch or evaluation that improves this metric (lower is better,
    unless its name says accuracy or the like), checkpoint and keep that checkpoint as
    `best.pt` (or `best.dcp`) in `checkpoint_dir`, beside the `keep_last` newest ones.
    `loss` or any metric of an evaluation (an evaluation's needs an eval set); needs
    `checkpoint_dir`."""
    checkpoint_dir: str | None = _opt(
        None, "folder for checkpoints (none written without it)", example="DIR"
    )
    """Where checkpoints go; None writes none."""
    resume: bool = _opt(False, "continue from the newest checkpoint in --checkpoint-dir")
    """Start from the newest checkpoint in `checkpoint_dir` (which it needs)."""
    keep_last: int = _opt(3, "checkpoints to keep", ge=1)
    """How many of the newest checkpoints to keep; older ones are deleted."""
    num_workers: int = _opt(0, "data-loading processes per rank", ge=0)
    """DataLoader worker processes per rank; 0 loads data in the training process."""
    drop_last: bool = _opt(False, "drop each rank's last incomplete batch")
    """Skip each rank's last batch when it is smaller than `batch_size`."""
    replacement: bool = _opt(
        False, "draw training samples with replacement (nanoGPT's random windows)"
    )
    """Draw each epoch's training samples at random with replacement, as many as the
    dataset holds, as nanoGPT draws random windows of its token stream; sharded, so the
    ranks take disjoint places of one sequence of draws (`ReplacementSampler`)."""
    sync_batchnorm: bool = _opt(True, "synchronize BatchNorm statistics across ranks")
    """Compute BatchNorm statistics over the batches of all ranks, not each rank's own."""
    find_unused_parameters: bool = _opt(False, "let DDP handle parameters that get no gradient")
    """Needed when some parameters take no part in a forward pass; it costs speed."""
    precision: Literal["32", "bf16", "fp16"] = _opt(
        "32", "32, bf16 or fp16 (autocast; fp16 adds a gradient scaler)", example="bf16"
    )
    """"32" (full precision), or autocast to "bf16" or "fp16" (which adds a gradient
    scaler so that small gradients do not vanish)."""
    accumulate: int = _opt(1, "micro-batches per optimizer step (gradient accumulation)", ge=1)
    """Micro-batches whose gradients are summed before each optimizer step."""
    clip_grad_norm: float | None = _opt(
        None, "clip the global gradient norm to this value", gt=0, example=1.0
    )
    """Scale the gradients down when their norm over all parameters exceeds this; None
    leaves them as they are."""
    scheduler_interval: Literal["epoch", "step"] = _opt(
        "epoch", "step the LR scheduler per 'epoch' or per 'step'", example="step"
    )
    """When the learning-rate scheduler steps: after each "epoch" or each optimizer "step"."""
    strategy: Literal["ddp", "fsdp"] = _opt(
        "ddp", "ddp (replicate the model) or fsdp (shard it over the ranks)", example="fsdp"
    )
    """"ddp" keeps a whole copy of the model on every rank; "fsdp" shards parameters,
    gradients and optimizer state over the ranks (FSDP2), for models that do not fit
    on one device; the job's optimizer (and scheduler) must then be factories."""
    fsdp_offload: bool = _opt(False, "with fsdp: keep shards and optimizer state in CPU memory")
    """With strategy "fsdp": parameters, gradients and optimizer state live in CPU memory
    between uses (less device memory, slower steps)."""
    fsdp_reshard_after_forward: bool = _opt(
        True, "with fsdp: free gathered parameters after each block's forward"
    )
    """With strategy "fsdp": free a block's gathered parameters after its forward and
    gather them again for the backward (less memory); False keeps them (less traffic)."""
    on_signal: Literal["save", "stop"] = _opt(
        "save",
        "on SIGTERM, SIGUSR1 or Ctrl-C: 'save' a checkpoint first, or 'stop'",
        example="stop",
    )
    """With a checkpoint folder, a stop signal (a cluster's preemption, Ctrl-C) makes
    every rank save after the same optimizer step and exit to be resumed ("save"); or
    every rank stops at once, losing what the last checkpoint does not hold ("stop")."""
    grad_compression: Literal["none", "bf16"] = _opt(
        "none", "with ddp: all-reduce gradients as 'bf16' (half the bytes) or not", example="bf16"
    )
    """With strategy "ddp" and several ranks: "bf16" sends gradients over the network in
    bfloat16 (half the bytes, so faster where the all-reduce is the bottleneck) and
    averages them back in the parameters' dtype. Each gradient is then rounded to about
    3 significant digits; `ddpkit verify` shows what that does to the model."""
    bucket_cap_mb: float | None = _opt(
        None, "DDP's gradient bucket size in MiB (default: DDP's, 25)", gt=0, example=50
    )
    """Size of DDP's gradient buckets: larger buckets mean fewer, bigger all-reduces;
    smaller ones start communicating earlier in the backward pass."""
    compile: bool = _opt(False, "torch.compile the model (after the DDP wrap)")
    """Compile the model with torch.compile: a slower start, often a faster step."""
    deterministic: bool = _opt(
        False, "deterministic GPU kernels (cuDNN, cuBLAS): bit-exact CUDA runs, often slower"
    )
    """Make every run repeat bit-for-bit on CUDA too (CPU runs do already): the Trainer,
    when it is built, calls `torch.use_deterministic_algorithms(True)`, sets
    `torch.backends.cudnn.deterministic = True` and `torch.backends.cudnn.benchmark =
    False` (no autotuning, which may pick another kernel each run), and sets
    `CUBLAS_WORKSPACE_CONFIG=:4096:8` unless it is set already. Without it, cuDNN's
    convolution backward and some other CUDA kernels can differ from run to run. An
    operation with no deterministic version then raises an error naming it. These are
    settings of the whole process, and stay set after `fit`. cuBLAS reads its variable
    at its first call in the process: if the GPU ran a matmul before the Trainer was
    built, export `CUBLAS_WORKSPACE_CONFIG=:4096:8` before starting instead."""
    tf32: bool | None = _opt(
        None, "TF32 matmuls and convolutions on NVIDIA GPUs (default: torch's setting)"
    )
    """Let float32 matmuls and convolutions on NVIDIA GPUs (Ampere and newer) run in
    TensorFloat-32: several times faster, with about 3 significant digits in the
    products. True sets `torch.backends.cuda.matmul.allow_tf32` and
    `torch.backends.cudnn.allow_tf32`, False clears both, None leaves torch's settings
    (in torch's default, matmuls without TF32, convolutions with it). A setting of the
    whole process, made when the Trainer is built; nothing changes on CPU, or under
    bf16 and fp16 autocast, which compute in their own dtype."""
    run_dir: str | None = _opt(
        None, "folder for config.json, metrics.jsonl and the --loggers' files", example="DIR"
    )
    """Where the run's config.json and metrics.jsonl go (and the files of `loggers`);
    None writes neither. A new run (not `resume`) into a folder that already holds a
    metrics.jsonl keeps the old one as metrics.1.jsonl (then .2, ...)."""
    log_every: int = _opt(50, "optimizer steps between step lines in metrics.jsonl", ge=1)
    """Optimizer steps between the step lines of metrics.jsonl."""
    loggers: Sequence[LoggerName] = _opt(
        (),
        "also log the metrics to these, comma-separated: csv, tensorboard, mlflow, wandb "
        "(needs --run-dir)",
        example="csv,tensorboard",
    )
    """Where else the metrics of metrics.jsonl go, from rank 0: any of "csv" (steps.csv
    and epochs.csv in `run_dir`), "tensorboard" (event files in `run_dir`/tb), "mlflow"
    (the MLFLOW_TRACKING_URI server, else `run_dir`/mlflow.db) and "wandb" (W&B, with
    its files in `run_dir`/wandb; WANDB_MODE=offline keeps it off the network). Each
    but csv is an extra: `pip install 'ddpkit[wandb]'`. Needs `run_dir`. A list or a
    tuple; kept as a tuple."""
    early_stopping_patience: int | None = _opt(
        None, "stop after N epochs (or evaluations) without improvement", ge=1, example=3
    )
    """Stop after this many checks in which `early_stopping_metric` did not improve: one
    at each epoch's end and, with `eval_every_steps`, one at each evaluation (so it also
    acts in a run by `max_steps` over data that never ends). None trains every epoch."""
    early_stopping_metric: str = _opt("eval_loss", "the epoch metric early stopping watches")
    """The metric that early stopping watches (lower is better, unless its name says
    accuracy or the like): `loss`, or an evaluation's, which needs an eval set."""
    progress: bool | None = _opt(
        None, "a progress bar on rank 0 (default: when stdout is a terminal)"
    )
    """Show a progress bar on rank 0; None shows one when stdout is a terminal."""
    profile: bool = _opt(
        False, "measure where each rank's step time goes and say what holds the run back"
    )
    """Measure, on every rank, the time of each step spent waiting for data, computing,
    waiting for gradient communication, in the optimizer and in ddpkit's own work; write
    each rank's breakdown to metrics.jsonl at each epoch's end (`ddpkit plot` draws it)
    and say what holds the run back (a slow loader, a straggler, communication) every
    few minutes and at the end. Costs a few microseconds a step."""

    def __post_init__(self) -> None:
        for name in _FIELDS:
            # Frozen: the checked value (an int given for a float made a float) goes in
            # the way dataclasses itself sets fields.
            object.__setattr__(self, name, check_option(name, getattr(self, name)))
        # The rules about two fields; a file or flag alone cannot break them.
        if self.resume and self.checkpoint_dir is None:
            raise ConfigError(
                "resume must be used with a checkpoint folder (got True): "
                "pass --checkpoint-dir DIR with --resume"
            )
        if self.keep_best is not None and self.checkpoint_dir is None:
            raise ConfigError(
                f"keep_best needs a checkpoint folder (got keep_best={self.keep_best!r}): "
                "pass --checkpoint-dir DIR with --keep-best"
            )
        if self.loggers and self.run_dir is None:
            raise ConfigError(
                f"loggers need a run folder (got loggers={list(self.loggers)!r}): "
                "pass --run-dir DIR with --loggers"
            )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def epoch_limit(self) -> int | None:
        """The epochs to train: `epochs`; else 10 without `max_steps`; else no limit."""
        if self.epochs is not None:
            return self.epochs
        return 10 if self.max_steps is None else None

    def total_steps(self, samples: int | None = None, world_size: int = 1) -> int:
        """Optimizer steps the run takes, to size a per-step learning-rate schedule in a
        job's `build(ctx, config)`::

            OneCycleLR(opt, max_lr=1e-3, total_steps=config.total_steps(len(train), ctx.world_size))

        `max_steps` (or fewer, when `epochs` of a map-style set of `samples` samples end
        first); without it, the epochs' steps, which need `samples`."""
        limit = self.epoch_limit()
        if samples is None or limit is None:
            if self.max_steps is None:
                raise ConfigError(
                    "total_steps() of a run by epochs needs the training set's size: pass "
                    "config.total_steps(len(train_set), ctx.world_size)"
                )
            return self.max_steps
        steps = limit * self.steps_per_epoch(samples, world_size)
        return steps if self.max_steps is None else min(steps, self.max_steps)

    def steps_per_epoch(self, samples: int, world_size: int = 1) -> int:
        """Optimizer steps in one epoch of a map-style training set of `samples` samples
        on `world_size` ranks, as `Trainer` shards and batches it."""
        # DistributedSampler: ceil(samples / world) each (padded), or floor with drop_last.
        per_rank = samples // world_size if self.drop_last else -(-samples // world_size)
        batches = per_rank // self.batch_size if self.drop_last else -(-per_rank // self.batch_size)
        return -(-batches // self.accumulate)  # a short last group steps too


# -- checking one value ---------------------------------------------------------------

# Read once from the class above (TrainConfig.__post_init__ uses them, so they are set
# by the time a TrainConfig is made).
_FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}
_TYPES = typing.get_type_hints(TrainConfig)  # the annotations are strings until resolved


def field_type(name: str) -> tuple[Any, bool]:
    """The type of field `name` without None, and whether None is allowed:
    `(int, True)` for `int | None`, `(Literal["epoch", "step"], False)` for itself."""
    hint = _TYPES[name]
    args = typing.get_args(hint)
    if type(None) in args:  # `X | None`, the one kind of union a field has
        return next(a for a in args if a is not type(None)), True
    return hint, False


def check_option(name: str, value: Any) -> Any:
    """`value` if it is right for field `name` (an int for a float field becomes a
    float); otherwise ConfigError saying what it must be and which flag sets it."""
    kind, optional = field_type(name)
    if value is None and optional:
        return None
    meta = _FIELDS[name].metadata
    if typing.get_origin(kind) is Sequence:
        return _check_names(name, value, typing.get_args(kind)[0])
    if typing.get_origin(kind) is Literal:
        choices = typing.get_args(kind)
        if not isinstance(value, str) or value not in choices:
            must = "one of " + ", ".join(choices)
            raise _error(name, must, value, with_kind=not isinstance(value, str))
        return value
    if not _has_type(value, kind):
        must = _TYPE_WORDS[kind] + (" or None" if optional else "")
        raise _error(name, must, value, with_kind=True)
    if kind is str and not value:  # "" is no folder and no metric: it would be ignored
        raise _error(name, "a non-empty string" + (" or None" if optional else ""), value)
    if kind is int and value >= _INT_LIMIT:
        raise _error(name, "< 2**63", value)
    if meta["ge"] is not None and not value >= meta["ge"]:
        raise _error(name, f">= {meta['ge']}", value)
    if meta["gt"] is not None and not value > meta["gt"]:
        raise _error(name, f"> {meta['gt']}", value)
    return float(value) if kind is float else value


def parse_option(name: str, text: str) -> Any:
    """The value of field `name` written as command-line text ("32", "bf16"), checked
    by `check_option`. Text that is not a number stays text, so the error names it."""
    kind, _ = field_type(name)
    value: Any = text
    if kind is int or kind is float:
        with contextlib.suppress(ValueError):
            value = kind(text)
    elif typing.get_origin(kind) is Sequence:
        # "csv,wandb"; "" is the empty list (`ddpkit train --loggers ''` is refused before
        # this, in ddpkit.cli.flags: typed on a command line, it is a mistake).
        value = [part.strip() for part in text.split(",") if part.strip()]
    return check_option(name, value)


def validate_options(values: Mapping[str, Any], source: str) -> dict[str, Any]:
    """`values` (from a TOML file, or a job's DEFAULTS) checked by `check_option`, with
    `source` (e.g. "config file 'job.toml'") before each message; a new dict."""
    checked: dict[str, Any] = {}
    for key, value in values.items():
        if not isinstance(key, str) or key not in _FIELDS:
            raise ConfigError(f"{source}: {_unknown_key_message(key)}")
        try:
            checked[key] = check_option(key, value)
        except ConfigError as exc:
            raise ConfigError(f"{source}: {exc}") from None
    return checked


# Every int option must fit torch's (and C's) 64-bit integers: seeds, sizes, counts.
_INT_LIMIT = 2**63

_TYPE_WORDS: dict[Any, str] = {
    int: "an integer",
    float: "a number",
    str: "a string",
    bool: "a boolean",
}


def _check_names(name: str, value: Any, item: Any) -> tuple[str, ...]:
    """A list or tuple of strings, each one of `item`'s choices when it is a Literal, as
    a tuple (hashable, like the frozen config) without repeats."""
    choices = typing.get_args(item) if typing.get_origin(item) is Literal else ()
    must = "a list of " + (f"names from {', '.join(choices)}" if choices else "non-empty strings")
    # A str is a sequence too, but "csv" is no list of names: say so, not "'c' is unknown".
    if not isinstance(value, (list, tuple)):
        raise _error(name, must, value, with_kind=True)
    for part in value:
        if not isinstance(part, str) or not part or (choices and part not in choices):
            raise _error(name, must, part, with_kind=not isinstance(part, str))
    return tuple(dict.fromkeys(value))


def _has_type(value: Any, kind: Any) -> bool:
    if isinstance(value, bool) and kind is not bool:
        return False  # True is an int to Python, but never a count or a size
    return isinstance(value, (int, float) if kind is float else kind)


def _error(name: str, must: str, value: Any, *, with_kind: bool = False) -> ConfigError:
    got = repr(value)
    if len(got) > 60:  # a whole table or list pasted into one line helps no one
        got = got[:57] + "..."
    if with_kind and value is not None:
        got += f", {describe(value)}"
    return ConfigError(f"{name} must be {must} (got {got}): {_fix(name)}")


def _fix(name: str) -> str:
    """How to set `name` right: its flag, with a good value."""
    flag = "--" + name.replace("_", "-")
    kind, optional = field_type(name)
    if kind is bool:
        fix = f"pass {flag} or --no-{flag[2:]}"
    else:
        f = _FIELDS[name]
        example = f.default if f.metadata["example"] is None else f.metadata["example"]
        fix = f"pass {flag} {example}"
    return fix + (", or leave it out" if optional else "")


def _unknown_key_message(key: object) -> str:
    text, valid = str(key), list(_FIELDS)
    guess = text.replace("-", "_").lower()
    close = [guess] if guess in valid else difflib.get_close_matches(text, valid, n=1, cutoff=0.6)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return f"unknown option {text!r}: {hint}valid options are {', '.join(valid)}"


def describe(value: Any) -> str:
    """What kind of Python value `value` is, in words: "a str", "an int", "None"."""
    if value is None:
        return "None"
    name = type(value).__name__
    return f"an {name}" if name[0] in "aeiou" else f"a {name}"

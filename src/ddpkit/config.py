"""TrainConfig: every option of a training run, validated on construction.

It imports nothing heavy, so the command line can build its flags from it (each field
is a `--flag`; its help is the field's metadata) without loading torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from ddpkit.errors import ConfigError

PRECISIONS = ("32", "bf16", "fp16")


def _opt(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class TrainConfig:
    """Every knob of a training run; validated on construction.

    `batch_size` is per rank and per micro-batch: an optimizer step sees
    `batch_size * accumulate * world_size` samples. `save_every` is in epochs; a
    checkpoint is also written after the last epoch. `precision` is "32", "bf16" or
    "fp16" (autocast; fp16 adds a gradient scaler). `clip_grad_norm` clips the global
    gradient norm. `scheduler_interval` steps the LR scheduler per "epoch" or "step".
    `run_dir` receives config.json and metrics.jsonl (a step line every `log_every`
    optimizer steps). `early_stopping_patience` stops after that many epochs without
    improvement of `early_stopping_metric`.
    """

    epochs: int = _opt(10, "epochs to train")
    batch_size: int = _opt(32, "samples per rank per micro-batch")
    seed: int = _opt(0, "seed of every RNG and of the data order")
    save_every: int = _opt(1, "checkpoint every N epochs (0: only after the last)")
    checkpoint_dir: str | None = _opt(None, "folder for checkpoints (none written without it)")
    resume: bool = _opt(False, "continue from the newest checkpoint in --checkpoint-dir")
    keep_last: int = _opt(3, "checkpoints to keep")
    num_workers: int = _opt(0, "data-loading processes per rank")
    drop_last: bool = _opt(False, "drop each rank's last incomplete batch")
    sync_batchnorm: bool = _opt(True, "synchronize BatchNorm statistics across ranks")
    find_unused_parameters: bool = _opt(False, "let DDP handle parameters that get no gradient")
    precision: str = _opt("32", "32, bf16 or fp16 (autocast; fp16 adds a gradient scaler)")
    accumulate: int = _opt(1, "micro-batches per optimizer step (gradient accumulation)")
    clip_grad_norm: float | None = _opt(None, "clip the global gradient norm to this value")
    scheduler_interval: str = _opt("epoch", "step the LR scheduler per 'epoch' or per 'step'")
    compile: bool = _opt(False, "torch.compile the model (after the DDP wrap)")
    run_dir: str | None = _opt(
        None, "folder for config.json and metrics.jsonl (and TensorBoard events)"
    )
    log_every: int = _opt(50, "optimizer steps between step lines in metrics.jsonl")
    early_stopping_patience: int | None = _opt(None, "stop after N epochs without improvement")
    early_stopping_metric: str = _opt("eval_loss", "the epoch metric early stopping watches")
    progress: bool | None = _opt(
        None, "a progress bar on rank 0 (default: when stdout is a terminal)"
    )

    def __post_init__(self) -> None:
        def need(ok: bool, name: str, rule: str, fix: str) -> None:
            if not ok:
                value = getattr(self, name)
                raise ConfigError(f"{name} must be {rule} (got {value!r}): {fix}")

        def flag(name: str) -> str:
            return "--" + name.replace("_", "-")

        def is_int(value: Any) -> bool:
            return isinstance(value, int) and not isinstance(value, bool)

        for name in ("epochs", "batch_size", "keep_last", "accumulate", "log_every"):
            value = getattr(self, name)
            need(is_int(value) and value >= 1, name, ">= 1", f"pass {flag(name)} 1 or more")
        for name in ("save_every", "num_workers"):
            value = getattr(self, name)
            need(is_int(value) and value >= 0, name, ">= 0", f"pass {flag(name)} 0 or more")
        need(is_int(self.seed), "seed", "an integer", "pass --seed 0")
        need(
            self.precision in PRECISIONS,
            "precision",
            "one of 32, bf16, fp16",
            "pass --precision bf16 (or 32, fp16)",
        )
        need(
            self.clip_grad_norm is None
            or (isinstance(self.clip_grad_norm, (int, float)) and self.clip_grad_norm > 0),
            "clip_grad_norm",
            "> 0",
            "pass --clip-grad-norm 1.0, or leave it out",
        )
        need(
            self.scheduler_interval in ("epoch", "step"),
            "scheduler_interval",
            "'epoch' or 'step'",
            "pass --scheduler-interval step",
        )
        need(
            self.early_stopping_patience is None
            or (is_int(self.early_stopping_patience) and self.early_stopping_patience >= 1),
            "early_stopping_patience",
            ">= 1",
            "pass --early-stopping-patience 3",
        )
        need(
            not self.resume or self.checkpoint_dir is not None,
            "resume",
            "used with a checkpoint folder",
            "pass --checkpoint-dir DIR with --resume",
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

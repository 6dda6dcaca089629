"""ddpkit: a single-GPU PyTorch job on every GPU (or CPU core) of a machine, with DDP.

Names are imported lazily so that `import ddpkit` (and `ddpkit check`, which never
needs torch) starts fast; `from ddpkit import launch` works as usual.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS = {
    "DistContext": "ddpkit.context",
    "DdpkitError": "ddpkit.errors",
    "ConfigError": "ddpkit.errors",
    "CheckpointError": "ddpkit.errors",
    "WorkerError": "ddpkit.errors",
    "HangError": "ddpkit.errors",
    "Preempted": "ddpkit.errors",
    "rank_zero_first": "ddpkit.distributed",
    "launch": "ddpkit.launcher",
    "prepare_model": "ddpkit.model",
    "unwrap": "ddpkit.model",
    "prepare_loader": "ddpkit.data",
    "reduce_sum": "ddpkit.metrics",
    "reduce_sums": "ddpkit.metrics",
    "reduce_mean": "ddpkit.metrics",
    "save_checkpoint": "ddpkit.checkpoint",
    "load_checkpoint": "ddpkit.checkpoint",
    "latest_checkpoint": "ddpkit.checkpoint",
    "wait_for_checkpoints": "ddpkit.checkpoint",
    "save_state": "ddpkit.state",
    "load_state": "ddpkit.state",
    "model_digest": "ddpkit.digest",
    "seed_everything": "ddpkit.seed",
    "rank_seed": "ddpkit.seed",
    "SyncBatchNorm": "ddpkit.syncbn",
    "convert_sync_batchnorm": "ddpkit.syncbn",
    "Trainer": "ddpkit.trainer",
    "TrainConfig": "ddpkit.config",
    "Callback": "ddpkit.callbacks",
    "EarlyStopping": "ddpkit.callbacks",
    "FitResult": "ddpkit.trainer",
    "Job": "ddpkit.job",
    "verify": "ddpkit.verification",
    "VerifyReport": "ddpkit.verification",
    "print": "ddpkit.ranks",
    "barrier": "ddpkit.ranks",
    "all_gather": "ddpkit.ranks",
    "all_gather_object": "ddpkit.ranks",
    "broadcast_object": "ddpkit.ranks",
    "gather_for_metrics": "ddpkit.ranks",
    "no_backward_sync": "ddpkit.sync",
    "accumulate": "ddpkit.sync",
    "Accumulation": "ddpkit.sync",
    "Precision": "ddpkit.precision",
}

# `print` is public as `ddpkit.print`, but left out of `from ddpkit import *`, which
# would shadow the builtin.
__all__ = [
    "Accumulation",
    "Callback",
    "CheckpointError",
    "ConfigError",
    "DdpkitError",
    "DistContext",
    "EarlyStopping",
    "FitResult",
    "HangError",
    "Job",
    "Precision",
    "Preempted",
    "SyncBatchNorm",
    "TrainConfig",
    "Trainer",
    "VerifyReport",
    "WorkerError",
    "__version__",
    "accumulate",
    "all_gather",
    "all_gather_object",
    "barrier",
    "broadcast_object",
    "convert_sync_batchnorm",
    "gather_for_metrics",
    "latest_checkpoint",
    "launch",
    "load_checkpoint",
    "load_state",
    "model_digest",
    "no_backward_sync",
    "prepare_loader",
    "prepare_model",
    "rank_seed",
    "rank_zero_first",
    "reduce_mean",
    "reduce_sum",
    "reduce_sums",
    "save_checkpoint",
    "save_state",
    "seed_everything",
    "unwrap",
    "verify",
    "wait_for_checkpoints",
]

if TYPE_CHECKING:
    from ddpkit.callbacks import Callback, EarlyStopping
    from ddpkit.checkpoint import (
        latest_checkpoint,
        load_checkpoint,
        save_checkpoint,
        wait_for_checkpoints,
    )
    from ddpkit.config import TrainConfig
    from ddpkit.context import DistContext
    from ddpkit.data import prepare_loader
    from ddpkit.digest import model_digest
    from ddpkit.distributed import rank_zero_first
    from ddpkit.errors import (
        CheckpointError,
        ConfigError,
        DdpkitError,
        HangError,
        Preempted,
        WorkerError,
    )
    from ddpkit.job import Job
    from ddpkit.launcher import launch
    from ddpkit.metrics import reduce_mean, reduce_sum, reduce_sums
    from ddpkit.model import prepare_model, unwrap
    from ddpkit.precision import Precision
    from ddpkit.ranks import (
        all_gather,
        all_gather_object,
        barrier,
        broadcast_object,
        gather_for_metrics,
    )
    from ddpkit.ranks import (
        print as print,
    )
    from ddpkit.seed import rank_seed, seed_everything
    from ddpkit.state import load_state, save_state
    from ddpkit.sync import Accumulation, accumulate, no_backward_sync
    from ddpkit.syncbn import SyncBatchNorm, convert_sync_batchnorm
    from ddpkit.trainer import FitResult, Trainer
    from ddpkit.verification import VerifyReport, verify


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ddpkit' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value

"""ddpkit: a single-GPU PyTorch job on every GPU (or CPU core) of a machine, with DDP.

These are the names a training script calls; everything else lives in the package
that owns it (`ddpkit.processes`, `ddpkit.parallel`, `ddpkit.checkpoint`,
`ddpkit.training`, `ddpkit.records`, `ddpkit.verification`), listed in the API
reference. Names are imported lazily so that `import ddpkit` (and `ddpkit check`,
which never needs torch) starts fast; `from ddpkit import launch` works as usual.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> the module that defines it
_EXPORTS = {
    "launch": "ddpkit.processes.launcher",
    "DistContext": "ddpkit.context",
    "Trainer": "ddpkit.training.trainer",
    "TrainConfig": "ddpkit.training.config",
    "Callback": "ddpkit.training.trainer",
    "Job": "ddpkit.training.job",
    "prepare_model": "ddpkit.parallel.strategy",
    "prepare_loader": "ddpkit.parallel.data",
    "unwrap": "ddpkit.parallel.model",
    "Precision": "ddpkit.parallel.precision",
    "accumulate": "ddpkit.parallel.sync",
    "convert_sync_batchnorm": "ddpkit.parallel.syncbn",
    "seed_everything": "ddpkit.seed",
    "save_state": "ddpkit.checkpoint.state",
    "load_state": "ddpkit.checkpoint.state",
    "wait_for_checkpoints": "ddpkit.checkpoint.pt",
    "print": "ddpkit.parallel.ranks",
    "barrier": "ddpkit.parallel.ranks",
    "gather_for_metrics": "ddpkit.parallel.ranks",
    "reduce_sum": "ddpkit.parallel.ranks",
    "reduce_mean": "ddpkit.parallel.ranks",
    "rank_zero_first": "ddpkit.parallel.ranks",
    "verify": "ddpkit.verification",
    "DdpkitError": "ddpkit.errors",
}

# `print` is public as `ddpkit.print`, but left out of `from ddpkit import *`, which
# would shadow the builtin.
__all__ = [
    "Callback",
    "DdpkitError",
    "DistContext",
    "Job",
    "Precision",
    "TrainConfig",
    "Trainer",
    "__version__",
    "accumulate",
    "barrier",
    "convert_sync_batchnorm",
    "gather_for_metrics",
    "launch",
    "load_state",
    "prepare_loader",
    "prepare_model",
    "rank_zero_first",
    "reduce_mean",
    "reduce_sum",
    "save_state",
    "seed_everything",
    "unwrap",
    "verify",
    "wait_for_checkpoints",
]

if TYPE_CHECKING:
    from ddpkit.checkpoint.pt import wait_for_checkpoints
    from ddpkit.checkpoint.state import load_state, save_state
    from ddpkit.context import DistContext
    from ddpkit.errors import DdpkitError
    from ddpkit.parallel.data import prepare_loader
    from ddpkit.parallel.model import unwrap
    from ddpkit.parallel.precision import Precision
    from ddpkit.parallel.ranks import (
        barrier,
        gather_for_metrics,
        rank_zero_first,
        reduce_mean,
        reduce_sum,
    )
    from ddpkit.parallel.ranks import (
        print as print,
    )
    from ddpkit.parallel.strategy import prepare_model
    from ddpkit.parallel.sync import accumulate
    from ddpkit.parallel.syncbn import convert_sync_batchnorm
    from ddpkit.processes.launcher import launch
    from ddpkit.seed import seed_everything
    from ddpkit.training.config import TrainConfig
    from ddpkit.training.job import Job
    from ddpkit.training.trainer import Callback, Trainer
    from ddpkit.verification import verify


# Note how the RNGs stand before the script seeds them: launch's ranks start from the
# streams the script seeded, the others from fresh entropy (see ddpkit.seed). torch-free.
importlib.import_module("ddpkit.seed")


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ddpkit' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value

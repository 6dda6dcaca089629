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
    "launch": "ddpkit.launch",
}

__all__ = sorted([*_EXPORTS, "__version__"])

if TYPE_CHECKING:
    from ddpkit.context import DistContext
    from ddpkit.errors import CheckpointError, ConfigError, DdpkitError, WorkerError
    from ddpkit.launch import launch


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ddpkit' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value

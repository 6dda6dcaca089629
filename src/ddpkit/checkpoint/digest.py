"""Digests that tell whether two models (or two tensors) are bit-for-bit the same.

Used to compare ranks with each other, a resumed run with an uninterrupted one, and a
job's result across launches. The bytes are hashed by `ddpkit.hashing`, as the audit's
are; here a sharded tensor is first gathered whole.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ddpkit import hashing
from ddpkit.context import DistContext
from ddpkit.parallel.fsdp import gathered
from ddpkit.parallel.strategy import Strategy


def tensor_digest(tensor: torch.Tensor) -> str:
    """A short sha256 of one tensor's bytes: equal digests mean equal bits. A shard of
    FSDP is gathered whole first (a collective: call it on every rank then)."""
    return hashing.tensor_digest(gathered(tensor))


def model_digest(model: nn.Module) -> str:
    """sha256 over the unwrapped state dict's names and tensor bytes, in key order.

    Two models whose digests match have bit-for-bit the same parameters and buffers,
    whether or not they are wrapped in DDP or `torch.compile`. A model sharded with
    FSDP is gathered first: call it on every rank then.
    """
    full = Strategy.of(model, DistContext.current()).full_state(model)
    return hashing.tensors_digest(full.items())


def state_digest(state: Any) -> str:
    """sha256 over a nested state (dicts, lists, tensors, numbers), such as an
    optimizer's or a scheduler's `state_dict()`: equal digests mean equal states."""
    return hashing.state_digest(state, gathered)

"""Digests that tell whether two models (or two tensors) are bit-for-bit the same.

Used to compare ranks with each other, a resumed run with an uninterrupted one, and a
job's result across launches.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
from torch import nn

from ddpkit.parallel.fsdp import gathered
from ddpkit.parallel.model import unwrap


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes in memory order, without a copy where it is contiguous on
    the CPU (`bytes(storage)` walked them one at a time: 3.6 s per MiB)."""
    whole = gathered(tensor)  # a shard of FSDP: all of it (a collective)
    flat = whole.detach().cpu().contiguous().reshape(-1)
    if flat.is_conj() or flat.is_neg():  # lazy views: the values, not the storage
        flat = flat.resolve_conj().resolve_neg()
    return flat.view(torch.uint8).numpy().data


def tensor_digest(tensor: torch.Tensor) -> str:
    """A short sha256 of one tensor's bytes: equal digests mean equal bits."""
    return hashlib.sha256(_tensor_bytes(tensor)).hexdigest()[:16]


def model_digest(model: nn.Module) -> str:
    """sha256 over the unwrapped state dict's names and tensor bytes, in key order.

    Two models whose digests match have bit-for-bit the same parameters and buffers,
    whether or not they are wrapped in DDP or `torch.compile`. A model sharded with
    FSDP is gathered first: call it on every rank then.
    """
    h = hashlib.sha256()
    for key, tensor in unwrap(model).state_dict().items():
        h.update(key.encode())
        h.update(_tensor_bytes(tensor))
    return h.hexdigest()


def state_digest(state: Any) -> str:
    """sha256 over a nested state (dicts, lists, tensors, numbers), such as an
    optimizer's or a scheduler's `state_dict()`: equal digests mean equal states."""
    h = hashlib.sha256()
    _feed(h, state)
    return h.hexdigest()


def _feed(h: Any, value: Any) -> None:
    if isinstance(value, torch.Tensor):
        h.update(f"tensor{value.dtype}{tuple(value.shape)}".encode())
        h.update(_tensor_bytes(value))
    elif isinstance(value, dict):
        for key in sorted(value, key=repr):
            h.update(repr(key).encode())
            _feed(h, value[key])
    elif isinstance(value, (list, tuple)):
        h.update(f"seq{len(value)}".encode())
        for item in value:
            _feed(h, item)
    else:
        h.update(repr(value).encode())

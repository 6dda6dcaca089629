"""Hashing tensors: the one place a tensor's bytes are read and hashed.

Equal digests mean equal bits. `ddpkit.checkpoint.digest` (which first gathers a sharded
tensor whole: a collective) and the audit of `ddpkit run --audit` (which compares the
ranks' weights from their files, never talking to another rank) both hash through here,
so the same tensor has the same digest in both.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from typing import Any

import torch


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of this process's `tensor` in memory order, without a copy where it is
    contiguous on the CPU (`bytes(storage)` walked them one at a time: 3.6 s per MiB)."""
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    if flat.is_conj() or flat.is_neg():  # lazy views: the values, not the storage
        flat = flat.resolve_conj().resolve_neg()
    return flat.view(torch.uint8).numpy().data


def tensor_digest(tensor: torch.Tensor) -> str:
    """A short sha256 of one tensor's bytes."""
    return hashlib.sha256(tensor_bytes(tensor)).hexdigest()[:16]


def tensors_digest(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """sha256 over names and tensor bytes, in the order given (a state dict's)."""
    h = hashlib.sha256()
    for key, tensor in named:
        h.update(key.encode())
        h.update(tensor_bytes(tensor))
    return h.hexdigest()


def state_digest(state: Any, whole: Callable[[torch.Tensor], torch.Tensor] | None = None) -> str:
    """sha256 over a nested state (dicts, lists, tensors, numbers); each tensor hashed
    as `whole(tensor)` when given (say, a shard gathered whole)."""
    h = hashlib.sha256()
    _feed(h, state, whole or (lambda tensor: tensor))
    return h.hexdigest()


def _feed(h: Any, value: Any, whole: Callable[[torch.Tensor], torch.Tensor]) -> None:
    if isinstance(value, torch.Tensor):
        h.update(f"tensor{value.dtype}{tuple(value.shape)}".encode())
        h.update(tensor_bytes(whole(value)))
    elif isinstance(value, dict):
        for key in sorted(value, key=repr):
            h.update(repr(key).encode())
            _feed(h, value[key], whole)
    elif isinstance(value, (list, tuple)):
        h.update(f"seq{len(value)}".encode())
        for item in value:
            _feed(h, item, whole)
    else:
        h.update(repr(value).encode())

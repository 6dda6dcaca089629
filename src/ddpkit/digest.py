"""Digests that tell whether two models (or two tensors) are bit-for-bit the same.

Used to compare ranks with each other, a resumed run with an uninterrupted one, and a
job's result across launches.
"""

from __future__ import annotations

import hashlib

import torch
from torch import nn

from ddpkit.model import unwrap


def _tensor_bytes(tensor: torch.Tensor) -> bytes:
    return bytes(tensor.detach().cpu().contiguous().clone().untyped_storage())


def tensor_digest(tensor: torch.Tensor) -> str:
    """A short sha256 of one tensor's bytes: equal digests mean equal bits."""
    return hashlib.sha256(_tensor_bytes(tensor)).hexdigest()[:16]


def model_digest(model: nn.Module) -> str:
    """sha256 over the unwrapped state dict's names and tensor bytes, in key order.

    Two models whose digests match have bit-for-bit the same parameters and buffers,
    whether or not they are wrapped in DDP or `torch.compile`.
    """
    h = hashlib.sha256()
    for key, tensor in unwrap(model).state_dict().items():
        h.update(key.encode())
        h.update(_tensor_bytes(tensor))
    return h.hexdigest()

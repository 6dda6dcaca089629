"""Reduce numbers across ranks. Every rank must call these: each one is a collective."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from ddpkit.context import DistContext

Number = float | int | torch.Tensor


def _stack(values: Sequence[Number], ctx: DistContext) -> torch.Tensor:
    parts = [
        v.detach().reshape(()).double()
        if isinstance(v, torch.Tensor)
        else torch.tensor(float(v), dtype=torch.float64)
        for v in values
    ]
    # nccl only reduces tensors on the GPU; gloo wants them on the CPU.
    return torch.stack([p.to(ctx.device) for p in parts])


def reduce_sums(values: Sequence[Number], ctx: DistContext) -> list[float]:
    """Sum each value over all ranks in one collective; returns Python floats."""
    if not values:
        return []
    packed = _stack(values, ctx)
    if ctx.distributed:
        dist.all_reduce(packed, op=dist.ReduceOp.SUM)
    return [float(x) for x in packed.cpu().tolist()]


def reduce_sum(value: Number, ctx: DistContext) -> float:
    """The sum of `value` over all ranks (a Python float, the same on every rank)."""
    return reduce_sums([value], ctx)[0]


def reduce_mean(value: Number, ctx: DistContext) -> float:
    """The mean of `value` over all ranks (each rank weighs the same)."""
    return reduce_sum(value, ctx) / ctx.world_size

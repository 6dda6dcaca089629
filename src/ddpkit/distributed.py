"""Small helpers for code that runs on every rank."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist

from ddpkit.context import DistContext
from ddpkit.diagnosis.watchdog import expect


@contextlib.contextmanager
def rank_zero_first(ctx: DistContext) -> Iterator[None]:
    """Run the body on rank 0 first, while the other ranks wait; then on the others.

    For work that must happen once before the others may start, such as downloading,
    unpacking or tokenising a data set into a cache that every rank then reads::

        with ddpkit.rank_zero_first(ctx):
            data = load_or_prepare("data/")  # rank 0 prepares, the others read its cache

    Call it on every rank (it holds a barrier). The others' wait is expected, so the
    hang diagnosis prints no notice about it, however long rank 0 takes. With one
    process it just runs the body.
    """
    if not ctx.distributed:
        yield
        return
    if ctx.is_main:
        with expect("work"):
            yield
        dist.barrier()
    else:
        with expect("wait"):
            dist.barrier()
        yield


# Groups that destroy_group() took out of service but keeps alive; see there.
_retired: list[Any] = []


def destroy_group() -> None:
    """`dist.destroy_process_group()`, without a deadlock of gloo before torch 2.8.

    Freeing a gloo group joins its worker threads while holding the GIL. A worker may
    still be dropping the last collective's tensors, which needs the GIL: both wait
    forever (seen on torch 2.6; fixed by pytorch#154976). So the group objects are
    kept until the next call, by when their threads have long been idle.
    """
    world = getattr(dist.distributed_c10d, "_world", None)
    groups = list(getattr(world, "pg_map", {}))  # every group, not only WORLD
    _retired.clear()
    dist.destroy_process_group()
    _retired.extend(groups)

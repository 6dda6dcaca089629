"""Small helpers for code that runs on every rank."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from ddpkit.context import DistContext
from ddpkit.diagnosis.watchdog import expect
from ddpkit.versions import release


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
_GLOO_TEARDOWN_RACE = release(torch.__version__) < (2, 8)


def destroy_group() -> None:
    """`dist.destroy_process_group()`, without a deadlock of gloo before torch 2.8.

    Freeing a gloo group joins its worker threads while holding the GIL. A worker may
    still be dropping the last collective's tensors, which needs the GIL: both wait
    forever (seen on torch 2.6, 3 times in about 18,000 launches; fixed by pytorch#154976).
    So the group objects are kept until the next call, and that call first lets go of
    the GIL for a moment, so that a worker still waiting for it can finish. Keeping
    the groups alone was not enough: a worker could still be waiting a launch later.
    """
    if not _GLOO_TEARDOWN_RACE:
        dist.destroy_process_group()
        return
    world = getattr(dist.distributed_c10d, "_world", None)
    groups = list(getattr(world, "pg_map", {}))  # every group, not only WORLD
    if _retired:
        time.sleep(0.01)  # 24,000 launches with it, none hung (2 in 7,500 without)
    _retired.clear()
    dist.destroy_process_group()
    _retired.extend(groups)

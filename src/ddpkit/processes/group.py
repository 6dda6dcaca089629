"""The process group's life: how a rank joins its job's group, and how the group ends,
cleanly or after a failure."""

from __future__ import annotations

import logging
import os
import time
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist

from ddpkit.versions import release

log = logging.getLogger("ddpkit")


# Groups that destroy_group() took out of service but keeps alive; see there.
_retired: list[Any] = []
_GLOO_TEARDOWN_RACE = release(torch.__version__) < (2, 8)
# torch reads it each time it creates a group (init_process_group, new_group): "1" adds
# a barrier on the store after the group is made.
_INIT_BARRIER = "TORCH_DIST_INIT_BARRIER"


def device_for(backend: str, local_rank: int) -> torch.device:
    """This rank's device: its GPU, made the current one, with nccl; else the CPU."""
    if backend == "nccl":
        device = torch.device("cuda", local_rank)
        # Before init, so that nccl and every later `.cuda()` use this rank's GPU
        # instead of all landing on GPU 0.
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def init_group(
    backend: str, rank: int, world: int, device: torch.device, timeout_s: float, **how: Any
) -> None:
    """Join the job's group (`how`: its store or init_method), bound to `device` on a GPU.

    Returns only once every rank has joined. gloo's group constructor returns on a
    rank as soon as its side of each connection is made: a rank with little to do
    could finish and exit while another was still completing its handshake with it,
    which then failed with "Connection closed by peer" (8 launches in 200 of a
    function that returns at once, with the CPUs busy). torch's own switch for a
    barrier after each group's creation, a store round trip, is turned on for this
    rank's groups unless the environment says otherwise.
    """
    kwargs: dict[str, Any] = {"timeout": timedelta(seconds=timeout_s), **how}
    if device.type == "cuda":
        kwargs["device_id"] = device
    if world > 1:
        os.environ.setdefault(_INIT_BARRIER, "1")
    dist.init_process_group(backend, rank=rank, world_size=world, **kwargs)


def teardown(backend: str, *, failed: bool) -> Literal["abort", "destroy"]:
    """How a rank leaves its group: "abort" after an error on NCCL, else "destroy".

    After an error a collective may still be pending on the GPU (the peer it waits for
    is gone): `destroy_process_group` waits for every NCCL kernel, so the rank would
    hang (under torchrun, for the collective timeout). Aborting the communicators
    returns at once. gloo's work ends on the CPU with the error: destroying is safe.
    """
    return "abort" if failed and "nccl" in backend else "destroy"  # also "cpu:gloo,cuda:nccl"


def destroy_group(*, failed: bool = False) -> None:
    """`dist.destroy_process_group()`, without a deadlock of gloo before torch 2.8, and
    without the wait for a pending NCCL collective after an error (`failed`).

    Freeing a gloo group joins its worker threads while holding the GIL. A worker may
    still be dropping the last collective's tensors, which needs the GIL: both wait
    forever (seen on torch 2.6, 3 times in about 18,000 launches; fixed by pytorch#154976).
    So the group objects are kept until the next call, and that call first lets go of
    the GIL for a moment, so that a worker still waiting for it can finish. Keeping
    the groups alone was not enough: a worker could still be waiting a launch later.

    A group the script destroyed itself (`dist.destroy_process_group()` at the end of
    its function, as torch's DDP tutorial ends) is simply done: torch ended every group
    with it, the extra ones ddpkit made too.
    """
    if not dist.is_initialized():
        return
    if teardown(str(dist.get_backend()), failed=failed) == "abort":
        try:
            _abort_group()
        except Exception as exc:  # the error that brought us here is the one to report
            log.warning("ddpkit: could not abort the NCCL group after the error: %s", exc)
        return
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


def _abort_group() -> None:
    """Abort every group of this rank at once, with what this torch has."""
    abort_all = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if abort_all is not None:
        # WORLD by name: torch 2.6 takes None for a single group and aborts only it.
        abort_all(dist.group.WORLD)
        return
    world: Any = dist.group.WORLD
    if hasattr(world, "abort"):
        world.abort()
    elif hasattr(world, "_get_backend"):
        backend = world._get_backend(torch.device("cuda"))
        if hasattr(backend, "abort"):
            backend.abort()

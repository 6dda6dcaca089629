"""DistContext: who this process is in the job. Passed explicitly, never a global."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

_CPU = torch.device("cpu")
# Called by every `DistContext.current()`: a worker of `ddpkit run` registers here the note
# that this rank runs ddpkit's code (inrank.preemption.ddpkit_job: a stop signal before
# the first step then ends the job with 75), which this layer may not import.
ON_CURRENT: list[Callable[[], None]] = []


@dataclass(frozen=True)
class DistContext:
    """Rank, world size and device of the calling process.

    `launch` builds one per worker and hands it to the user's function. Outside a
    job, `DistContext.single()` describes a lone process, so code written against a
    context also runs without any process group.
    """

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    device: torch.device = _CPU
    backend: str = "gloo"

    @property
    def is_main(self) -> bool:
        """True on global rank 0, the one process that writes files and prints."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        """True when collectives are needed (more than one process in an initialised group)."""
        return self.world_size > 1 and dist.is_available() and dist.is_initialized()

    @classmethod
    def single(cls, device: str | torch.device | None = None) -> DistContext:
        """A one-process context on `device` (default: cuda:0 if present, else cpu)."""
        if device is None:
            device = "cuda:0" if torch.cuda.is_available() else "cpu"
        dev = torch.device(device)
        return cls(device=dev, backend="nccl" if dev.type == "cuda" else "gloo")

    @classmethod
    def current(cls) -> DistContext:
        """The context of this process, from the initialised process group or the
        environment torchrun sets; a lone process otherwise. Never raises."""
        for note in ON_CURRENT:
            note()
        env = os.environ
        rank, world = 0, 1
        if dist.is_available() and dist.is_initialized():
            rank, world = dist.get_rank(), dist.get_world_size()
        elif "RANK" in env and "WORLD_SIZE" in env:
            rank, world = _int_env("RANK", 0), _int_env("WORLD_SIZE", 1)
        local_rank = _int_env("LOCAL_RANK", rank)
        local_world = _int_env("LOCAL_WORLD_SIZE", world)
        if torch.cuda.is_available():
            device = torch.device("cuda", local_rank % torch.cuda.device_count())
        else:
            device = torch.device("cpu")
        backend = (
            dist.get_backend()
            if dist.is_available() and dist.is_initialized()
            else ("nccl" if device.type == "cuda" else "gloo")
        )
        return cls(rank, local_rank, world, local_world, device, str(backend))


def _int_env(name: str, default: int) -> int:
    try:
        return int(os.environ[name])
    except (KeyError, ValueError):
        return default

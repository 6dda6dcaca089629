"""`ddpkit run train.py` with no flags where the platform already says everything:
torchrun's `PET_*` variables, which Kubernetes' PyTorchJob (Kubeflow's training
operator) sets in each pod, as srun's are read in `ddpkit.processes.slurm`.

Read: `PET_NNODES`, `PET_NODE_RANK`, `PET_NPROC_PER_NODE`, `PET_MASTER_ADDR`,
`PET_MASTER_PORT`, `PET_MAX_RESTARTS`, and `PET_RDZV_ENDPOINT` (HOST:PORT, where no
`PET_MASTER_ADDR` is set). Of the node-level variables of other platforms,
`MASTER_ADDR` and `MASTER_PORT` are read where the job has several nodes and nothing
else names node 0. `WORLD_SIZE` and `RANK` are not: torchrun's workers read them as
ranks, some platforms set them as nodes, and `ddpkit run` cannot tell which, so a
machine that sets them (more than one) and nothing else is refused in one line that
names the flags to pass.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ddpkit.errors import ConfigError


@dataclass(frozen=True)
class PetJob:
    """What the `PET_*` variables say of the job; None where they say nothing."""

    nnodes: int | None = None
    node_rank: int | None = None
    nproc: str | None = None  # "auto" or a number, as --nproc takes it
    master_addr: str | None = None
    master_port: int | None = None
    max_restarts: int | None = None


def pet_job(env: Mapping[str, str]) -> PetJob | None:
    """The job the `PET_*` variables describe, or None when none is set.

    Raises:
        ConfigError: a value that is not what torchrun takes (an elastic node range
            such as 1:4, a port that is no number, ...).
    """
    if not any(name.startswith("PET_") for name in env):
        return None
    addr, port = env.get("PET_MASTER_ADDR"), env.get("PET_MASTER_PORT")
    endpoint = env.get("PET_RDZV_ENDPOINT")
    if endpoint and not addr:
        addr, _, endpoint_port = endpoint.rpartition(":")
        if not addr:  # no port in it: the whole is the host
            addr, endpoint_port = endpoint_port, ""
        port = port or endpoint_port or None
    nnodes = env.get("PET_NNODES")
    if nnodes and ":" in nnodes:
        low, _, high = nnodes.partition(":")
        if low != high:
            raise ConfigError(
                f"PET_NNODES={nnodes} asks for an elastic number of nodes, which ddpkit run "
                "does not do: set PET_NNODES to one number (or pass --nnodes N)"
            )
        nnodes = low
    nproc = env.get("PET_NPROC_PER_NODE")
    if nproc in ("gpu", "cpu"):  # torchrun's names for one per GPU, one per core
        nproc = "auto"
    return PetJob(
        nnodes=_number(env, "PET_NNODES", nnodes),
        node_rank=_number(env, "PET_NODE_RANK", env.get("PET_NODE_RANK")),
        nproc=nproc or None,
        master_addr=addr or None,
        master_port=_number(env, "PET_MASTER_PORT", port),
        max_restarts=_number(env, "PET_MAX_RESTARTS", env.get("PET_MAX_RESTARTS")),
    )


def ambiguous_ranks(env: Mapping[str, str]) -> str | None:
    """The one line that refuses a machine whose WORLD_SIZE and RANK may count nodes or
    ranks (see the module's docstring), or None."""
    world, rank = env.get("WORLD_SIZE"), env.get("RANK")
    if world is None or rank is None or world.strip() in ("", "0", "1"):
        return None
    master = env.get("MASTER_ADDR", "NODE0")
    return (
        f"WORLD_SIZE={world} and RANK={rank} are set, but nothing says whether they count "
        "nodes (as some platforms set them for each machine) or ranks (as torchrun sets "
        f"them for each worker): pass --nnodes {world} --node-rank {rank} --master-addr "
        f"{master} if they count nodes, or set PET_NNODES and PET_NODE_RANK"
    )


def _number(env: Mapping[str, str], name: str, value: str | None) -> int | None:
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ConfigError(
            f"{name}={env.get(name, value)} is not a whole number: set it as torchrun takes it "
            "(or pass the flag of ddpkit run that it stands for)"
        ) from None

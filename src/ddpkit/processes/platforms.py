"""Where `ddpkit run` learns its nodes when the flags do not say: the flags first, then
what the platform set for this machine (srun's variables, `ddpkit.processes.slurm`;
torchrun's and Kubernetes' `PET_*`, `ddpkit.processes.pet`), then the defaults of one
machine. Two platforms that disagree on a value no flag gives are refused in one line.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from ddpkit.errors import ConfigError
from ddpkit.processes.pet import ambiguous_ranks, pet_job
from ddpkit.processes.slurm import slurm_step


@dataclass(frozen=True)
class NodeSettings:
    """The settings of `ddpkit run` that a platform may give; None: not given."""

    nnodes: int | None = None
    node_rank: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    nproc: str | None = None
    max_restarts: int | None = None


# What each value is called on the command line, for the line that refuses.
_FLAGS = {
    "nnodes": "--nnodes",
    "node_rank": "--node-rank",
    "master_addr": "--master-addr",
    "master_port": "--master-port",
    "nproc": "--nproc",
    "max_restarts": "--max-restarts",
}
_DEFAULTS = NodeSettings(nnodes=1, node_rank=0, master_port=29500, nproc="auto", max_restarts=0)


def resolve(given: NodeSettings, env: Mapping[str, str]) -> tuple[NodeSettings, str | None]:
    """Every setting: the flag's, else the platform's, else the default; and the line
    that says where a job of several nodes got them from (None for flags alone).

    Raises:
        ConfigError: srun's and PET_* variables disagree on a value no flag gives, or
            WORLD_SIZE and RANK are set with nothing that says they count nodes.
    """
    platforms: list[tuple[str, NodeSettings]] = []
    step = slurm_step(env)
    if step is not None and step.nnodes > 1:
        platforms.append(
            (
                f"srun's variables (SLURM job {env.get('SLURM_JOB_ID')})",
                NodeSettings(step.nnodes, step.node_rank, step.master_addr, step.master_port),
            )
        )
    pet = pet_job(env)
    if pet is not None:
        platforms.append(("the PET_* variables", NodeSettings(**dataclasses.asdict(pet))))
    values = dataclasses.asdict(given)
    used: list[str] = []
    for name, flag in _FLAGS.items():
        if values[name] is not None:
            continue  # a flag wins
        said = {source: getattr(s, name) for source, s in platforms if getattr(s, name) is not None}
        if len(set(said.values())) > 1:
            both = " and ".join(f"{source} say {value}" for source, value in said.items())
            raise ConfigError(f"{both} for {flag}: pass {flag} to choose")
        if said:
            values[name] = next(iter(said.values()))
            used += [source for source in said if source not in used]
    several = values["nnodes"] is not None and values["nnodes"] > 1
    if several:  # node 0's address from the variables many platforms set
        if values["master_addr"] is None and env.get("MASTER_ADDR"):
            values["master_addr"] = env["MASTER_ADDR"]
        if values["master_port"] is None and env.get("MASTER_PORT", "").isdigit():
            values["master_port"] = int(env["MASTER_PORT"])
    elif values["nnodes"] is None:
        refused = ambiguous_ranks(env)
        if refused is not None:
            raise ConfigError(refused)
    for name, default in dataclasses.asdict(_DEFAULTS).items():
        if values[name] is None:
            values[name] = default
    settings = NodeSettings(**values)
    note = None
    if used and several:
        note = (
            f"ddpkit: from {' and '.join(used)}: node {settings.node_rank} of {settings.nnodes}, "
            f"rendezvous at {settings.master_addr}:{settings.master_port}"
        )
    return settings, note

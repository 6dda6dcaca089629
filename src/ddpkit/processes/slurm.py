"""`srun ddpkit run train.py` with no flags: the nodes of the job, this node's index and
node 0's address, read from the variables that srun sets for each task.

ddpkit starts the workers of a node itself, so srun must start one task per node
(`--ntasks-per-node=1`); each task then runs torchrun's agent for its node.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from ddpkit.errors import ConfigError

# Ports the rendezvous may use, picked from the job id so that every node agrees on
# one without being told, and two jobs on one node rarely collide.
_PORT_BASE, _PORT_SPAN = 20000, 20000


@dataclass(frozen=True)
class SlurmStep:
    """Where this task of a SLURM job step runs."""

    nnodes: int
    node_rank: int
    master_addr: str  # the first node of the step
    master_port: int  # from the job id


def slurm_step(env: Mapping[str, str]) -> SlurmStep | None:
    """The step this process is a task of, or None outside srun.

    An sbatch script that runs `ddpkit run` itself, without srun, is no step: it has
    the job's variables (its nodes, SLURM_TASKS_PER_NODE for the tasks it may start)
    but none of a step's, and runs on its one node as on a plain machine.

    Raises:
        ConfigError: srun started more than one task on a node.
    """
    if "SLURM_JOB_ID" not in env or "SLURM_NODEID" not in env:
        return None
    # Set by srun for each task of a step, never in the batch script itself.
    nodes = expand_hostlist(env.get("SLURM_STEP_NODELIST", ""))
    if not nodes:
        return None
    per_node = env.get("SLURM_STEP_TASKS_PER_NODE", "1")
    if any(count != "1" for count in re.findall(r"(\d+)(?:\(x\d+\))?", per_node)):
        raise ConfigError(
            f"srun started {per_node} task(s) per node, but ddpkit run starts the workers of "
            "a node itself: run it with srun --ntasks-per-node=1"
        )
    name = env.get("SLURMD_NODENAME", "")
    node_rank = nodes.index(name) if name in nodes else int(env["SLURM_NODEID"])
    port = _PORT_BASE + int(env["SLURM_JOB_ID"]) % _PORT_SPAN
    return SlurmStep(len(nodes), node_rank, nodes[0], port)


def expand_hostlist(text: str) -> list[str]:
    """SLURM's compact host list as names: "gpu[01-03,07],login" is gpu01, gpu02,
    gpu03, gpu07 and login (number widths are kept)."""
    names: list[str] = []
    for part in re.findall(r"[^,\[]+(?:\[[^\]]*\][^,\[]*)*", text):
        names.extend(_expand(part))
    return names


def _expand(pattern: str) -> list[str]:
    match = re.search(r"\[([^\]]*)\]", pattern)
    if match is None:
        return [pattern]
    head, tail = pattern[: match.start()], pattern[match.end() :]
    out = []
    for item in match.group(1).split(","):
        first, _, last = item.partition("-")
        if not first.isdigit() or (last and not last.isdigit()):
            raise ConfigError(f"cannot read the SLURM host list {pattern!r}")
        width = len(first)
        for number in range(int(first), int(last or first) + 1):
            out.extend(_expand(f"{head}{number:0{width}d}{tail}"))
    return out

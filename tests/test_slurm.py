"""`srun ddpkit run train.py` needs no flags. No SLURM cluster can run here (no
slurmd/slurmctld, and no network to install them), so the tests set the variables as
srun sets them for each task, and run two "nodes" on loopback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ddpkit.errors import ConfigError
from ddpkit.processes.slurm import SlurmStep, expand_hostlist, slurm_step
from tests.conftest import ROOT


def test_host_lists_expand_as_slurm_writes_them() -> None:
    assert expand_hostlist("gpu[01-03,07],login") == ["gpu01", "gpu02", "gpu03", "gpu07", "login"]
    assert expand_hostlist("n[8-10]") == ["n8", "n9", "n10"]
    assert expand_hostlist("a-1,b[1-2]-ib") == ["a-1", "b1-ib", "b2-ib"]
    assert expand_hostlist("rack[1-2]-n[1-2]") == ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]
    with pytest.raises(ConfigError, match="cannot read the SLURM host list"):
        expand_hostlist("n[a-b]")


def _env(**extra: str) -> dict[str, str]:
    return {
        "SLURM_JOB_ID": "4242",
        "SLURM_NODEID": "1",
        "SLURM_STEP_NODELIST": "gpu[01-02]",
        "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
        "SLURMD_NODENAME": "gpu02",
        **extra,
    }


def test_the_step_gives_nodes_rank_address_and_a_port_from_the_job_id() -> None:
    assert slurm_step({}) is None
    assert slurm_step(_env()) == SlurmStep(2, 1, "gpu01", 20000 + 4242)
    with pytest.raises(ConfigError, match="--ntasks-per-node=1"):
        slurm_step(_env(SLURM_STEP_TASKS_PER_NODE="4(x2)"))


SCRIPT = """
import ddpkit
from ddpkit.parallel.ranks import all_gather_object


def main(ctx):
    ranks = all_gather_object(ctx.rank)
    ddpkit.print("world", ctx.world_size, "ranks", ranks)


if __name__ == "__main__":
    ddpkit.launch(main)
"""


@pytest.mark.slow
def test_srun_ddpkit_run_on_two_nodes_needs_no_flags(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    nodes = []
    for rank in (0, 1):
        env = {
            **os.environ,
            "SLURM_JOB_ID": str(os.getpid()),  # a port of its own for this test run
            "SLURM_NODEID": str(rank),
            "SLURM_STEP_NODELIST": "127.0.0.1,127.0.0.1",  # two "nodes" on loopback
            "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
        }
        nodes.append(
            subprocess.Popen(
                [sys.executable, "-m", "ddpkit", "run", "--nproc", "1", str(script)],
                env=env,
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    outs = [node.communicate(timeout=180) for node in nodes]
    for proc, (_, err) in zip(nodes, outs, strict=True):
        assert proc.returncode == 0, err
    assert "world 2 ranks [0, 1]" in outs[0][0] + outs[1][0]
    assert "node 1 of 2, rendezvous at 127.0.0.1:" in outs[1][1]

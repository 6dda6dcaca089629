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


def run_two_nodes(argv: list[str], envs: list[dict[str, str]]) -> list[tuple[int, str, str]]:
    """`python -m ddpkit ARGV` as two "nodes" on loopback, node N with `envs[N]` added to
    this environment; each node's (exit status, stdout, stderr)."""
    nodes = [
        subprocess.Popen(
            [sys.executable, "-m", "ddpkit", *argv],
            env={**os.environ, **env},
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for env in envs
    ]
    outs = [node.communicate(timeout=180) for node in nodes]
    return [(node.returncode, out, err) for node, (out, err) in zip(nodes, outs, strict=True)]


@pytest.mark.slow
def test_srun_ddpkit_run_on_two_nodes_needs_no_flags(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    envs = [
        {
            "SLURM_JOB_ID": str(os.getpid()),  # a port of its own for this test run
            "SLURM_NODEID": str(rank),
            "SLURM_STEP_NODELIST": "127.0.0.1,127.0.0.1",  # two "nodes" on loopback
            "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
        }
        for rank in (0, 1)
    ]
    outs = run_two_nodes(["run", "--nproc", "1", str(script)], envs)
    for code, _, err in outs:
        assert code == 0, err
    assert "world 2 ranks [0, 1]" in outs[0][1] + outs[1][1]
    assert "node 1 of 2, rendezvous at 127.0.0.1:" in outs[1][2]


# What an sbatch batch script sees: the job's variables, but no step's (no srun ran).
BATCH_SCRIPT_ENV = {
    "SLURM_JOB_ID": "4243",
    "SLURM_JOBID": "4243",
    "SLURM_NODEID": "0",
    "SLURM_PROCID": "0",
    "SLURM_LOCALID": "0",
    "SLURM_JOB_NODELIST": "gpu[01-02]",
    "SLURM_NODELIST": "gpu[01-02]",
    "SLURM_JOB_NUM_NODES": "2",
    "SLURM_TASKS_PER_NODE": "4(x2)",
    "SLURM_NTASKS": "8",
    "SLURMD_NODENAME": "gpu01",
}


def test_a_batch_script_without_srun_is_no_step() -> None:
    # `ddpkit run train.py` straight in an sbatch script runs on the node it is on, as
    # on a plain machine: the job's node list and tasks per node describe no step.
    assert slurm_step(BATCH_SCRIPT_ENV) is None
    one_task = {**BATCH_SCRIPT_ENV, "SLURM_TASKS_PER_NODE": "1(x2)"}
    assert slurm_step(one_task) is None  # would wait forever for a node 1 never started
    # srun in that script: the step's own variables, not the job's, decide.
    step = {
        **BATCH_SCRIPT_ENV,
        "SLURM_STEP_ID": "0",
        "SLURM_STEP_NODELIST": "gpu02",
        "SLURM_STEP_NUM_NODES": "1",
        "SLURM_STEP_TASKS_PER_NODE": "1",
        "SLURMD_NODENAME": "gpu02",
    }
    assert slurm_step(step) == SlurmStep(1, 0, "gpu02", 20000 + 4243)


@pytest.mark.slow
def test_ddpkit_run_in_a_batch_script_runs_as_on_one_machine(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    proc = subprocess.run(
        [sys.executable, "-m", "ddpkit", "run", "--nproc", "2", str(script)],
        env={**os.environ, **BATCH_SCRIPT_ENV},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "world 2 ranks [0, 1]" in proc.stdout
    assert "srun" not in proc.stderr and "SLURM" not in proc.stderr

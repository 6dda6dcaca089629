"""`ddpkit run train.py` with no flags where the platform says everything (issue 46):
torchrun's and Kubernetes PyTorchJob's `PET_*` variables, srun's, and the node-level
variables of other platforms; flags win, and two sources that disagree are refused."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from ddpkit.errors import ConfigError
from ddpkit.processes.pet import PetJob, pet_job
from ddpkit.processes.platforms import NodeSettings, resolve
from tests.conftest import ROOT
from tests.test_slurm import SCRIPT, run_two_nodes

POD = {  # what the training operator sets in the pod of worker 1 of 2
    "PET_NNODES": "2",
    "PET_NODE_RANK": "1",
    "PET_NPROC_PER_NODE": "4",
    "PET_MASTER_ADDR": "job-master-0",
    "PET_MASTER_PORT": "23456",
}


def test_the_pet_variables_describe_the_job() -> None:
    assert pet_job({}) is None
    assert pet_job(POD) == PetJob(2, 1, "4", "job-master-0", 23456, None)
    # torchrun's own names: an endpoint instead of the master, "gpu", a fixed range.
    job = pet_job(
        {"PET_NNODES": "3:3", "PET_RDZV_ENDPOINT": "10.0.0.5:29400", "PET_NPROC_PER_NODE": "gpu"}
    )
    assert job == PetJob(3, None, "auto", "10.0.0.5", 29400, None)
    with pytest.raises(ConfigError, match=r"PET_NNODES=1:4 asks for an elastic number of nodes"):
        pet_job({"PET_NNODES": "1:4"})
    with pytest.raises(ConfigError, match=r"PET_MASTER_PORT=http is not a whole number"):
        pet_job({"PET_MASTER_PORT": "http"})


def test_flags_win_and_the_platform_fills_the_rest() -> None:
    settings, note = resolve(NodeSettings(nproc="2"), POD)
    assert settings == NodeSettings(2, 1, "job-master-0", 23456, "2", 0)
    assert note == "ddpkit: from the PET_* variables: node 1 of 2, rendezvous at job-master-0:23456"
    alone, note = resolve(NodeSettings(), {})
    assert alone == NodeSettings(1, 0, None, 29500, "auto", 0) and note is None
    # MASTER_ADDR and MASTER_PORT name node 0 where nothing else does.
    two, _ = resolve(NodeSettings(nnodes=2, node_rank=1), {"MASTER_ADDR": "n0", "MASTER_PORT": "7"})
    assert (two.master_addr, two.master_port) == ("n0", 7)


def test_two_platforms_that_disagree_are_refused_unless_a_flag_chooses() -> None:
    srun = {
        "SLURM_JOB_ID": "4242",
        "SLURM_NODEID": "0",
        "SLURM_STEP_NODELIST": "gpu[01-02]",
        "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
        "SLURMD_NODENAME": "gpu01",
    }
    with pytest.raises(ConfigError) as info:
        resolve(NodeSettings(), {**srun, **POD})
    assert str(info.value) == (
        "srun's variables (SLURM job 4242) say 0 and the PET_* variables say 1 for "
        "--node-rank: pass --node-rank to choose"
    )
    chosen, _ = resolve(
        NodeSettings(node_rank=0, master_addr="gpu01", master_port=1), {**srun, **POD}
    )
    assert (chosen.nnodes, chosen.node_rank, chosen.master_addr) == (2, 0, "gpu01")


def test_world_size_and_rank_that_may_count_nodes_or_ranks_are_refused() -> None:
    env = {"WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "10.0.0.5"}
    with pytest.raises(ConfigError) as info:
        resolve(NodeSettings(), env)
    assert "pass --nnodes 2 --node-rank 1 --master-addr 10.0.0.5 if they count nodes" in str(
        info.value
    )
    assert resolve(NodeSettings(), {"WORLD_SIZE": "1", "RANK": "0"})[0].nnodes == 1
    assert resolve(NodeSettings(nnodes=2, node_rank=1), env)[0].master_addr == "10.0.0.5"


@pytest.mark.slow
def test_pet_variables_alone_start_two_nodes(tmp_path: Path) -> None:
    # As a PyTorchJob's two pods would, on loopback: `ddpkit run job.py`, no flag.
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    port = str(20000 + os.getpid() % 20000)
    envs = [
        {
            "PET_NNODES": "2",
            "PET_NODE_RANK": str(rank),
            "PET_NPROC_PER_NODE": "1",
            "PET_MASTER_ADDR": "127.0.0.1",
            "PET_MASTER_PORT": port,
        }
        for rank in (0, 1)
    ]
    outs = run_two_nodes(["run", str(script)], envs)
    for code, _, err in outs:
        assert code == 0, err
    assert "world 2 ranks [0, 1]" in outs[0][1] + outs[1][1]
    assert f"from the PET_* variables: node 1 of 2, rendezvous at 127.0.0.1:{port}" in outs[1][2]


def test_the_pytorchjob_example_runs_ddpkit_with_no_node_flags() -> None:
    yaml = pytest.importorskip("yaml")
    manifest = yaml.safe_load((ROOT / "docs" / "kubernetes" / "pytorchjob.yaml").read_text())
    assert manifest["kind"] == "PyTorchJob" and manifest["spec"]["nprocPerNode"]
    for role in ("Master", "Worker"):
        pod = manifest["spec"]["pytorchReplicaSpecs"][role]["template"]["spec"]
        command = pod["containers"][0]["command"]
        assert command[:2] == ["ddpkit", "run"], command
        assert not {"--nnodes", "--node-rank", "--master-addr"} & set(command), command
        assert "--resume" in command and pod["terminationGracePeriodSeconds"] >= 60


def test_a_worker_that_cannot_reach_node_0_says_what_it_was_given(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Its process group would retry without end: the shim tries first, for at most
    # --rdzv-timeout, and names the address, what it resolved to and the fix.
    from ddpkit.processes.shim import _reach_node_0

    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "node0.invalid")
    monkeypatch.setenv("MASTER_PORT", "29500")
    with pytest.raises(ConfigError, match=r"cannot resolve node 0's address 'node0.invalid'"):
        _reach_node_0(1.0)
    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    monkeypatch.setenv("MASTER_ADDR", "localhost")
    monkeypatch.setenv("MASTER_PORT", str(port))
    with pytest.raises(ConfigError) as info:
        _reach_node_0(1.0)
    assert f"cannot reach node 0 at localhost:{port} (resolved to " in str(info.value)
    assert "within 1 s (--rdzv-timeout)" in str(info.value)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # one machine: nothing to reach
    _reach_node_0(1.0)

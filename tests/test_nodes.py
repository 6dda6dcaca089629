"""Jobs on several machines, for real (issue 46): two network namespaces on this host,
each with its own network stack and host name (`tests/netns.py`), as two machines.
Slow, and skipped in one line where namespaces cannot be made (not root)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import netns
from tests.test_slurm import SCRIPT

MISSING = netns.missing()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(MISSING is not None, reason=str(MISSING))]


def _node_args(machines: netns.Machines, node: int, port: int, *extra: str) -> list[str]:
    return [
        *(sys.executable, "-m", "ddpkit", "run", "--nproc", "2", "--nnodes", "2"),
        *("--node-rank", str(node), "--master-addr", machines.address(0)),
        *("--master-port", str(port), *extra),
    ]


def test_two_machines_whose_names_do_not_resolve_train_together(tmp_path: Path) -> None:
    # Neither machine resolves the other's host name (no DNS, no /etc/hosts line): as
    # pods without a headless service. Torch's agent gave node 0's name to node 1's
    # workers, which then retried it forever; ddpkit gives its address on the route.
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    port = 20000 + os.getpid() % 20000
    with netns.Machines() as machines:
        nodes = [
            machines.popen(node, [*_node_args(machines, node, port), str(script)], env, tmp_path)
            for node in (0, 1)
        ]
        try:
            outs = [node.communicate(timeout=120) for node in nodes]
        finally:
            for node in nodes:
                node.kill()
    said = "\n".join(out + err for out, err in outs)
    assert [node.returncode for node in nodes] == [0, 0], said[-4000:]
    assert "world 4 ranks [0, 1, 2, 3]" in said, said[-4000:]
    assert "cannot be retrieved" not in said  # torch's c10d warnings, quieted


# A Trainer job of 4 ranks on 2 nodes that checkpoints and resumes: a callback slows
# each step (the tests stop it mid-run), says when it trains, and with CRASH_ONCE makes
# rank 2 (node 1) raise once.
JOB = """
import os
import sys
import time

import torch
from torch import nn

import ddpkit


class Slow(ddpkit.Callback):
    def on_step_end(self, trainer, step):
        time.sleep(0.02)
        if step == 3:
            ddpkit.print("training", flush=True)
        if os.environ.get("CRASH_ONCE") and step == 5 and trainer.ctx.rank == 2:
            mark = sys.argv[1] + ".crashed"
            if not os.path.exists(mark):
                open(mark, "w").close()
                raise ValueError("a bad batch on rank 2")


def main(ctx, folder):
    ddpkit.seed_everything(1)
    model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.1), nn.ReLU(), nn.Linear(16, 1))
    x = torch.randn(512, 8, generator=torch.Generator().manual_seed(3))
    data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))
    config = ddpkit.TrainConfig(
        epochs=int(sys.argv[2]), batch_size=4, checkpoint_dir=folder, progress=False, resume=True
    )
    result = ddpkit.Trainer(
        model, lambda p: torch.optim.AdamW(p, lr=1e-3), data, ctx, config,
        loss_fn=nn.functional.mse_loss, callbacks=[Slow()], log_fn=lambda s: None,
    ).fit()
    ddpkit.print("trained to step", result.global_step, flush=True)


if __name__ == "__main__":
    ddpkit.launch(main, sys.argv[1])
"""
STEPS_PER_EPOCH = 512 // (4 * 4)


def _start(
    machines: netns.Machines, tmp_path: Path, nodes: tuple[int, ...], *extra: str, **env: str
) -> list[subprocess.Popen[str]]:
    script = tmp_path / "job.py"
    script.write_text(JOB)
    port = 20000 + os.getpid() % 20000
    flags = ("--hang-timeout", "20", "--rdzv-timeout", "15", *extra)
    full = {**os.environ, "OMP_NUM_THREADS": "1", **env}
    return [
        machines.popen(
            node,
            [*_node_args(machines, node, port, *flags), str(script), str(tmp_path / "ck"), "20"],
            full,
            tmp_path,
        )
        for node in nodes
    ]


def _finish(nodes: list[subprocess.Popen[str]], timeout: float = 150) -> list[tuple[str, str]]:
    try:
        return [node.communicate(timeout=timeout) for node in nodes]
    finally:
        for node in nodes:
            node.kill()


def test_a_node_that_never_joins_is_said_in_one_line_within_the_rdzv_timeout(
    tmp_path: Path,
) -> None:
    with netns.Machines() as machines:
        started = time.monotonic()
        ((_, err),) = _finish(_start(machines, tmp_path, (0,)))
    took = time.monotonic() - started
    lines = err.strip().splitlines()
    assert lines[-1].startswith("ddpkit: error: the other nodes did not join within 15 s"), err
    assert f"--master-addr {machines.address(0)}" in lines[-1] and took < 15 + 30, took


def test_a_node_given_an_address_it_cannot_reach_says_so_in_one_line(tmp_path: Path) -> None:
    # Node 1 is told an address of node 0's network that nothing holds.
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    port = 20000 + os.getpid() % 20000
    with netns.Machines() as machines:
        nowhere = machines.address(200)
        argv = _node_args(machines, 1, port, "--rdzv-timeout", "10")
        argv[argv.index(machines.address(0))] = nowhere
        started = time.monotonic()
        ((_, err),) = _finish([machines.popen(1, [*argv, str(script)], env, tmp_path)])
    assert time.monotonic() - started < 10 + 30
    assert err.strip().splitlines()[-1] == (
        f"ddpkit: error: cannot reach the master at {nowhere}:{port} within 10 s: start node 0 "
        "first, or check --master-addr/--master-port and the firewall"
    ), err


def test_a_node_killed_mid_run_stops_the_others_naming_it(tmp_path: Path) -> None:
    with netns.Machines() as machines:
        nodes = _start(machines, tmp_path, (0, 1))
        assert nodes[0].stdout is not None
        line = nodes[0].stdout.readline()
        assert "training" in line, line + _finish(nodes)[0][1]
        os.kill(nodes[1].pid, signal.SIGKILL)
        started = time.monotonic()
        (_, err), _ = _finish(nodes)
    assert time.monotonic() - started < 20 + 30
    assert nodes[0].returncode == 1, err[-3000:]
    address = re.escape(machines.address(1))
    assert re.search(rf"ddpkit: node 1 \({address}\) went away in the middle of a collective", err)


def test_a_restart_across_nodes_resumes_and_trains_to_the_end(tmp_path: Path) -> None:
    with netns.Machines() as machines:
        nodes = _start(machines, tmp_path, (0, 1), "--max-restarts", "2", CRASH_ONCE="1")
        outs = _finish(nodes)
    said = "\n".join(out + err for out, err in outs)
    assert [node.returncode for node in nodes] == [0, 0], said[-4000:]
    assert "ddpkit: attempt 1 failed: rank 2 raised ValueError: a bad batch on rank 2" in said
    assert f"trained to step {20 * STEPS_PER_EPOCH}" in outs[0][0], said[-4000:]


def test_a_preempted_node_saves_with_every_rank_and_both_exit_75(tmp_path: Path) -> None:
    # SIGTERM reaches node 1's agent alone: every rank of both nodes saves after one
    # step, and both nodes end with 75 for the scheduler's requeue.
    with netns.Machines() as machines:
        nodes = _start(machines, tmp_path, (0, 1))
        assert nodes[0].stdout is not None
        line = nodes[0].stdout.readline()
        assert "training" in line, line + _finish(nodes)[0][1]
        os.kill(nodes[1].pid, signal.SIGTERM)
        outs = _finish(nodes)
    said = "\n".join(err for _, err in outs)
    assert [node.returncode for node in nodes] == [75, 75], said[-4000:]
    steps = {int(step) for step in re.findall(r"stopped by SIGTERM after step (\d+)", said)}
    assert len(steps) == 1, said[-4000:]
    assert (tmp_path / "ck" / f"ckpt-{steps.pop():09d}.pt").is_file()

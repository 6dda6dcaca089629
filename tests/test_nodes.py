"""Jobs on several machines, for real (issue 46): two network namespaces on this host,
each with its own network stack and host name (`tests/netns.py`), as two machines.
Slow, and skipped in one line where namespaces cannot be made (not root)."""

from __future__ import annotations

import os
import sys
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

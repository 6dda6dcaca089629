"""Two machines on one host, for the tests of jobs on several nodes: two Linux network
namespaces joined by a veth pair, each with its own loopback, address and host name,
as two machines on one network are (issue 46). Every test on 127.0.0.1 shares one
network stack and one host name, and so never meets what separate machines do: an
address that one of them cannot reach, a name that one cannot resolve.

Needs root (or CAP_NET_ADMIN and CAP_SYS_ADMIN), `ip` and `unshare`; `missing()` says in
one line why not, for the tests to skip with.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

SUBNET = "10.77.{}.{}"


def missing() -> str | None:
    """Why two machines cannot be made here, or None."""
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"no `{tool}` command: the namespace tests need iproute2 and util-linux"
    if os.geteuid() != 0:
        return "not root: the namespace tests need root (or CAP_NET_ADMIN and CAP_SYS_ADMIN)"
    probe = f"ddpk-probe-{uuid.uuid4().hex[:6]}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot make a network namespace here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


class Machines:
    """Two machines, `node0` and `node1`, at `address(0)` and `address(1)` (10.77.x.1
    and .2) on the two ends of a veth pair. A context manager: the namespaces, and the
    pair with them, go at its end."""

    def __init__(self, count: int = 2) -> None:
        if count != 2:
            raise ValueError("two machines: one veth pair joins them")
        self.tag = uuid.uuid4().hex[:6]
        self.names = [f"ddpk-{self.tag}-{i}" for i in range(count)]
        self.net = os.getpid() % 250

    def address(self, node: int) -> str:
        return SUBNET.format(self.net, node + 1)

    def __enter__(self) -> Machines:
        try:
            for name in self.names:
                _ip("netns", "add", name)
                _ip("-n", name, "link", "set", "lo", "up")
            a, b = f"va{self.tag}", f"vb{self.tag}"
            _ip("link", "add", a, "type", "veth", "peer", "name", b)
            for node, end in enumerate((a, b)):
                _ip("link", "set", end, "netns", self.names[node])
                _ip("-n", self.names[node], "addr", "add", f"{self.address(node)}/24", "dev", end)
                _ip("-n", self.names[node], "link", "set", end, "up")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for name in self.names:  # its veth end goes with it
            subprocess.run(["ip", "netns", "del", name], capture_output=True)

    def popen(
        self, node: int, argv: Sequence[str], env: dict[str, str], cwd: Path, **kw: Any
    ) -> subprocess.Popen[str]:
        """`argv` on machine `node`, whose host name is `node<N>` (a name no machine
        resolves: neither /etc/hosts nor a DNS server knows it)."""
        inner = ["sh", "-c", f'hostname node{node} && exec "$@"', "sh", *argv]
        command = ["ip", "netns", "exec", self.names[node], "unshare", "--uts", "--", *inner]
        return subprocess.Popen(
            command,
            env=env,
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            **kw,
        )

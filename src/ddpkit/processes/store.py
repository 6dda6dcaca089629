"""The rendezvous store: a TCP store that listens on one interface only (127.0.0.1 for
a job on one machine), on a socket held for the whole job."""

from __future__ import annotations

import os
import socket
from typing import Any

import torch
import torch.distributed as dist

from ddpkit.processes.config import LOOPBACK
from ddpkit.versions import release

# Public in torch.distributed, but not re-exported in its type stubs.
TCPStore: Any = dist.TCPStore  # type: ignore[attr-defined]
HashStore: Any = dist.HashStore  # type: ignore[attr-defined]

# torch 2.4 to 2.7 serve the store with libuv, which refuses a socket handed to it
# (asking first and retrying is not safe: the failed attempt may close the socket).
_LIBUV_REFUSES_SOCKETS = (2, 4) <= release(torch.__version__) < (2, 8)


def listening_socket(host: str, port: int = 0) -> socket.socket:
    """A TCP socket bound to `host` only (port 0: one the OS picks), already listening."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(1024)
    except OSError:
        sock.close()
        raise
    return sock


def serve_store(
    host: str = LOOPBACK,
    port: int = 0,
    world_size: int | None = None,
    *,
    listener: socket.socket | None = None,
    **kwargs: Any,
) -> Any:
    """A TCP store served on `host` only (default 127.0.0.1, at a port the OS picks), or
    on `listener`, a socket from `listening_socket`.

    TCPStore listens on every interface when it opens its own socket, so it is handed
    a socket already bound to `host`: a single-machine job is not reachable from the
    network. Holding the port for the whole job also means a second job can never get
    the same one.
    """
    sock = listener if listener is not None else listening_socket(host, port)
    port = sock.getsockname()[1]
    fd = sock.detach()  # the store closes the socket when it is destroyed
    options = {"is_master": True, "wait_for_workers": False, "master_listen_fd": fd, **kwargs}
    if _LIBUV_REFUSES_SOCKETS:
        options["use_libuv"] = False
    try:
        return TCPStore(host, port, world_size, **options)
    except BaseException:
        os.close(fd)
        raise


def loopback_interface() -> str | None:
    """The name of the loopback interface (Linux: lo), if there is one."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    return next((n for n in ("lo", "lo0") if n in names), None)

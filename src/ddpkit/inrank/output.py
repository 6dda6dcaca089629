"""A worker's side of `ddpkit run`'s output: its stdout and stderr go to `ddpkit run`'s
process, which shows each line whole after its rank and keeps it in the rank's log (see
`ddpkit.processes.output`).

The shim calls `attach` before it imports anything heavy, so this module imports nothing
but the standard library.
"""

from __future__ import annotations

import os
import socket
import sys
from typing import IO, Any

# The workers' environment: where to send their output (host:port:token), which of the
# console's streams are terminals ("out,err", "err", ...), and "1" when the agent puts
# the rank before each line (ddpkit.print then leaves its own out).
OUTPUT_ENV = "DDPKIT_RUN_OUTPUT"
TTY_ENV = "DDPKIT_RUN_TTY"
PREFIX_ENV = "DDPKIT_RANK_PREFIX"
# The file descriptor each stream of a worker replaces.
STREAM_FDS = {"out": 1, "err": 2}


def attach() -> bool:
    """Send this worker's stdout and stderr to `ddpkit run`'s process, which shows them
    and keeps them in this rank's log. False, with the output left as it was, outside
    `ddpkit run` or when its process cannot be reached."""
    address = os.environ.get(OUTPUT_ENV)
    if not address:
        return False
    try:
        sockets = {kind: _connect(address, kind) for kind in STREAM_FDS}
    except (OSError, ValueError):
        return False
    terminals = os.environ.get(TTY_ENV, "").split(",")
    for kind, sock in sockets.items():
        stream = sys.stdout if kind == "out" else sys.stderr
        if stream is not None:
            stream.flush()  # what was said before goes where it was going
        os.dup2(sock.fileno(), STREAM_FDS[kind])
        sock.close()
    # Libraries ask sys.stdout whether it is a terminal (progress bars, colours); a
    # socket would say no where the user's console says yes.
    if "out" in terminals and sys.stdout is not None:
        sys.stdout = _Terminal(sys.stdout)
    if "err" in terminals and sys.stderr is not None:
        sys.stderr = _Terminal(sys.stderr)
    return True


def log_only(text: str) -> bool:
    """Write `text` to this rank's log but not to the console (a whole traceback: the
    agent shows its own account of it). False outside `ddpkit run`."""
    address = os.environ.get(OUTPUT_ENV)
    if not address:
        return False
    try:
        with _connect(address, "log") as sock:
            sock.sendall(text.encode(errors="replace"))
    except (OSError, ValueError):
        return False
    return True


def _connect(address: str, kind: str) -> socket.socket:
    host, port, token = address.rsplit(":", 2)
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.settimeout(None)  # blocking, as a terminal or a pipe is
    env = os.environ
    who = [env.get("RANK", "0"), env.get("LOCAL_RANK", "0")]
    attempt = env.get("TORCHELASTIC_RESTART_COUNT", "0")
    sock.sendall(f"{token} {' '.join(who)} {attempt} {kind}\n".encode())
    return sock


class _Terminal:
    """A worker's sys.stdout or sys.stderr that says it is a terminal, as the console
    that shows it is; everything else is the stream's own."""

    def __init__(self, stream: IO[str]) -> None:
        self._stream = stream

    def isatty(self) -> bool:
        return True

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)

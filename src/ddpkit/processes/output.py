"""What the ranks of `ddpkit run` print: each line whole and once, with its rank, on the
console and in the rank's log.

torchrun's `--tee` has each worker write into files that its agent tails. Here each
worker's shim connects its stdout and stderr (file descriptors 1 and 2, so the output
of C code, of subprocesses and of a crashing interpreter comes too, not only `print`'s)
to a socket that `RankOutput` serves on loopback in `ddpkit run`'s process, before it
imports anything heavy. One thread there reads every rank's bytes and cuts them into
lines; each whole line then goes

- to the console, stdout to stdout and stderr to stderr, after `[rank N] ` (on by
  default when the job has more than one rank), unless `--local-ranks-filter` leaves
  its local rank out. One process writes every line, so the ranks' lines never mix,
  however the ranks wrote them;
- to the rank's log, `rank<N>.log`: its stdout and stderr together, in the order they
  came, without the prefix; in `--log-dir`, or in the job's scratch folder, which the
  agent keeps when the job fails.

A progress bar, redrawn with "\\r", is drawn as it comes when the console is a terminal;
a log keeps the last drawing of each line only.

The worker's side, `attach` and `log_only`, is `ddpkit.inrank.output`.
"""

from __future__ import annotations

import contextlib
import hmac
import secrets
import selectors
import socket
import sys
import threading
import time
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, BinaryIO

from ddpkit.inrank.output import OUTPUT_ENV, PREFIX_ENV, STREAM_FDS, TTY_ENV
from ddpkit.processes.config import LOOPBACK

# The streams a worker sends: its stdout and stderr, and "log", which goes to its log alone.
_KINDS = (*STREAM_FDS, "log")
# Clears the terminal's line (back to its start, then erase): before a line is written
# over a progress bar that has not ended its line.
_ERASE = b"\r\x1b[K"
# A "line" that never ends (binary data, a bar without "\r") is cut at this length.
_LONGEST = 1 << 20
# torch's warnings that repeat on every rank and tell a user of ddpkit run nothing to
# do: kept in the rank's log, not shown. Each ends with an empty line of its own.
_NOISE = (
    # A node whose host name nothing resolves (a pod, a container): ddpkit gives the
    # other nodes its address, so the job trains (issue 46).
    b"[c10d] The hostname of the client socket cannot be retrieved",
)


@dataclass(eq=False)  # each connection is its own, in a set
class _Stream:
    """One connection: a worker's stdout, stderr or log-only text, once its header
    (token, rank, local rank, attempt, kind) has come."""

    sock: socket.socket
    kind: str = ""  # "" until the header has come
    rank: int = 0
    local_rank: int = 0
    attempt: int = 0
    pending: bytes = b""  # the header, or the line not ended yet
    hid: bool = False  # the last line shown was a warning of _NOISE, not shown


class _Console:
    """One of this process's streams, written in bytes; given up (the logs still get
    everything) once it cannot be written, such as a pipe whose reader has gone."""

    def __init__(self, stream: IO[str] | None) -> None:
        self.stream = stream
        try:
            self.tty = stream is not None and stream.isatty()
        except (OSError, ValueError):
            self.tty = False

    def write(self, data: bytes) -> None:
        if self.stream is None:
            return
        try:
            self.stream.flush()  # what this process said before comes first
            buffer = getattr(self.stream, "buffer", None)
            if buffer is not None:
                buffer.write(data)  # one call: a whole line, never part of one
                buffer.flush()
            else:
                self.stream.write(data.decode(errors="replace"))
                self.stream.flush()
        except (OSError, ValueError):
            self.stream = None


class RankOutput:
    """Serves the sockets that the workers' stdout and stderr write into; writes what
    they say as whole lines to the console and to each rank's log in `logs`.

    `prefix`: put `[rank N] ` before each line on the console. `shown`: the local ranks
    whose lines the console shows (None: all). `ranks`: the ranks whose log is made at
    once, so that a rank stopped before it said anything still has its (empty) log.
    """

    def __init__(
        self,
        logs: Path,
        *,
        prefix: bool,
        shown: Collection[int] | None = None,
        ranks: Iterable[int] = (),
    ) -> None:
        self.logs = logs
        self._prefix, self._shown = prefix, None if shown is None else frozenset(shown)
        self._token = secrets.token_hex(16)
        self._listener = socket.create_server((LOOPBACK, 0))
        self._listener.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._streams: set[_Stream] = set()
        self._files: dict[int, BinaryIO | None] = {}  # None: could not be written
        self._started: set[tuple[int, int]] = set()  # (rank, attempt) seen
        self._console = {"out": _Console(sys.stdout), "err": _Console(sys.stderr)}
        self._bar: _Console | None = None  # the console whose line a progress bar holds
        self._closing = threading.Event()
        self._deadline = 0.0
        self._thread = threading.Thread(target=self._serve, name="ddpkit-output", daemon=True)
        logs.mkdir(parents=True, exist_ok=True)
        for rank in ranks:
            self._log(rank)

    def env(self) -> dict[str, str]:
        """What the workers need to find this (see `attach`)."""
        host, port = self._listener.getsockname()[:2]
        env = {
            OUTPUT_ENV: f"{host}:{port}:{self._token}",
            TTY_ENV: ",".join(kind for kind, console in self._console.items() if console.tty),
        }
        if self._prefix:
            env[PREFIX_ENV] = "1"
        return env

    def start(self) -> RankOutput:
        self._thread.start()
        return self

    def close(self, wait_s: float = 3.0) -> None:
        """Write what the workers still send, then end. Call it once they have exited: it
        waits up to `wait_s` seconds for the processes they started (which may hold
        their stdout) to end too, then writes the lines that never ended."""
        if self._closing.is_set():
            return
        self._deadline = time.monotonic() + wait_s
        self._closing.set()
        if self._thread.is_alive():
            self._thread.join(wait_s + 5.0)
        if self._thread.is_alive():  # stuck writing to a console that takes nothing
            return
        for stream in list(self._streams):
            self._end(stream)
        self._selector.close()
        self._listener.close()
        for file in self._files.values():
            if file is not None:
                with contextlib.suppress(OSError):
                    file.close()

    def _serve(self) -> None:
        while True:
            events = self._selector.select(timeout=0.05)
            # Reads before new connections: a rank's last output comes before what its
            # next connection (the traceback for its log) says.
            events.sort(key=lambda event: event[0].data is None)
            for key, _ in events:
                try:
                    if key.data is None:
                        self._accept()
                    else:
                        self._read(key.data)
                except Exception as exc:  # never stop serving: the ranks would block
                    self._lost(key.data, exc)
            if self._closing.is_set() and (
                not (events or self._streams) or time.monotonic() > self._deadline
            ):
                return

    def _lost(self, stream: _Stream | None, exc: Exception) -> None:
        if stream is None:
            return
        self._drop(stream)
        print(
            f"ddpkit: warning: lost the output of rank {stream.rank} ({exc!r}): please report it",
            file=sys.stderr,
            flush=True,
        )

    def _accept(self) -> None:
        try:
            sock, _ = self._listener.accept()
        except OSError:
            return
        sock.setblocking(False)
        stream = _Stream(sock)
        self._streams.add(stream)
        self._selector.register(sock, selectors.EVENT_READ, stream)

    def _read(self, stream: _Stream) -> None:
        try:
            data = stream.sock.recv(1 << 16)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._end(stream)
            return
        if not stream.kind:
            stream.pending += data
            header, newline, data = stream.pending.partition(b"\n")
            if not newline:
                if len(stream.pending) > 256:  # no header of ours
                    self._drop(stream)
                return
            stream.pending = b""
            if not self._knows(stream, header):
                self._drop(stream)
                return
        self._take(stream, data)

    def _knows(self, stream: _Stream, header: bytes) -> bool:
        """Read the header: whose stream this is. False for a stranger's connection."""
        fields = header.decode(errors="replace").split()
        if len(fields) != 5 or not hmac.compare_digest(fields[0], self._token):
            return False
        try:
            stream.rank, stream.local_rank, stream.attempt = map(int, fields[1:4])
        except ValueError:
            return False
        if fields[4] not in _KINDS:
            return False
        stream.kind = fields[4]
        if stream.attempt and (stream.rank, stream.attempt) not in self._started:
            # The agent restarted the workers (--max-restarts): the log goes on.
            self._write_log(stream.rank, f"--- restart {stream.attempt} ---\n".encode())
        self._started.add((stream.rank, stream.attempt))
        return True

    def _take(self, stream: _Stream, data: bytes) -> None:
        if stream.kind == "log":
            self._write_log(stream.rank, data)
            return
        *lines, stream.pending = (stream.pending + data).split(b"\n")
        if len(stream.pending) > _LONGEST:
            lines.append(stream.pending)
            stream.pending = b""
        if b"\r" in stream.pending:
            # A progress bar: only its last drawing counts. A "\r" at the end may be the
            # first half of a "\r\n".
            end = b"\r" if stream.pending.endswith(b"\r") else b""
            stream.pending = b"\r" + _last_drawing(stream.pending) + end
        if lines:
            self._lines(stream, [_last_drawing(line) for line in lines])
        if stream.pending.startswith(b"\r"):
            self._draw_bar(stream)

    def _lines(self, stream: _Stream, lines: list[bytes]) -> None:
        self._write_log(stream.rank, b"".join(line + b"\n" for line in lines))
        if not self._shows(stream):
            return
        lines = _without_noise(stream, lines)
        if not lines:
            return
        prefix = self._prefix_of(stream.rank)
        console = self._console[stream.kind]
        data = b"".join(prefix + line + b"\n" for line in lines)
        if self._bar is not None and console.tty:
            data, self._bar = _ERASE + data, None  # over the bar's line
        console.write(data)

    def _draw_bar(self, stream: _Stream) -> None:
        console = self._console[stream.kind]
        if not (console.tty and self._shows(stream)):
            return  # a console that is a file or a pipe gets the bar's last drawing only
        drawing = _last_drawing(stream.pending)
        if not drawing.strip():  # the bar erased itself (tqdm's leave=False)
            console.write(_ERASE)
            self._bar = None
            return
        console.write(_ERASE + self._prefix_of(stream.rank) + drawing)
        self._bar = console

    def _end(self, stream: _Stream) -> None:
        """The connection ended (its worker exited): its last line, if it never ended."""
        if stream.kind in STREAM_FDS and stream.pending:
            last = _last_drawing(stream.pending)
            if last.strip() or not stream.pending.startswith(b"\r"):  # not an erased bar
                self._lines(stream, [last])
            elif self._bar is self._console[stream.kind]:
                self._console[stream.kind].write(_ERASE)
                self._bar = None
        stream.pending = b""
        self._drop(stream)

    def _drop(self, stream: _Stream) -> None:
        self._streams.discard(stream)
        with contextlib.suppress(KeyError, ValueError, OSError):
            self._selector.unregister(stream.sock)
        stream.sock.close()

    def _shows(self, stream: _Stream) -> bool:
        return self._shown is None or stream.local_rank in self._shown

    def _prefix_of(self, rank: int) -> bytes:
        return f"[rank {rank}] ".encode() if self._prefix else b""

    def _log(self, rank: int) -> BinaryIO | None:
        if rank not in self._files:
            path = self.logs / f"rank{rank}.log"
            try:
                self._files[rank] = path.open("wb")  # a new run replaces an old run's log
            except OSError as exc:
                self._cannot_log(path, exc)
                self._files[rank] = None
        return self._files[rank]

    def _write_log(self, rank: int, data: bytes) -> None:
        file = self._log(rank)
        if file is None:
            return
        try:
            file.write(data)
            file.flush()  # a log is read while the job runs, and after a crash
        except OSError as exc:
            self._cannot_log(Path(file.name), exc)
            self._files[rank] = None

    def _cannot_log(self, path: Path, exc: OSError) -> None:
        print(
            f"ddpkit: warning: cannot write {path} ({exc.strerror or exc}): "
            "from now on that rank's output goes to the console only",
            file=sys.stderr,
            flush=True,
        )


def _without_noise(stream: _Stream, lines: list[bytes]) -> list[bytes]:
    """`lines` less the warnings of _NOISE and the empty line after each."""
    kept = []
    for line in lines:
        if any(noise in line for noise in _NOISE):
            stream.hid = True
        elif not (stream.hid and not line.strip()):
            kept.append(line)
            stream.hid = False
        else:
            stream.hid = False
    return kept


def _last_drawing(line: bytes) -> bytes:
    """What a terminal shows of `line` in the end: the text after its last "\\r" (a
    progress bar's last drawing); a "\\r\\n" ending is a plain end of line."""
    return line.removesuffix(b"\r").rsplit(b"\r", 1)[-1]

"""LaunchConfig: how the processes of a job are started and watched.

One object for `launch()`, `ddpkit train` and `ddpkit run` (torchrun's elastic agent):
each setting is declared and checked here once. A bad value is refused when the config
is made, before any process starts, in one line that names the command-line flag and
the Python keyword, for the same check serves both kinds of user.
"""

from __future__ import annotations

import ipaddress
import math
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from ddpkit.errors import ConfigError
from ddpkit.processes.preemption import DEFAULT_SIGNAL_GRACE
from ddpkit.processes.report import DEFAULT_HANG_TIMEOUT

MAX_PORT = 65535
# Every store and socket ddpkit serves listens here, unless the user names node 0's
# address for a job of several machines.
LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class LaunchConfig:
    """How the workers of a job start and are watched. Every field has a default.

    `launch(fn, config=LaunchConfig(...))` takes it whole; `ddpkit train` and
    `ddpkit run` build one from their flags."""

    nprocs: int | str = "auto"
    """Processes on this machine: "auto" is one per visible GPU, else one per CPU core."""
    backend: str = "auto"
    """"auto" (nccl on GPUs, gloo on CPU), "gloo" or "nccl"."""
    init: str = "tcp"
    """How ranks meet under `launch`: "tcp" (a store on 127.0.0.1 at a free port) or
    "file"."""
    timeout: float = 1800.0
    """Seconds any collective may wait before it fails (torch's default, 30 min)."""
    hang_timeout: float | None = None
    """Seconds ranks may wait for one that makes no progress before the job is stopped
    and diagnosed, and how often a rank that keeps the others waiting while it works is
    reported (0: never). At most `timeout`; None: 300, or `timeout` if shorter. On NCCL
    it also shortens `timeout` to a little less (30 s less, or half of it if that is
    shorter), so that NCCL's watchdog names the collective that waits before the job is
    stopped: give a longer one where ranks rightly wait longer (`rank_zero_first`)."""
    signal_grace: float = DEFAULT_SIGNAL_GRACE
    """After SIGTERM, SIGUSR1 or Ctrl-C, how long the ranks may take to save and stop (a
    `Trainer` with a checkpoint folder saves after the step they agree on) before they
    are stopped regardless. The signal may reach `launch`'s process, which passes it
    on, or any worker."""
    start: str = "auto"
    """How `launch` starts workers: "auto" forks them from this process (torch already
    imported: the first step comes seconds sooner) when that is safe, that is
    a CPU job on Linux with no thread started since ddpkit was imported;
    otherwise "spawn" starts fresh interpreters, as `mp.spawn` does. For a
    function from a notebook or `python -c`, "auto" forks a CPU job on Linux
    even while threads run (a Jupyter kernel always runs some), as Accelerate's
    `notebook_launcher` does; a GPU job, or one after CUDA was initialised in
    this process, cannot start from there and raises ConfigError. With one
    process, "auto" runs `fn` in this process (no worker at all); naming a
    start method starts one worker that way, as with several."""
    nnodes: int = 1
    """Machines in the job (`ddpkit run` only: `launch` runs on one machine)."""
    node_rank: int = 0
    """This machine's number, 0 to nnodes - 1."""
    master_addr: str | None = None
    """Node 0's address; None for one machine (a store on loopback)."""
    master_port: int = 29500
    """The rendezvous port on node 0 (`ddpkit run`)."""
    local_addr: str | None = None
    """The address this machine gives the other nodes, which they must reach (`ddpkit
    run`, several nodes); None: that of its interface on the route to node 0 (see
    `ddpkit.processes.machine.advertised_address`)."""
    max_restarts: int = 0
    """Times torchrun's agent restarts the workers after a failure (`ddpkit run`)."""
    rdzv_timeout: float = 300.0
    """Seconds `ddpkit run` waits for every node to join."""
    rank_prefix: bool | None = None
    """`ddpkit run`: start each line that a rank prints with `[rank N] ` on the console;
    None: when the job has more than one rank."""
    local_ranks_filter: tuple[int, ...] | None = None
    """`ddpkit run`: the local ranks (0 to nprocs - 1 on each machine) whose output the
    console shows; None: every rank. The others' output still goes to their logs."""
    audit: bool = False
    """Watch what the ranks do (optimizer steps, saves, loads, samplers, the DDP wrap, the
    group's end) and, after the job, print the DDP pitfalls it actually committed, in the
    checker's format (see `ddpkit.inrank.audit`). Off by default; it costs a lookup per
    optimizer step and one hash of the weights at the end. With one process there is
    nothing to compare; under an agent, use `ddpkit run --audit`."""
    log_dir: str | None = None
    """`ddpkit run`: a folder for each rank's output (stdout and stderr), `rank<N>.log`;
    None: the logs are kept only when the job fails, in a folder named then."""
    cpu: bool = False
    """`ddpkit run --cpu`: rehearse a GPU script on CPU ranks over gloo, unedited: its
    CUDA calls are mapped onto the CPU in each rank (see `ddpkit.processes.rehearse`),
    and the job is a CPU job (gloo, one process per core unless nprocs says otherwise,
    the cores shared out between the ranks)."""
    # Whether hang_timeout was given, not resolved from the timeout (see `merged`).
    _hang_given: bool = field(default=False, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name, allowed in (
            ("backend", ("auto", "gloo", "nccl")),
            ("init", ("tcp", "file")),
            ("start", ("auto", "fork", "forkserver", "spawn")),
        ):
            value = getattr(self, name)
            if value not in allowed:
                choices = ", ".join(repr(a) for a in allowed)
                raise ConfigError(f"{name} must be one of {choices} (got {value!r})")
        if not (isinstance(self.timeout, int | float) and 0 < self.timeout < math.inf):
            raise ConfigError(
                f"timeout must be a number of seconds > 0 (got {self.timeout}): pass timeout=1800"
            )
        hang = self.hang_timeout
        object.__setattr__(self, "_hang_given", hang is not None)
        if hang is None:
            hang = min(DEFAULT_HANG_TIMEOUT, self.timeout)
            object.__setattr__(self, "hang_timeout", hang)
        # Each message names the flag and the keyword: the same check serves both.
        if not (math.isfinite(hang) and hang >= 0):
            raise ConfigError(
                f"the hang timeout must be a finite number of seconds >= 0 (got {hang}): "
                f"pass --hang-timeout {DEFAULT_HANG_TIMEOUT:.0f}, or hang_timeout="
                f"{DEFAULT_HANG_TIMEOUT:.0f} in Python (0 turns it off)"
            )
        if hang > self.timeout:
            # A collective fails at `timeout`: a longer hang_timeout would never be reached.
            raise ConfigError(
                f"the hang timeout ({hang:g} s) must not exceed the collective timeout "
                f"({self.timeout:g} s), when the collectives fail anyway: pass --hang-timeout "
                f"{self.timeout:g} or less, or in Python hang_timeout={self.timeout:g} or less "
                "(or a larger timeout=)"
            )
        if not 0 < self.signal_grace < math.inf:
            raise ConfigError(
                f"the signal grace must be a number of seconds > 0 (got {self.signal_grace}): "
                f"pass --signal-grace {DEFAULT_SIGNAL_GRACE:.0f}, or signal_grace="
                f"{DEFAULT_SIGNAL_GRACE:.0f} in Python"
            )
        if self.nnodes < 1:
            raise ConfigError(f"--nnodes must be >= 1 (got {self.nnodes})")
        if not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(
                f"--node-rank must be in [0, {self.nnodes}) for --nnodes {self.nnodes} "
                f"(got {self.node_rank}): number the machines 0 to {self.nnodes - 1}"
            )
        if self.nnodes > 1 and not self.master_addr:
            raise ConfigError("--nnodes > 1 needs --master-addr: the address of node 0")
        if self.max_restarts < 0:
            raise ConfigError(f"--max-restarts must be >= 0 (got {self.max_restarts})")
        if not 1 <= self.master_port <= MAX_PORT:
            raise ConfigError(
                f"--master-port must be a port number from 1 to {MAX_PORT} "
                f"(got {self.master_port}): pass --master-port 29500"
            )
        if not (math.isfinite(self.rdzv_timeout) and self.rdzv_timeout >= 1):
            raise ConfigError(
                f"--rdzv-timeout must be a finite number of seconds >= 1 "
                f"(got {self.rdzv_timeout}): pass --rdzv-timeout 300"
            )
        self._check_output()

    def _check_output(self) -> None:
        shown = self.local_ranks_filter
        if shown is not None:
            shown = tuple(sorted(set(shown)))
            object.__setattr__(self, "local_ranks_filter", shown)
            if not shown:
                raise ConfigError(
                    "--local-ranks-filter '' names no local rank: pass local ranks, such as "
                    "--local-ranks-filter 0 or 0,1, or leave it out to show every rank"
                )
            procs = self.nprocs if isinstance(self.nprocs, int) else None
            bad = [r for r in shown if r < 0 or (procs is not None and r >= procs)]
            if bad:
                given = ",".join(str(r) for r in shown)
                which = (
                    f"with --nproc {procs} (local ranks 0 to {procs - 1}): pass local ranks "
                    f"from 0 to {procs - 1}"
                    if procs is not None and procs > 0
                    else "(local ranks count from 0): pass local ranks"
                )
                raise ConfigError(
                    f"--local-ranks-filter {given}: there is no local rank {bad[0]} {which}, "
                    "such as --local-ranks-filter 0"
                )
        if self.log_dir is not None and not str(self.log_dir).strip():
            raise ConfigError(
                f"--log-dir {self.log_dir!r} names no folder: pass --log-dir DIR, or leave it out"
            )

    def merged(self, keywords: Mapping[str, Any]) -> LaunchConfig:
        """This config with `keywords` (field names and values, as given to `launch`)
        set where it leaves a field at its default; a keyword that contradicts a field
        it sets is refused, for only one of them could be meant."""
        values = {f.name: getattr(self, f.name) for f in fields(self) if f.init}
        if not self._hang_given:
            values["hang_timeout"] = None  # resolved again, from the timeout it ends with
        defaults = {f.name: f.default for f in fields(self)}
        for name, value in keywords.items():
            mine = values[name]
            if mine != defaults[name] and mine != value:
                raise ConfigError(
                    f"{name}={value!r} disagrees with the LaunchConfig's {name}={mine!r}: "
                    "give each setting once, as a keyword or in the config"
                )
            values[name] = value
        return LaunchConfig(**values)

    @property
    def store_host(self) -> str:
        """Where the rendezvous store listens: loopback for one machine, else node 0's
        address as the user gave it."""
        return LOOPBACK if self.nnodes == 1 else str(self.master_addr)

    @property
    def local(self) -> bool:
        """Every worker runs on this machine: sockets can stay on loopback."""
        return self.nnodes == 1 or is_loopback(self.store_host)

    @property
    def hang_s(self) -> float:
        """The hang timeout in seconds (resolved: never None)."""
        assert self.hang_timeout is not None  # set in __post_init__
        return self.hang_timeout


def parse_local_ranks(text: str) -> tuple[int, ...]:
    """`--local-ranks-filter`'s text, such as "0" or "0,2", as local ranks (() for "");
    ConfigError when it is not a comma list of whole numbers."""
    parts = [part.strip() for part in text.split(",")]
    if not any(parts):
        return ()
    try:
        return tuple(int(part) for part in parts)
    except ValueError:
        raise ConfigError(
            f"--local-ranks-filter {text!r} is not a comma list of local ranks: pass numbers, "
            "such as --local-ranks-filter 0 or 0,1"
        ) from None


def is_loopback(host: str) -> bool:
    """Whether `host` names this machine's loopback interface."""
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False

"""`ddpkit run`: start any training script on every GPU or CPU core through torchrun's
elastic agent, and say which rank failed, or where every rank hangs, when it goes wrong.

The flags are checked here; `ddpkit.agent` does the work.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ddpkit.diagnosis.report import DEFAULT_HANG_TIMEOUT
from ddpkit.errors import ConfigError

HELP = "run a training script on every GPU or CPU core through torchrun's elastic agent"


def add_parser(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "run",
        help=HELP,
        description=HELP,
        usage="ddpkit run [options] (SCRIPT | -m MODULE) [ARGS ...]",
    )
    p.add_argument(
        "--nproc",
        default="auto",
        help="processes on this machine: auto = one per GPU, else one per CPU core",
    )
    p.add_argument("--nnodes", type=int, default=1, help="machines in the job (default 1)")
    p.add_argument("--node-rank", type=int, default=0, help="this machine's index, 0..nnodes-1")
    p.add_argument("--master-addr", help="address of node 0 (needed with --nnodes > 1)")
    p.add_argument("--master-port", type=int, default=29500, help="port on node 0 (default 29500)")
    p.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="restart all workers up to K times after a failure (default 0)",
    )
    p.add_argument(
        "--hang-timeout",
        type=float,
        default=DEFAULT_HANG_TIMEOUT,
        help="stop the job and show every rank's stack when no rank has made "
        f"progress for this many seconds (default {DEFAULT_HANG_TIMEOUT:.0f}; 0: off)",
    )
    p.add_argument(
        "--rdzv-timeout",
        type=float,
        default=300.0,
        help="seconds to wait for the other nodes (default 300)",
    )
    p.add_argument("-m", dest="module", metavar="MODULE", help="run a module, like python -m")
    p.add_argument("script", nargs="?", help="the training script")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ddpkit.agent import AgentOptions, run_script

    command, nproc = _validate(args)
    return run_script(
        AgentOptions(
            command=command,
            nproc=nproc,
            nnodes=args.nnodes,
            node_rank=args.node_rank,
            master_addr=args.master_addr,
            master_port=args.master_port,
            max_restarts=args.max_restarts,
            hang_timeout=args.hang_timeout,
            rdzv_timeout=args.rdzv_timeout,
        )
    )


def _validate(args: argparse.Namespace) -> tuple[list[str], int]:
    """The worker command (after the shim) and the processes per node, or ConfigError."""
    from ddpkit.launcher import resolve_backend, resolve_nprocs

    nproc = resolve_nprocs(args.nproc, resolve_backend("auto"))
    if args.nnodes < 1:
        raise ConfigError(f"--nnodes must be >= 1 (got {args.nnodes})")
    if not 0 <= args.node_rank < args.nnodes:
        raise ConfigError(
            f"--node-rank must be in [0, {args.nnodes}) for --nnodes {args.nnodes} "
            f"(got {args.node_rank}): number the machines 0 to {args.nnodes - 1}"
        )
    if args.nnodes > 1 and not args.master_addr:
        raise ConfigError("--nnodes > 1 needs --master-addr: the address of node 0")
    if args.max_restarts < 0:
        raise ConfigError(f"--max-restarts must be >= 0 (got {args.max_restarts})")
    if args.hang_timeout < 0:
        raise ConfigError(f"--hang-timeout must be >= 0 seconds (got {args.hang_timeout})")
    if args.module:
        import importlib.util

        # A script given after -m MODULE is the module's first argument.
        extra = [args.script, *args.args] if args.script else list(args.args)
        try:
            found = importlib.util.find_spec(args.module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise ConfigError(f"no module named {args.module!r}: check the name and sys.path")
        return ["-m", args.module, *extra], nproc
    if not args.script:
        raise ConfigError("nothing to run: pass a script (ddpkit run train.py) or -m MODULE")
    if not Path(args.script).is_file():
        raise ConfigError(f"script {args.script!r} does not exist")
    return [args.script, *args.args], nproc

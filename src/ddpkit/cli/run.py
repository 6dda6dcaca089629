"""`ddpkit run`: start any training script on every GPU or CPU core through torchrun's
elastic agent, and say which rank failed, or where every rank hangs, when it goes wrong.

The flags are checked here; `ddpkit.processes.agent` does the work.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
from pathlib import Path
from typing import Any

from ddpkit.cli.flags import Parser, add_process_flags, check_folder, check_processes
from ddpkit.errors import ConfigError
from ddpkit.findings import Finding, Severity, format_json, write_audit_log
from ddpkit.processes.audit import report as audit_report
from ddpkit.processes.config import LaunchConfig, parse_local_ranks
from ddpkit.processes.platforms import NodeSettings, resolve
from ddpkit.processes.profile import VERDICT_EVERY_S, RankProfile
from ddpkit.userfiles import kind_of

HELP = "run a training script on every GPU or CPU core through torchrun's elastic agent"
# `--baseline`: the one-rank run's optimizer steps, the warm-up's included.
BASELINE_STEPS = 40


def add_parser(sub: Any) -> None:
    # The command line after `run` reaches `run` whole (no character starts an option
    # here): run's own options end where the script (or -m MODULE) begins, and only
    # `split_command` can tell where that is. argparse alone gave a script's name to
    # --audit's optional value, and the script's flags after it to run.
    p: argparse.ArgumentParser = sub.add_parser("run", help=HELP, add_help=False, prefix_chars="\0")
    p.add_argument("argv", nargs=argparse.REMAINDER)
    p.set_defaults(func=run)


def _options_parser() -> argparse.ArgumentParser:
    """run's own options (and, for --help, the script and its arguments)."""
    p = Parser(
        prog="ddpkit run",
        description=HELP,
        usage="ddpkit run [options] (SCRIPT | -m MODULE) [ARGS ...]",
        epilog="Everything after SCRIPT (or -m MODULE) goes to the script, whatever it "
        "looks like; --audit takes its mode only as --audit=strict.",
    )
    p.add_argument(
        "--nnodes", type=int, help="machines in the job (default 1; under srun: the step's)"
    )
    p.add_argument(
        "--node-rank", type=int, help="this machine's index, 0..nnodes-1 (under srun: its own)"
    )
    p.add_argument(
        "--master-addr",
        help="address of node 0 (needed with --nnodes > 1; under srun: the first node)",
    )
    p.add_argument(
        "--master-port",
        type=int,
        help="port on node 0 with --nnodes > 1 (default 29500; under srun: one from the "
        "job id); on one machine the OS picks a free port",
    )
    p.add_argument(
        "--local-addr",
        metavar="ADDRESS",
        help="with several nodes: the address the other nodes reach this one at (default: "
        "this machine's address on the route to --master-addr; its host name may not "
        "resolve on the others)",
    )
    p.add_argument(
        "--max-restarts",
        type=int,
        help="restart all workers up to K times after a failure (default 0)",
    )
    p.add_argument(
        "--rdzv-timeout",
        type=float,
        default=300.0,
        help="seconds to wait for the other nodes (default 300)",
    )
    add_process_flags(p)
    p.set_defaults(nproc=None)  # not given: the platform's (PET_NPROC_PER_NODE), else auto
    p.add_argument(
        "--cpu",
        action="store_true",
        help="rehearse a GPU script on CPU ranks over gloo, unedited: nccl, .cuda(), "
        ".to(local_rank), DDP(device_ids=...), autocast and the like run on the CPU; "
        "one process per CPU core unless --nproc says otherwise",
    )
    p.add_argument(
        "--rank-prefix",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="start each line a rank prints with [rank N] (default: when the job has more "
        "than one rank)",
    )
    p.add_argument(
        "--local-ranks-filter",
        metavar="R[,R...]",
        help="show only these local ranks' output on the console, e.g. 0 (the others' "
        "still goes to their logs)",
    )
    p.add_argument(
        "--log-dir",
        metavar="DIR",
        help="write each rank's output, stdout and stderr, to DIR/rank<N>.log",
    )
    p.add_argument(
        "--audit",
        nargs="?",
        const="report",
        metavar="strict",
        help="watch what the job does and report the DDP pitfalls it actually committed, "
        "at the end (ranks that trained different weights, a file saved by every rank, "
        "...); --audit=strict also exits 3 for a warning or an error of a job that "
        "otherwise succeeded",
    )
    p.add_argument(
        "--format",
        choices=("text", "json"),
        default="text",
        help="the audit's report: lines as `ddpkit check` prints them (default), or JSON",
    )
    _add_profile_flags(p)
    p.add_argument("-m", dest="module", metavar="MODULE", help="run a module, like python -m")
    p.add_argument("script", nargs="?", help="the training script")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    return p


def _add_profile_flags(p: argparse.ArgumentParser) -> None:
    """--profile and the flags that go with it."""
    p.add_argument(
        "--profile",
        action="store_true",
        help="measure where each rank's step time goes (waiting for data, compute, "
        "gradient communication, the optimizer) and say what holds the job back, every "
        "--profile-every seconds and at the end; with --log-dir, the breakdown goes to "
        "DIR/metrics.jsonl for `ddpkit plot DIR`",
    )
    p.add_argument(
        "--profile-every",
        type=float,
        metavar="SECONDS",
        help=f"seconds between two verdicts of --profile while the job runs (default "
        f"{VERDICT_EVERY_S:.0f}; implies --profile)",
    )
    p.add_argument(
        "--baseline",
        action="store_true",
        help=f"first run the script on one rank for {BASELINE_STEPS} optimizer steps, for "
        "--profile's scaling efficiency (samples/s of N ranks over N times one rank's; "
        "implies --profile)",
    )


def parse_options(argv: list[str]) -> argparse.Namespace:
    """`ddpkit run ARGV` read: run's options, and `script`, `module` and `args` (the
    script's), split where the script begins (see `split_command`)."""
    parser = _options_parser()
    options, command = split_command(argv, parser)
    args = parser.parse_args(options)  # no positional: the script is in `command`
    if command[:1] == ["-m"]:
        if len(command) < 2:
            parser.error("argument -m: expected one argument")
        args.module, args.script, args.args = command[1], None, command[2:]
    else:
        args.script, args.args = (command[0], command[1:]) if command else (None, [])
    _audit_mode(args)
    _profile_options(args)
    return args


def _profile_options(args: argparse.Namespace) -> None:
    """--baseline and --profile-every imply --profile; a verdict needs some time."""
    every = args.profile_every
    if every is not None and not (every > 0 and math.isfinite(every)):
        raise ConfigError(
            f"--profile-every {every:g}: the seconds between two verdicts must be a number "
            f"more than 0 (default {VERDICT_EVERY_S:.0f})"
        )
    args.profile = args.profile or args.baseline or args.profile_every is not None
    if args.profile_every is None:
        args.profile_every = VERDICT_EVERY_S


def split_command(argv: list[str], parser: argparse.ArgumentParser) -> tuple[list[str], list[str]]:
    """`argv` as run's options, then the command: `[SCRIPT, ARGS...]` or `["-m", MODULE,
    ARGS...]` (empty if none). The command begins at the first word that is neither an
    option of run nor the value of one, after `--`, or at `-m`: whatever follows it is
    the script's, its flags named like run's too (`train.py --nproc 3`). An option
    whose value is optional (`--audit`) takes it only as `--audit=strict`, so that
    `--audit train.py --lr 1` runs train.py."""
    i = 0
    while i < len(argv):
        word = argv[i]
        if word == "--":
            return argv[:i], argv[i + 1 :]
        if word == "-" or not word.startswith("-"):
            return argv[:i], argv[i:]
        if word.startswith("-m"):  # -m MODULE, or -mMODULE as python takes it
            return argv[:i], ["-m", *([word[2:]] if word[2:] else []), *argv[i + 1 :]]
        i += 1 + _values_taken(parser, word)
    return argv, []


def _values_taken(parser: argparse.ArgumentParser, word: str) -> int:
    """How many of the next words are `word`'s value: 1 for an option that needs one
    (unless given as --flag=value), 0 for a switch, an optional value or an unknown
    option (which the parse then names)."""
    if "=" in word:
        return 0
    actions = parser._option_string_actions
    action = actions.get(word)
    if action is None and word.startswith("--"):  # argparse takes a unique prefix
        matches = {actions[name] for name in actions if name.startswith(word)}
        action = matches.pop() if len(matches) == 1 else None
    if action is None:
        return 0
    # run's options take one value (nargs None) or none (0: a switch; "?": --audit).
    return 1 if action.nargs is None else 0


def run(args: argparse.Namespace) -> int:
    args = parse_options(args.argv)
    _fill_from_environment(args)
    settings = LaunchConfig(
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        master_addr=args.master_addr,
        master_port=args.master_port,
        local_addr=args.local_addr,
        max_restarts=args.max_restarts,
        hang_timeout=args.hang_timeout,
        rdzv_timeout=args.rdzv_timeout,
        rank_prefix=args.rank_prefix,
        local_ranks_filter=None
        if args.local_ranks_filter is None
        else parse_local_ranks(args.local_ranks_filter),
        log_dir=args.log_dir,
        cpu=args.cpu,
    )
    if args.baseline and args.nnodes > 1:
        raise ConfigError(
            f"--baseline runs the script on one rank of this machine first, which a job of "
            f"{args.nnodes} nodes cannot: leave --baseline out, or measure one rank with "
            "`ddpkit run --nproc 1 --profile` on one machine"
        )
    command, nproc = _validate(args)
    settings = dataclasses.replace(settings, nprocs=nproc)  # --local-ranks-filter checked
    if settings.log_dir is not None:
        check_folder("log_dir", settings.log_dir)  # made when the job starts
    from ddpkit.processes.agent import run_script  # torch: once the flags are good
    from ddpkit.processes.workers import exit_now

    found: list[Finding] = []
    profiles: dict[int, RankProfile] = {}
    baseline = _baseline(command, settings) if args.baseline else None
    code = run_script(
        command,
        settings,
        found.extend if args.audit is not None else None,
        profiles.update if args.profile else None,
        args.profile_every,
    )
    if args.profile:
        ranks = int(settings.nprocs) if settings.nnodes == 1 else None
        _report_profile(profiles, baseline, command, settings.log_dir, ranks)
    if args.audit is not None:
        _report_audit(found, args.format, settings.log_dir, code)
        if args.audit == "strict":
            code = _strict_exit(found, code)
    # No interpreter shutdown, as for the workers: torch's threads (the store client
    # of the hang watch on several nodes) can turn it into an abort after a clean run.
    exit_now(code)


# `ddpkit run --audit=strict`: the job ran, and the audit found pitfalls it committed.
AUDIT_STRICT_EXIT = 3


def _strict_exit(found: list[Finding], code: int) -> int:
    """The exit status under --audit=strict: 3 for a warning or an error of a job that
    ended on its own with 0. A job stopped or failed keeps its own status (75 for a
    requeue after preemption, 124 hung, 130 or 128 + N stopped by a signal, 1 crashed),
    which says more than the audit; an info finding fails nothing."""
    failing = [f for f in found if f.severity in (Severity.ERROR, Severity.WARNING)]
    return AUDIT_STRICT_EXIT if code == 0 and failing else code


def _audit_mode(args: argparse.Namespace) -> None:
    """Only `--audit=strict` names a mode; `--audit strict` would run a script named
    strict: say so when there is none."""
    if args.audit not in (None, "report", "strict"):
        raise ConfigError(
            f"--audit={args.audit}: unknown mode; use --audit (report) or --audit=strict"
        )
    if args.audit == "report" and args.script == "strict" and not Path("strict").exists():
        raise ConfigError(
            "--audit strict: what follows --audit is the script; write --audit=strict"
        )


def _report_audit(found: list[Finding], fmt: str, log_dir: str | None, code: int) -> None:
    """One block after the job: the findings as `ddpkit check` prints them, or JSON; with
    --log-dir, also DIR/audit.json for `ddpkit check --audit-log DIR`."""
    if log_dir is not None:
        write_audit_log(log_dir, found, code)
    if fmt == "json":
        print(format_json(found), end="", flush=True)
        return
    print(audit_report(found), end="", flush=True)


def _baseline(command: list[str], settings: LaunchConfig) -> float | None:
    """`--baseline`: samples/s of the script on one rank, stopped after BASELINE_STEPS
    optimizer steps; None (said) when it measured none."""
    from ddpkit.inrank.profile import STOP_AFTER_ENV
    from ddpkit.processes.agent import run_script
    from ddpkit.processes.machine import threads_per_rank
    from ddpkit.processes.profile import rate

    print(
        f"ddpkit: --baseline: the script on one rank for {BASELINE_STEPS} steps first",
        file=sys.stderr,
        flush=True,
    )
    measured: dict[int, RankProfile] = {}
    environ = dict(os.environ)  # the job after it starts from the user's environment
    os.environ[STOP_AFTER_ENV] = str(BASELINE_STEPS)
    # The rank gets the threads each rank of the job gets: N ranks are then at best N
    # times as fast.
    os.environ.setdefault("OMP_NUM_THREADS", str(threads_per_rank(int(settings.nprocs))))
    try:
        one = dataclasses.replace(settings, nprocs=1, max_restarts=0, log_dir=None)
        code = run_script(command, one, None, measured.update)
    finally:
        os.environ.clear()
        os.environ.update(environ)
    found = rate(measured) if code == 0 else None
    if found is None:
        print(
            f"ddpkit: --baseline: the one-rank run {'failed' if code else 'counted no samples'} "
            f"(exit status {code}): no scaling efficiency",
            file=sys.stderr,
            flush=True,
        )
    return found


def _report_profile(
    profiles: dict[int, RankProfile],
    baseline: float | None,
    command: list[str],
    log_dir: str | None,
    ranks: int | None,
) -> None:
    """The verdict after the job; with --log-dir, the breakdown over time in
    DIR/metrics.jsonl (records of kind "profile") for `ddpkit plot DIR`."""
    from ddpkit.processes.profile import report
    from ddpkit.records.runlog import RunLog

    if not profiles:
        print("ddpkit profile: no rank measured a step", file=sys.stderr, flush=True)
        return
    print(report(profiles, baseline, ranks), end="", file=sys.stderr, flush=True)
    if log_dir is None:
        return
    runlog = RunLog(log_dir, {"command": command, "profile": True}, enabled=True)
    try:
        for rank, profile in sorted(profiles.items()):
            for at, steps, window in profile.windows():
                runlog.write("profile", steps, {"rank": rank, **window.record()}, at=at)
    finally:
        runlog.close()


def _fill_from_environment(args: argparse.Namespace) -> None:
    """Flags not given take the platform's values (srun's, PET_*), else their defaults."""
    names = [f.name for f in dataclasses.fields(NodeSettings)]
    settings, note = resolve(
        NodeSettings(**{name: getattr(args, name) for name in names}), os.environ
    )
    for name in names:
        setattr(args, name, getattr(settings, name))
    if note is not None:
        print(note, file=sys.stderr, flush=True)


def _validate(args: argparse.Namespace) -> tuple[list[str], int]:
    """The worker command (after the shim) and the processes per node, or ConfigError.
    The flags are checked first: a bad one costs no import of torch."""
    command = _command(args)
    # The agent's module first: it quiets torch's C++ store warnings, which torch reads
    # only as it loads (and counting the GPUs loads it).
    import ddpkit.processes.agent  # noqa: F401
    from ddpkit.processes.machine import resolve_backend, resolve_nprocs

    backend = resolve_backend("gloo" if args.cpu else "auto")
    nproc = resolve_nprocs(args.nproc, backend)
    if backend == "gloo":
        check_processes("--nproc", nproc, allow=args.allow_oversubscribe)
    return command, nproc


def _command(args: argparse.Namespace) -> list[str]:
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
        return ["-m", args.module, *extra]
    if not args.script:
        raise ConfigError("nothing to run: pass a script (ddpkit run train.py) or -m MODULE")
    script = Path(args.script)
    if not script.exists():
        raise ConfigError(f"script {args.script!r} does not exist")
    if not script.is_file():
        kind = kind_of(script.stat().st_mode)
        raise ConfigError(
            f"script {args.script!r} is {kind}, not a Python file: "
            "pass the path of a training script, or -m MODULE"
        )
    if not os.access(script, os.R_OK):  # else every rank fails on it: exit 1, not 2
        raise ConfigError(
            f"script {args.script!r} cannot be read: Permission denied: "
            "check its permissions, or pass a script you can read"
        )
    return [args.script, *args.args]

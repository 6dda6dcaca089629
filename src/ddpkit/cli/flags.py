"""Flags shared by `ddpkit train` and `ddpkit verify`: which job, and its TrainConfig.

Every TrainConfig field is a flag (`--batch-size`, `--precision`, ...); a TOML file
given with `--config` sets any of them, and flags given on the command line win.
`--nproc`, `--hang-timeout` and `--allow-oversubscribe` (also `ddpkit run`'s) say how
many processes start and how they are watched (`ddpkit.processes.config.LaunchConfig`
checks the values); `check_folder` checks a folder flag (`--run-dir`, `--log-dir`).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ddpkit.errors import ConfigError
from ddpkit.processes.report import DEFAULT_HANG_TIMEOUT
from ddpkit.training.config import TrainConfig, field_type, parse_option

if TYPE_CHECKING:
    from _typeshed import SupportsWrite

# More CPU processes than cores runs slower (a warning); more than this many times the
# cores is refused without --allow-oversubscribe: a typo (--nproc 100000) that would
# fork until the machine stalls.
OVERSUBSCRIBE_LIMIT = 4


class Parser(argparse.ArgumentParser):
    """argparse's parser, but a failed write of --help, --version or usage to stdout
    raises: argparse drops it, and the command would exit 0 having written nothing.
    (The subcommands' parsers are of this class too: add_subparsers uses the parent's.)"""

    def _print_message(self, message: str, file: SupportsWrite[str] | None = None) -> None:
        if message and file is sys.stdout:
            file.write(message)  # an OSError reaches main(): one line, exit status 2
        else:  # stderr: where the error would be said, so there is no one to tell
            super()._print_message(message, file)


def add_job_flags(p: argparse.ArgumentParser) -> None:
    """--example / --job and --config: which job, with which TrainConfig file; and -h,
    whose help shows the defaults of that job (see `print_job_help`). Make `p` with
    `add_help=False`."""
    p.add_argument(
        "-h",
        "--help",
        dest="job_help",
        action="store_true",
        help="show this help, with the defaults of the job that --job or --example names",
    )
    p.set_defaults(parser=p)
    job = p.add_mutually_exclusive_group()
    job.add_argument(
        "--example", help="built-in job: digits (the default), gpt (trained by steps) or linear"
    )
    job.add_argument(
        "--job",
        metavar="MODULE:FUNCTION",
        help=(
            "your job: FUNCTION(ctx) or FUNCTION(ctx, config) returns a ddpkit.Job "
            "(also path/to/file.py:FUNCTION)"
        ),
    )
    p.add_argument("--config", metavar="FILE.toml", help="TrainConfig options from a TOML file")


def add_config_flags(p: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    """One flag per TrainConfig field but `skip`, with the field's help; None if not given.

    The flags take text as it is (no argparse `type=` or `choices=`): `job_and_config`
    converts and checks it with `ddpkit.training.config`, so a bad value reads as it would in
    Python or in a TOML file.
    """
    options = p.add_argument_group("training options (TrainConfig; flags win over --config)")
    for f in dataclasses.fields(TrainConfig):
        if f.name in skip:
            continue
        kind, _ = field_type(f.name)
        flag = "--" + f.name.replace("_", "-")
        unset = f.default is None or f.default == ()  # "(default: ())" says nothing
        help_ = f.metadata["help"] + ("" if unset else f" (default: {f.default})")
        if kind is bool:
            options.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=None, help=help_
            )
        elif typing.get_origin(kind) is Sequence:  # a list, given as "csv,wandb"
            options.add_argument(flag, default=None, metavar="NAME[,NAME...]", help=help_)
        else:
            choices = typing.get_args(kind)  # a Literal's; () for int, float, str
            metavar = "{" + ",".join(choices) + "}" if choices else None
            options.add_argument(flag, default=None, metavar=metavar, help=help_)


def print_job_help(args: argparse.Namespace) -> int:
    """Print the parser's help with each option's default as the named job sets it.

    argparse prints help while it parses, before it knows which job `--job` names, so
    `-h` only sets a flag and the help is printed here, once the job's DEFAULTS (which
    override TrainConfig's) are known."""
    job, defaults = _job_defaults(args)
    parser: argparse.ArgumentParser = args.parser
    for action in parser._actions:  # argparse has no public way to change a help text
        if action.dest in defaults and action.help:
            ours = f" (default: {TrainConfig.__dataclass_fields__[action.dest].default})"
            theirs = f" (default: {defaults[action.dest]}, from {job})"
            # An option without a default of its own (epochs: None) shows none to replace.
            action.help = (
                action.help.replace(ours, theirs) if ours in action.help else action.help + theirs
            )
    parser.print_help()
    return 0


def _flag_values(args: argparse.Namespace) -> dict[str, Any]:
    """The TrainConfig flags given on the command line, converted and checked."""
    values: dict[str, Any] = {}
    for f in dataclasses.fields(TrainConfig):
        given = getattr(args, f.name, None)
        if given is None:
            continue
        if isinstance(given, str) and typing.get_origin(field_type(f.name)[0]) is Sequence:
            _check_names_given(f.name, given)
        # text, or a bool from --x/--no-x
        values[f.name] = parse_option(f.name, given) if isinstance(given, str) else given
    return values


def _check_names_given(name: str, text: str) -> None:
    """ConfigError when list flag `name` (--loggers) names nothing: `--loggers ''` typed
    on a command line is a mistake (say an unset shell variable), not a wish for none;
    leaving the flag out is how to log nowhere else."""
    if not any(part.strip() for part in text.split(",")):
        flag = "--" + name.replace("_", "-")
        raise ConfigError(
            f"{flag} {text!r} names no {name.rstrip('s')}: pass {flag} "
            f"{TrainConfig.__dataclass_fields__[name].metadata['example']}, or leave it out"
        )


def job_and_config(args: argparse.Namespace) -> tuple[str, TrainConfig]:
    """The job the flags name (an example's name or a MODULE:FUNCTION spec) and its
    TrainConfig: the job's DEFAULTS, then --config's file, then the flags."""
    from ddpkit.cli.config_file import load_config_file, merge_config

    # First the flags and the file: a bad one costs no import of the job.
    flags = _flag_values(args)
    from_file = {} if args.config is None else load_config_file(args.config)
    job_name, defaults = _job_defaults(args)  # a bad job fails here, not in every worker
    return job_name, TrainConfig(**merge_config(defaults, from_file, flags))


def _job_defaults(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    """The job that --job or --example names (digits if neither), and its DEFAULTS.
    An empty one ("") names no job: refused, not taken as the default."""
    from ddpkit.training.jobspec import example_module, load_job

    if args.job is not None:
        return args.job, load_job(args.job)[1]
    job = "digits" if args.example is None else args.example
    return job, dict(example_module(job).DEFAULTS)


def add_process_flags(p: argparse.ArgumentParser) -> None:
    """The flags of `ddpkit train` and `ddpkit run` for the processes of a job."""
    p.add_argument(
        "--nproc",
        default="auto",
        help="processes on this machine: auto = one per GPU, else one per CPU core",
    )
    p.add_argument(
        "--hang-timeout",
        type=float,
        default=DEFAULT_HANG_TIMEOUT,
        help="stop the job and show every rank's stack when no rank has made progress for "
        f"this many seconds (default {DEFAULT_HANG_TIMEOUT:.0f}; 0: off)",
    )
    add_oversubscribe_flag(p)


def add_oversubscribe_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--allow-oversubscribe",
        action="store_true",
        help=f"start more than {OVERSUBSCRIBE_LIMIT}x as many CPU ranks (or data workers per "
        "rank) as there are CPU cores, and do not warn above the cores",
    )


def check_processes(flag: str, count: int, *, allow: bool) -> None:
    """Warn when `flag`'s `count` processes exceed the CPU cores; refuse (ConfigError)
    more than OVERSUBSCRIBE_LIMIT times the cores, unless `allow`."""
    from ddpkit.processes.machine import (
        cpu_count,  # torch: the commands that call this load it anyway
    )

    cores = cpu_count()
    if allow or count <= cores:
        return
    if count > OVERSUBSCRIBE_LIMIT * cores:
        raise ConfigError(
            f"{flag} {count} is more than {OVERSUBSCRIBE_LIMIT} x the {cores} CPU core(s): "
            f"pass {flag} {cores} or fewer, or --allow-oversubscribe to start them anyway"
        )
    print(
        f"ddpkit: warning: {flag} {count} is more than the {cores} CPU core(s): "
        "the processes share them and run slower",
        file=sys.stderr,
        flush=True,
    )


def check_folder(name: str, path: str) -> None:
    """ConfigError unless option `name`'s `path` is a folder, or can be made one, where
    this user may write. Creates nothing."""
    folder = Path(path)
    existing = folder  # the folder, or the nearest parent that exists
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    flag = "--" + name.replace("_", "-")
    if not existing.is_dir():
        where = "is" if existing == folder else f"cannot be made: {str(existing)!r} is"
        raise ConfigError(
            f"{name} {path!r} {where} a file, not a folder: pass {flag} with a new or "
            "existing folder"
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(
            f"{name} {path!r} cannot be written: no write permission in {str(existing)!r}: "
            f"pass {flag} with a folder you can write to"
        )

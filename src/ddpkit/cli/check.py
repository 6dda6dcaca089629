"""`ddpkit check PATH...`: the command-line front end of the checker (`ddpkit.check`).

Exit status: 0 clean, 1 findings, 2 usage errors (an empty PATH or `--select ''` too),
missing paths, or files or folders that could not be read or parsed (the other files
are still checked).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from ddpkit.check.explain import explain
from ddpkit.check.rules import RULES
from ddpkit.check.runner import SelectionError, check_paths, python_files
from ddpkit.findings import confirm, format_json, format_text, read_audit_log, summary

HELP = "find DDP pitfalls in training scripts without running them (no torch needed)"
USAGE_ERROR = 2


def _codes(values: list[str] | None) -> list[str] | None:
    """`--select DDP101,DDP103 --select DDP106` -> ["DDP101", "DDP103", "DDP106"]."""
    if values is None:
        return None
    return [code for value in values for code in value.split(",") if code.strip()]


def _chosen(code: str, select: list[str] | None, ignore: list[str] | None) -> bool:
    """`--select` and `--ignore` as they choose rules, for a code of the audit (which has
    codes of its own, such as DDP112)."""
    wanted, unwanted = _codes(select), _codes(ignore) or []
    return (wanted is None or any(code.startswith(c.strip().upper()) for c in wanted)) and not any(
        code.startswith(c.strip().upper()) for c in unwanted
    )


def _empty_value(args: argparse.Namespace) -> str | None:
    """What is wrong when an argument is empty text (an unset shell variable, say),
    which would otherwise mean something else: "" a path is the current folder, and
    `--select ''` selects no rule, so nothing is ever found."""
    if any(not path for path in args.paths):
        return (
            "an empty PATH ('') names no file or folder: pass the files or folders to "
            "check, e.g. `ddpkit check .` for the current folder"
        )
    for flag, values in (("--select", args.select), ("--ignore", args.ignore)):
        if values is not None and _codes(values) == []:
            return (
                f"{flag} {','.join(values)!r} names no rule code: pass {flag} with codes "
                f"such as DDP103 or prefixes such as DDP1, or leave it out"
            )
    return None


def add_parser(sub: Any) -> None:
    codes = "\n".join(f"  {r.code} {r.severity.value:<7}  {r.summary}" for r in RULES)
    p: argparse.ArgumentParser = sub.add_parser(
        "check",
        help=HELP,
        description=f"{HELP[0].upper()}{HELP[1:]}.\n\nrules:\n{codes}",
        epilog="Silence one line with `# noqa: DDP103`; `--explain CODE` says why a rule "
        "exists.\nExit status: 0 clean, 1 findings, 2 usage error or unreadable file or folder.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("paths", nargs="*", metavar="PATH", help="files and folders (*.py, recursively)")
    p.add_argument(
        "--format", choices=("text", "json"), default="text", help="output format (default text)"
    )
    p.add_argument(
        "--select",
        action="append",
        metavar="CODES",
        help="only these codes or prefixes, comma-separated (e.g. DDP103,DDP106 or DDP1)",
    )
    p.add_argument(
        "--ignore", action="append", metavar="CODES", help="skip these codes or prefixes"
    )
    p.add_argument("--explain", metavar="CODE", help="print why a rule exists, with examples")
    p.add_argument(
        "--audit-log",
        metavar="DIR",
        help="the --log-dir of a `ddpkit run --audit` of these scripts: mark the findings "
        "that run committed as confirmed, list those it alone saw, and keep DDP106 a warning "
        "if it ended well",
    )
    p.set_defaults(func=run)


def _usage_error(message: str) -> int:
    print(f"ddpkit check: error: {message}", file=sys.stderr)
    return USAGE_ERROR


def run(args: argparse.Namespace) -> int:
    if args.explain is not None:
        try:
            sys.stdout.write(explain(args.explain))
        except KeyError:
            known = ", ".join(r.code for r in RULES)
            return _usage_error(f"unknown rule code {args.explain!r} (known: {known})")
        return 0
    if not args.paths:
        return _usage_error("give at least one file or folder to check, e.g. `ddpkit check .`")
    empty = _empty_value(args)
    if empty is not None:
        return _usage_error(empty)
    try:
        report = check_paths(args.paths, select=_codes(args.select), ignore=_codes(args.ignore))
    except SelectionError as exc:
        return _usage_error(str(exc))
    findings = report.findings
    if args.audit_log is not None:
        try:
            audited, status = read_audit_log(args.audit_log)
        except ValueError as exc:
            return _usage_error(str(exc))
        checked = {os.path.realpath(f) for f in python_files(args.paths)[0]}
        audited = [
            f
            for f in audited
            if os.path.realpath(f.path) in checked and _chosen(f.code, args.select, args.ignore)
        ]
        findings = confirm(findings, audited, status)
    for path in report.missing:
        print(f"ddpkit check: error: no such file or folder: {path}", file=sys.stderr)
    # "no findings in 0 files" beside the error of a missing path says nothing more.
    quiet = report.missing and not report.files_checked and not findings
    line = None if quiet else summary(findings, report.files_checked)
    if args.format == "json":
        sys.stdout.write(format_json(findings))
        if line is not None:
            print(line, file=sys.stderr)  # stdout stays one JSON document
    else:
        sys.stdout.write(format_text(findings))
        if line is not None:
            print(line)
    # Findings of the audited run alone are findings too.
    return 1 if report.exit_code == 0 and findings else report.exit_code

"""Running the rules over sources, files and folders: selection, `# noqa`, unreadable files."""

from __future__ import annotations

import ast
import gc
import os
import re
import stat
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import compress
from pathlib import Path

from ddpkit.check.analysis import FileAnalysis
from ddpkit.check.model import UNREADABLE
from ddpkit.check.program import analyse_program
from ddpkit.check.rules import RULES, Rule
from ddpkit.findings import Finding, Severity
from ddpkit.userfiles import NotRegularFile, read_regular

# A bare noqa comment silences every code on its line; `noqa: DDP103, DDP106` only those.
_NOQA = re.compile(r"#\s*noqa(?::\s*(?P<codes>[A-Z]+[0-9]+(?:[\s,]+[A-Z]+[0-9]+)*))?", re.I)
# Folders that hold no user code worth checking (virtual envs, caches, VCS data).
_SKIP_DIRS = frozenset({"__pycache__", "node_modules", "site-packages", "venv", "build", "dist"})
# Larger files are not read: no training script is this big, and /dev/zero never ends.
MAX_FILE_BYTES = 5 * 2**20


def _is_source_folder(folder: str) -> bool:
    """`dist/` and `build/` are build outputs (wheels; `build/lib/...`), unless they hold
    Python files themselves: mmengine keeps its distributed code in `mmengine/dist/`."""
    if os.path.basename(folder) not in ("dist", "build"):
        return False
    try:
        return any(name.endswith(".py") for name in os.listdir(folder))
    except OSError:
        return False


class SelectionError(ValueError):
    """A --select/--ignore entry that matches no rule code."""


def select_rules(
    select: Iterable[str] | None = None, ignore: Iterable[str] | None = None
) -> tuple[Rule, ...]:
    """The rules to run: codes or code prefixes (`DDP1`) in `select`, minus `ignore`."""
    chosen = list(RULES)
    codes = [r.code for r in RULES]

    def matcher(entries: Iterable[str]) -> list[str]:
        prefixes = [e.strip().upper() for e in entries if e.strip()]
        for prefix in prefixes:
            if not any(code.startswith(prefix) for code in codes):
                raise SelectionError(
                    f"unknown rule code {prefix!r}: use codes such as DDP103 or a prefix "
                    f"such as DDP1 (known: {', '.join(codes)})"
                )
        return prefixes

    if select is not None:
        wanted = matcher(select)
        chosen = [r for r in chosen if any(r.code.startswith(p) for p in wanted)]
    if ignore is not None:
        unwanted = matcher(ignore)
        chosen = [r for r in chosen if not any(r.code.startswith(p) for p in unwanted)]
    return tuple(chosen)


def _noqa_codes(line: str) -> set[str] | None:
    """Codes silenced on `line`: None when none, an empty set for a bare `# noqa`."""
    if "noqa" not in line.lower():
        return None
    match = _NOQA.search(line)
    if match is None:
        return None
    codes = match.group("codes")
    return set() if codes is None else {c.upper() for c in re.split(r"[\s,]+", codes) if c}


def _unreadable(path: str, line: int, col: int, message: str) -> Finding:
    return Finding(path, max(line, 1), max(col, 1), UNREADABLE, Severity.ERROR, message)


def check_tree(
    tree: ast.Module, source: str | bytes, path: str, rules: Sequence[Rule] | None = None
) -> list[Finding]:
    """Run `rules` (default: all) on a parsed module; `source` is used for `# noqa`."""
    return _run_rules(FileAnalysis(tree), source, path, rules)


def _run_rules(
    analysis: FileAnalysis, source: str | bytes, path: str, rules: Sequence[Rule] | None
) -> list[Finding]:
    findings: list[Finding] = []
    lines: list[str] | None = None
    for rule in RULES if rules is None else rules:
        for hit in rule.check(analysis):
            node, message = hit[0], hit[1]
            severity = hit[2] if len(hit) == 3 else rule.severity
            line = getattr(node, "lineno", 1)
            col = getattr(node, "col_offset", 0) + 1
            if lines is None:
                text = source.decode("utf-8", "replace") if isinstance(source, bytes) else source
                lines = text.splitlines()
            silenced = _noqa_codes(lines[line - 1]) if 0 < line <= len(lines) else None
            if silenced is not None and (not silenced or rule.code in silenced):
                continue
            findings.append(Finding(path, line, col, rule.code, severity, message))
    return sorted(set(findings))


@contextmanager
def _gc_paused() -> Iterator[None]:
    """Parsing allocates thousands of nodes that die together by reference counting;
    the cyclic collector would scan them over and over (a fifth of the run time)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _parse(source: str | bytes, path: str) -> ast.Module | Finding:
    """The syntax tree, or the DDP000 finding that says why there is none."""
    try:
        return ast.parse(source, filename=path)
    except (SyntaxError, ValueError) as exc:  # ValueError: a NUL byte in the source
        line = getattr(exc, "lineno", None) or 1
        col = getattr(exc, "offset", None) or 1
        reason = getattr(exc, "msg", None) or str(exc)
        return _unreadable(path, line, col, f"syntax error, file not checked: {reason}")
    except (RecursionError, MemoryError) as exc:  # e.g. 100,000 chained `+`
        return _too_deep(path, exc)


def _too_deep(path: str, exc: BaseException) -> Finding:
    what = "out of memory" if isinstance(exc, MemoryError) else "nested too deeply"
    return _unreadable(path, 1, 1, f"{what} to check, file not checked ({type(exc).__name__})")


def _check(source: str | bytes, path: str, rules: Sequence[Rule]) -> list[Finding]:
    with _gc_paused():
        tree = _parse(source, path)
        if isinstance(tree, Finding):
            return [tree]
        try:
            return check_tree(tree, source, path, rules)
        except (RecursionError, MemoryError) as exc:
            return [_too_deep(path, exc)]


def _read_bytes(path: str) -> bytes | Finding:
    """The file's bytes; a regular file of at most MAX_FILE_BYTES only (a FIFO is never
    waited on, a device never read: see `ddpkit.userfiles.read_regular`)."""
    try:
        data, size = read_regular(path, MAX_FILE_BYTES)
    except NotRegularFile as exc:
        return _unreadable(path, 1, 1, f"not a regular file ({exc.kind}), file not checked")
    except OSError as exc:
        return _unreadable(path, 1, 1, f"cannot read file: {exc.strerror or exc}")
    if size > MAX_FILE_BYTES:
        mb = f"{size / 2**20:.1f} MB, over the limit of {MAX_FILE_BYTES // 2**20} MB"
        return _unreadable(path, 1, 1, f"too large, file not checked ({mb})")
    return data


def _check_program(
    files: Sequence[Path], roots: Sequence[Path], rules: Sequence[Rule]
) -> list[Finding]:
    """Check `files` together: imports between them link them into one program."""
    findings: list[Finding] = []
    parsed: list[tuple[Path, ast.Module]] = []
    sources: list[bytes] = []
    with _gc_paused():
        for path in files:
            data = _read_bytes(str(path))
            tree = _parse(data, str(path)) if isinstance(data, bytes) else data
            if isinstance(tree, Finding):
                findings.append(tree)
                continue
            assert isinstance(data, bytes)
            parsed.append((path, tree))
            sources.append(data)
        try:
            analyses = analyse_program(parsed, roots)
        except (RecursionError, MemoryError) as exc:  # a file nested too deeply: the rest
            ok = [_analysable(item, roots) for item in parsed]
            findings += [_too_deep(str(p), exc) for p, _ in compress(parsed, [not k for k in ok])]
            parsed, sources = list(compress(parsed, ok)), list(compress(sources, ok))
            analyses = analyse_program(parsed, roots)
        for (path, _), source, analysis in zip(parsed, sources, analyses, strict=True):
            try:
                findings.extend(_run_rules(analysis, source, str(path), rules))
            except (RecursionError, MemoryError) as exc:
                findings.append(_too_deep(str(path), exc))
        # Free the trees by reference counting before the collector is back on:
        # otherwise its first run walks every node of every file.
        for analysis in analyses:
            analysis.release()
        del analyses, parsed
    return findings


def _analysable(item: tuple[Path, ast.Module], roots: Sequence[Path]) -> bool:
    """Whether the file can be analysed alone (without RecursionError)."""
    try:
        analyse_program([item], roots)
    except (RecursionError, MemoryError):
        return False
    return True


def check_source(
    source: str | bytes,
    path: str = "<string>",
    *,
    select: Iterable[str] | None = None,
    ignore: Iterable[str] | None = None,
) -> list[Finding]:
    """Check Python source text. A syntax error comes back as one DDP000 finding."""
    return _check(source, path, select_rules(select, ignore))


def check_file(
    path: str | os.PathLike[str],
    *,
    select: Iterable[str] | None = None,
    ignore: Iterable[str] | None = None,
) -> list[Finding]:
    """Check one file; a file that cannot be read or parsed gives one DDP000 finding."""
    rules = select_rules(select, ignore)
    data = _read_bytes(os.fspath(path))
    return [data] if isinstance(data, Finding) else _check(data, os.fspath(path), rules)


def python_files(paths: Iterable[str | os.PathLike[str]]) -> tuple[list[Path], list[Path]]:
    """The files to check under `paths` (folders searched for `*.py`), and missing paths.

    A file named explicitly is checked whatever its suffix; in folders, hidden
    folders, virtual environments and caches are skipped.
    """
    found, missing, _ = _collect(paths)
    return found, missing


def _collect(
    paths: Iterable[str | os.PathLike[str]],
) -> tuple[list[Path], list[Path], list[Finding]]:
    """`python_files`' files and missing paths, and a DDP000 finding for each folder
    that could not be read (os.walk would skip it in silence: "no findings")."""
    found: list[Path] = []
    missing: list[Path] = []
    unreadable: list[Finding] = []

    def folder_failed(exc: OSError) -> None:
        where = os.fsdecode(exc.filename) if exc.filename is not None else "?"
        reason = f"cannot read folder: {exc.strerror or exc}, the files in it were not checked"
        unreadable.append(_unreadable(where, 1, 1, reason))

    for raw in paths:
        path = Path(raw)
        try:
            info = path.stat()
        except (FileNotFoundError, NotADirectoryError):
            missing.append(path)
            continue
        except OSError:  # say a folder above it that may not be entered: read, and said
            found.append(path)
            continue
        if stat.S_ISDIR(info.st_mode):
            for root, dirs, files in os.walk(path, onerror=folder_failed):
                dirs[:] = sorted(
                    d
                    for d in dirs
                    if not d.startswith(".")
                    and (d not in _SKIP_DIRS or _is_source_folder(os.path.join(root, d)))
                    and not os.path.exists(os.path.join(root, d, "pyvenv.cfg"))
                )
                found.extend(Path(root, f) for f in sorted(files) if f.endswith(".py"))
        else:
            found.append(path)
    # The same file reached twice (a folder and a file in it) is checked once.
    unique = list(dict.fromkeys(found))
    return unique, missing, unreadable


def _is_dir(path: Path) -> bool:
    try:
        return stat.S_ISDIR(path.stat().st_mode)
    except OSError:  # not there, or not to be looked at: its file's DDP000 says why
        return False


@dataclass
class Report:
    """The result of `check_paths`."""

    findings: list[Finding] = field(default_factory=list)
    files_checked: int = 0
    missing: list[Path] = field(default_factory=list)

    @property
    def unreadable(self) -> list[Finding]:
        return [f for f in self.findings if f.code == UNREADABLE]

    @property
    def exit_code(self) -> int:
        """0 clean, 1 findings, 2 when a path is missing or a file or folder could not be
        checked."""
        if self.missing or self.unreadable:
            return 2
        return 1 if self.findings else 0


def check_paths(
    paths: Iterable[str | os.PathLike[str]],
    *,
    select: Iterable[str] | None = None,
    ignore: Iterable[str] | None = None,
) -> Report:
    """Check training scripts for DDP pitfalls, without running or importing them.

    The files are checked together as one program: a call in one file of a function
    that another checked file defines (`import utils`, `from .misc import f`) counts
    when deciding where code runs and whether the process group is destroyed.

    Args:
        paths: files and folders; folders are searched recursively for `*.py`.
        select: only these rule codes or prefixes (e.g. `["DDP103", "DDP11"]`).
        ignore: skip these rule codes or prefixes.

    Returns:
        A `Report`: the findings (sorted by file and line; a DDP000 one for each file
        or folder that could not be read), the number of files checked, the paths that
        do not exist, and `exit_code` (0 clean, 1 findings, 2 unreadable files or
        folders, or missing paths).

    Raises:
        SelectionError: a code in `select` or `ignore` names no rule.
    """
    rules = select_rules(select, ignore)
    given = [Path(p) for p in paths]
    files, missing, unreadable = _collect(given)
    report = Report(findings=unreadable, files_checked=len(files), missing=missing)
    roots = [p if _is_dir(p) else p.parent for p in given]
    report.findings.extend(_check_program(files, roots, rules))
    report.findings.sort()
    return report

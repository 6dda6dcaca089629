"""Score `ddpkit check` on real-world DDP training files from public repositories.

The corpus (`bench/corpus/corpus.json`) lists files as `repo@commit:path` with the
findings a careful reader expects (`expected`) and, for documentation, patterns that
look wrong but are safe in context (`safe`). No source code is stored in this
repository: `--fetch DIR` downloads the files from raw.githubusercontent.com into
`DIR/{repo}/{path}` (never done in CI), and the scorer checks each repository's
files together as one folder.

    .venv/bin/python bench/check_corpus.py --fetch bench/corpus/files   # once, with network
    .venv/bin/python bench/check_corpus.py --from-git /work/.mirror     # or from git copies
    .venv/bin/python bench/check_corpus.py                              # score

A finding matches an expected entry when code and file agree, and the line too when
the entry gives one (within `--line-slack`). Prints a table per repository, overall
precision and recall, false positives at error severity and files/s, and per rule for
the newest set; the JSON result goes to `--out` (default bench/results/check_corpus.json).
Without the files it prints one line saying so and exits 0. An expected entry whose
code the checker does not have yet (a placeholder such as `EARLY-EXIT`, judged before
its rule exists) is not scored: it is counted as `unscored` until the rule lands.

Entries marked `"heldout": true` come from repositories the rules were not tuned on;
`"set"` names the day a held-out set was judged by hand, before that round's rule
changes. The newest set is scored on its own line first, then the earlier held-out
sets, then the tuned repositories; `--heldout-only` scores the held-out ones alone.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddpkit.check import check_paths
from ddpkit.check.rules import RULES_BY_CODE

HERE = Path(__file__).resolve().parent
CORPUS = HERE / "corpus" / "corpus.json"
DEFAULT_FILES = HERE / "corpus" / "files"
DEFAULT_OUT = HERE / "results" / "check_corpus.json"
RAW_URL = "https://raw.githubusercontent.com/{repo}/{commit}/{path}"
_COMMIT = re.compile(r"^[0-9a-f]{40}$")


@dataclass(frozen=True)
class Expected:
    code: str
    line: int | None
    why: str


@dataclass(frozen=True)
class Entry:
    repo: str
    commit: str
    path: str
    group: str
    expected: tuple[Expected, ...]
    safe: tuple[Expected, ...]
    heldout: bool = False
    # When a held-out set was judged (its repositories were judged by hand before the
    # rule changes of that round).
    judged: str | None = None


def load_corpus(path: Path = CORPUS) -> list[Entry]:
    """The corpus entries; raises ValueError on a malformed entry."""
    doc = json.loads(path.read_text(encoding="utf-8"))
    entries: list[Entry] = []
    for raw in doc["files"]:
        if not _COMMIT.match(raw["commit"]):
            raise ValueError(f"{raw['repo']}:{raw['path']}: commit is not 40 hex digits")

        def items(key: str, raw: dict[str, Any] = raw) -> tuple[Expected, ...]:
            return tuple(
                Expected(str(e["code"]), e.get("line"), str(e.get("why", "")))
                for e in raw.get(key, [])
            )

        entries.append(
            Entry(
                raw["repo"],
                raw["commit"],
                raw["path"],
                raw.get("group", raw["repo"]),
                items("expected"),
                items("safe"),
                bool(raw.get("heldout", False)),
                raw.get("set"),
            )
        )
    mixed = {e.group for e in entries if e.heldout} & {e.group for e in entries if not e.heldout}
    if mixed:
        raise ValueError(f"groups mix held-out and tuned entries: {sorted(mixed)}")
    return entries


def fetch(entries: list[Entry], dest: Path, timeout: float = 30.0) -> int:
    """Download the listed files into `dest/{repo}/{path}`; returns how many failed."""
    failed = 0
    for e in entries:
        target = dest / e.repo / e.path
        if target.exists():
            continue
        url = RAW_URL.format(repo=e.repo, commit=e.commit, path=e.path)
        try:
            with urllib.request.urlopen(url, timeout=timeout) as response:
                data = response.read()
        except OSError as exc:
            print(f"failed: {url}: {exc}", file=sys.stderr)
            failed += 1
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    return failed


def extract(entries: list[Entry], mirrors: Path, dest: Path) -> int:
    """Write the listed files into `dest/{repo}/{path}` from local git copies of the
    repositories (`mirrors/{owner}+{name}`, a bare repository or one with a `repo/`
    git folder inside, as the workplace's `fetch` leaves them); returns how many failed."""
    failed = 0
    for e in entries:
        target = dest / e.repo / e.path
        if target.exists():
            continue
        base = mirrors / e.repo.replace("/", "+")
        git_dir = base / "repo" if (base / "repo" / "HEAD").exists() else base
        shown = subprocess.run(
            ["git", f"--git-dir={git_dir}", "show", f"{e.commit}:{e.path}"],
            capture_output=True,
            check=False,
        )
        if shown.returncode != 0:
            print(f"failed: {e.repo}@{e.commit}:{e.path}: {shown.stderr.decode().strip()}")
            failed += 1
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(shown.stdout)
    return failed


@dataclass
class GroupScore:
    group: str
    heldout: bool = False
    judged: str | None = None
    files: int = 0
    tp: int = 0
    fn: int = 0
    fp: int = 0
    fp_errors: int = 0
    seconds: float = 0.0
    false_positives: list[dict[str, Any]] = field(default_factory=list)
    misses: list[dict[str, Any]] = field(default_factory=list)
    unscored: int = 0
    # code -> [tp, fp, fn, false positives at error severity]
    by_rule: dict[str, list[int]] = field(default_factory=dict)

    def count(self, code: str, kind: int) -> None:
        self.by_rule.setdefault(code, [0, 0, 0, 0])[kind] += 1


def _matches(exp: Expected, code: str, line: int, slack: int) -> bool:
    return exp.code == code and (exp.line is None or abs(exp.line - line) <= slack)


def score_group(group: str, entries: list[Entry], root: Path, slack: int) -> GroupScore:
    """Check the group's folder as one program and compare with the expected findings."""
    folder = root / group
    listed = {e.path: e for e in entries}
    start = time.perf_counter()
    report = check_paths([folder])
    result = GroupScore(
        group,
        heldout=any(e.heldout for e in entries),
        judged=max((e.judged for e in entries if e.judged), default=None),
        files=report.files_checked,
        seconds=time.perf_counter() - start,
    )
    matched: set[tuple[str, int]] = set()
    for f in report.findings:
        rel = Path(f.path).resolve().relative_to(folder.resolve()).as_posix()
        entry = listed.get(rel)
        hit = None
        if entry is not None:
            for i, exp in enumerate(entry.expected):
                if _matches(exp, f.code, f.line, slack):
                    hit = i
                    break
        if hit is not None:
            matched.add((rel, hit))
            continue
        result.fp += 1
        result.fp_errors += f.severity.value == "error"
        result.count(f.code, 1)
        if f.severity.value == "error":
            result.count(f.code, 3)
        known = None
        if entry is not None:
            known = next((s.why for s in entry.safe if _matches(s, f.code, f.line, slack)), None)
        result.false_positives.append(
            {
                "path": rel,
                "line": f.line,
                "code": f.code,
                "severity": f.severity.value,
                "message": f.message,
                "safe_because": known,
            }
        )
    for e in entries:
        for i, exp in enumerate(e.expected):
            if exp.code not in RULES_BY_CODE:
                result.unscored += 1
            elif (e.path, i) in matched:
                result.tp += 1
                result.count(exp.code, 0)
            else:
                result.fn += 1
                result.count(exp.code, 2)
                result.misses.append(
                    {"path": e.path, "line": exp.line, "code": exp.code, "why": exp.why}
                )
    return result


def _ratio(num: int, den: int) -> float | None:
    return num / den if den else None


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def summary(scores: list[GroupScore]) -> dict[str, Any]:
    """Totals over some groups: counts, precision, recall, error-severity FPs."""
    tp, fp, fn = (sum(getattr(s, k) for s in scores) for k in ("tp", "fp", "fn"))
    return {
        "repositories": len(scores),
        "files": sum(s.files for s in scores),
        "tp": tp,
        "fp": fp,
        "fn": fn,
        "precision": _ratio(tp, tp + fp),
        "recall": _ratio(tp, tp + fn),
        "false_positives_error": sum(s.fp_errors for s in scores),
    }


def by_rule(scores: list[GroupScore]) -> dict[str, dict[str, Any]]:
    """Per rule over some groups: tp, fp, fn, precision, recall, error-severity FPs."""
    totals: dict[str, list[int]] = {}
    for s in scores:
        for code, counts in s.by_rule.items():
            totals[code] = [
                a + b for a, b in zip(totals.get(code, [0, 0, 0, 0]), counts, strict=True)
            ]
    return {
        code: {
            "tp": tp,
            "fp": fp,
            "fn": fn,
            "precision": _ratio(tp, tp + fp),
            "recall": _ratio(tp, tp + fn),
            "false_positives_error": fp_err,
        }
        for code, (tp, fp, fn, fp_err) in sorted(totals.items())
    }


def _summary_line(label: str, s: dict[str, Any]) -> str:
    return (
        f"{label}: {s['repositories']} repositories, {s['files']} files, "
        f"precision {_fmt(s['precision'])}, recall {_fmt(s['recall'])} "
        f"(tp {s['tp']}, fp {s['fp']}, fn {s['fn']}), "
        f"false positives at error severity {s['false_positives_error']}"
    )


def run(
    root: Path,
    corpus: Path,
    out: Path | None,
    slack: int,
    verbose: bool,
    heldout_only: bool = False,
) -> int:
    entries = load_corpus(corpus)
    if heldout_only:
        entries = [e for e in entries if e.heldout]
    groups: dict[str, list[Entry]] = {}
    for e in entries:
        groups.setdefault(e.group, []).append(e)
    present = [g for g, es in groups.items() if all((root / e.repo / e.path).exists() for e in es)]
    if not present:
        print(f"corpus files absent under {root}: skipped (fetch them with --fetch {root})")
        return 0
    scores = [score_group(g, groups[g], root, slack) for g in sorted(present)]
    print(f"{'repository':40} {'files':>5} {'tp':>4} {'fp':>4} {'fn':>4} {'prec':>5} {'rec':>5}")
    for s in scores:
        name = f"{s.group} *" if s.heldout else s.group
        print(
            f"{name:40} {s.files:5d} {s.tp:4d} {s.fp:4d} {s.fn:4d} "
            f"{_fmt(_ratio(s.tp, s.tp + s.fp)):>5} {_fmt(_ratio(s.tp, s.tp + s.fn)):>5}"
        )
    tp, fp, fn = (sum(getattr(s, k) for s in scores) for k in ("tp", "fp", "fn"))
    fp_errors = sum(s.fp_errors for s in scores)
    files = sum(s.files for s in scores)
    seconds = sum(s.seconds for s in scores)
    precision, recall = _ratio(tp, tp + fp), _ratio(tp, tp + fn)
    rate = files / seconds if seconds else 0.0
    skipped = len(groups) - len(present)
    splits: dict[str, Any] = {}
    newest = max((s.judged for s in scores if s.judged), default=None)
    if newest is not None:
        splits["heldout_newest"] = {
            "set": newest,
            **summary([s for s in scores if s.judged == newest]),
        }
        print(
            _summary_line(
                f"held-out, judged {newest} before its rule changes", splits["heldout_newest"]
            )
        )
        newest_scores = [s for s in scores if s.judged == newest]
        splits["heldout_newest"]["by_rule"] = by_rule(newest_scores)
        unscored = sum(s.unscored for s in newest_scores)
        splits["heldout_newest"]["unscored"] = unscored
        for code, r in splits["heldout_newest"]["by_rule"].items():
            print(
                f"  {code}: tp {r['tp']}, fp {r['fp']} ({r['false_positives_error']} at error), "
                f"fn {r['fn']}, precision {_fmt(r['precision'])}, recall {_fmt(r['recall'])}"
            )
        if unscored:
            print(f"  not scored: {unscored} expected findings of rules the checker does not have")
    held = [s for s in scores if s.heldout and s.judged != newest]
    tuned = [s for s in scores if not s.heldout]
    if held:
        splits["heldout"] = summary(held)
        print(_summary_line("held-out, earlier sets", splits["heldout"]))
    if tuned and (held or newest):
        splits["tuned"] = summary(tuned)
        print(_summary_line("tuned", splits["tuned"]))
    print(
        f"overall: {len(present)} repositories ({skipped} skipped, files absent), {files} files, "
        f"precision {_fmt(precision)}, recall {_fmt(recall)} (tp {tp}, fp {fp}, fn {fn}), "
        f"false positives at error severity {fp_errors}, {rate:.0f} files/s"
    )
    if verbose:
        for s in scores:
            for f in s.false_positives:
                why = f" [safe: {f['safe_because']}]" if f["safe_because"] else ""
                print(f"  FP {s.group}/{f['path']}:{f['line']} {f['code']}{why}")
            for m in s.misses:
                print(f"  MISS {s.group}/{m['path']}:{m['line']} {m['code']} ({m['why']})")
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        result = {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "repositories": len(present),
            "skipped_repositories": skipped,
            "files": files,
            "tp": tp,
            "fp": fp,
            "fn": fn,
            "precision": precision,
            "recall": recall,
            "false_positives_error": fp_errors,
            "files_per_s": rate,
            **splits,
            "groups": [s.__dict__ for s in scores],
        }
        out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--corpus", type=Path, default=CORPUS)
    parser.add_argument("--files", type=Path, default=DEFAULT_FILES, help="where the files are")
    parser.add_argument("--fetch", type=Path, metavar="DIR", help="download the files into DIR")
    parser.add_argument(
        "--from-git",
        type=Path,
        metavar="MIRRORS",
        help="write the files into --files from local git copies (MIRRORS/owner+name)",
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON result")
    parser.add_argument("--line-slack", type=int, default=0, help="line tolerance when matching")
    parser.add_argument("-v", "--verbose", action="store_true", help="list FPs and misses")
    parser.add_argument(
        "--heldout-only", action="store_true", help="score only the held-out repositories"
    )
    args = parser.parse_args(argv)
    if args.fetch is not None:
        failed = fetch(load_corpus(args.corpus), args.fetch)
        print(f"fetched into {args.fetch}; {failed} failed")
        return 1 if failed else 0
    if args.from_git is not None:
        failed = extract(load_corpus(args.corpus), args.from_git, args.files)
        print(f"extracted into {args.files}; {failed} failed")
        return 1 if failed else 0
    return run(args.files, args.corpus, args.out, args.line_slack, args.verbose, args.heldout_only)


if __name__ == "__main__":
    sys.exit(main())

"""Run real public training scripts under ddpkit and score what happens against what was
judged by hand.

The list (`bench/real/real.json`) names each script as `repo@commit:path` with the
outcome a careful reader expects under `ddpkit run`, `run --cpu`, `run --audit`,
`ddpkit check` and, where it applies, `ddpkit verify --loop`, on a machine without a GPU
(2 CPU ranks over gloo). No source is stored in this repository: the files are
extracted from local git copies or downloaded into a scratch folder outside it.

    .venv/bin/python bench/real.py --from-git /work/.mirror      # extract, then run all
    .venv/bin/python bench/real.py --fetch                       # download, then run all
    .venv/bin/python bench/real.py --python /work/realenv/bin/python --only nanogpt
    .venv/bin/python bench/real.py --markdown                    # the table for the docs
    .venv/bin/python bench/real.py --from-git /work/.mirror --port  # docs/port.md, for real

Each mode runs in a fresh copy of the script's files, with the tiny data its entry asks
for generated there (token files, an image folder, MNIST's files), under a time limit.
Prints one row per script (`ok` = as expected, `ok!=fails` = measured ok where `fails`
was expected), one line per skipped script (files absent, a Python package missing),
and exits 1 on a mismatch. The JSON result goes to `--out`.
"""

from __future__ import annotations

import argparse
import array
import contextlib
import datetime
import json
import os
import pickle
import queue
import random
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.request
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
LIST = HERE / "real" / "real.json"
DEFAULT_WORK = Path("/tmp/ddpkit-real")
DEFAULT_OUT = HERE / "results" / "real.json"
RAW_URL = "https://raw.githubusercontent.com/{repo}/{commit}/{path}"
_COMMIT = re.compile(r"^[0-9a-f]{40}$")

MODES = ("run", "run_cpu", "audit", "check", "verify_loop")
# The outcomes each mode may be judged to have (see real.json's "about").
ALLOWED: dict[str, frozenset[str]] = {
    "run": frozenset({"ok", "fails", "refused"}),
    "run_cpu": frozenset({"ok", "fails", "refused"}),
    "audit": frozenset({"clean", "findings", "fails", "refused"}),
    "check": frozenset({"clean", "findings"}),
    "verify_loop": frozenset({"pass", "differs", "refused", "fails", "n/a"}),
}
# Outcomes only a measurement can have: the run went past its time limit, or was not run.
TIMEOUT = "timeout"
SKIPPED = "skipped"


@dataclass(frozen=True)
class Expect:
    outcome: str
    why: str
    codes: frozenset[str] = frozenset()
    tolerated: frozenset[str] = frozenset()
    function: str = "main"
    args: tuple[str, ...] = ()


@dataclass(frozen=True)
class Script:
    id: str
    repo: str
    commit: str
    path: str
    files: tuple[str, ...]
    args: tuple[str, ...]
    nproc: int
    cuda: bool
    needs: tuple[str, ...]
    setup: tuple[dict[str, Any], ...]
    stop_when: str | None
    timeout: float
    expect: dict[str, Expect]
    shaped_test: str | None = None
    # Environment variables of its runs; `{root}` is the run's copy of the files.
    env: tuple[tuple[str, str], ...] = ()

    @property
    def all_files(self) -> tuple[str, ...]:
        return (self.path, *self.files)


def _setups(raw: dict[str, Any] | list[dict[str, Any]] | None) -> tuple[dict[str, Any], ...]:
    if raw is None:
        return ()
    return (raw,) if isinstance(raw, dict) else tuple(raw)


def load(path: Path = LIST) -> list[Script]:
    """The listed scripts; raises ValueError naming the entry and field that is wrong."""
    doc = json.loads(path.read_text(encoding="utf-8"))
    scripts: list[Script] = []
    for raw in doc["scripts"]:
        where = f"{raw.get('id', '?')} ({raw.get('repo')}:{raw.get('path')})"
        if not _COMMIT.match(str(raw.get("commit", ""))):
            raise ValueError(f"{where}: commit is not 40 hex digits")
        expect: dict[str, Expect] = {}
        for mode, e in raw["expect"].items():
            if mode not in ALLOWED:
                raise ValueError(f"{where}: unknown mode {mode!r}; the modes: {', '.join(MODES)}")
            if e["outcome"] not in ALLOWED[mode]:
                raise ValueError(
                    f"{where}: {mode} outcome {e['outcome']!r} is not one of "
                    f"{', '.join(sorted(ALLOWED[mode]))}"
                )
            if not e.get("why"):
                raise ValueError(f"{where}: {mode} says no why")
            expect[mode] = Expect(
                e["outcome"],
                e["why"],
                frozenset(e.get("codes", ())),
                frozenset(e.get("tolerated", ())),
                e.get("function", "main"),
                tuple(e.get("args", ())),
            )
        missing = [m for m in MODES if m not in expect]
        if missing:
            raise ValueError(f"{where}: no expectation for {', '.join(missing)}")
        scripts.append(
            Script(
                id=raw["id"],
                repo=raw["repo"],
                commit=raw["commit"],
                path=raw["path"],
                files=tuple(raw.get("files", ())),
                args=tuple(raw.get("args", ())),
                nproc=int(raw.get("nproc", 2)),
                cuda=bool(raw.get("cuda", False)),
                needs=tuple(raw.get("needs", ())),
                setup=_setups(raw.get("setup")),
                stop_when=raw.get("stop_when"),
                timeout=float(raw.get("timeout", 240)),
                expect=expect,
                shaped_test=raw.get("shaped_test"),
                env=tuple(sorted(raw.get("env", {}).items())),
            )
        )
    ids = [s.id for s in scripts]
    if len(ids) != len(set(ids)):
        raise ValueError("two entries share an id")
    return scripts


# --- getting the files --------------------------------------------------------------


def _source(work: Path, s: Script) -> Path:
    return work / "files" / s.repo / s.commit


def extract(scripts: list[Script], mirrors: Path, work: Path) -> int:
    """Write each script's files under `work/files/{repo}/{commit}/` from local git copies
    (`mirrors/{owner}+{name}`, bare or with a `repo/` git folder inside); returns how many
    files failed."""
    failed = 0
    for s in scripts:
        base = mirrors / s.repo.replace("/", "+")
        git_dir = base / "repo" if (base / "repo" / "HEAD").exists() else base
        for rel in s.all_files:
            target = _source(work, s) / rel
            if target.exists():
                continue
            shown = subprocess.run(
                ["git", f"--git-dir={git_dir}", "show", f"{s.commit}:{rel}"],
                capture_output=True,
                check=False,
            )
            if shown.returncode != 0:
                print(f"failed: {s.repo}@{s.commit}:{rel}: {shown.stderr.decode().strip()}")
                failed += 1
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(shown.stdout)
    return failed


def fetch(scripts: list[Script], work: Path, timeout: float = 30.0) -> int:
    """Download each script's files from raw.githubusercontent.com; returns how many failed."""
    failed = 0
    for s in scripts:
        for rel in s.all_files:
            target = _source(work, s) / rel
            if target.exists():
                continue
            url = RAW_URL.format(repo=s.repo, commit=s.commit, path=rel)
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


# --- tiny data ----------------------------------------------------------------------


def _png(path: Path, size: int, rng: random.Random) -> None:
    """A small RGB PNG of noise, written without an imaging library."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    rows = b"".join(b"\x00" + rng.randbytes(size * 3) for _ in range(size))
    header = struct.pack(">IIBBBBB", size, size, 8, 2, 0, 0, 0)
    path.write_bytes(
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(rows))
        + chunk(b"IEND", b"")
    )


def make_data(root: Path, setup: dict[str, Any]) -> None:
    """Generate the tiny data an entry's `setup` asks for, under `root` (the copy's top)."""
    rng = random.Random(0)
    kind = setup["kind"]
    folder = root / setup["dir"]
    folder.mkdir(parents=True, exist_ok=True)
    if kind == "tokens":  # nanoGPT's train.bin / val.bin (uint16) and meta.pkl
        vocab, n = int(setup["vocab"]), int(setup["tokens"])
        for name, count in (("train.bin", n), ("val.bin", n // 10)):
            tokens = array.array("H", (rng.randrange(vocab) for _ in range(count)))
            if sys.byteorder != "little":
                tokens.byteswap()
            (folder / name).write_bytes(tokens.tobytes())
        with open(folder / "meta.pkl", "wb") as f:
            pickle.dump({"vocab_size": vocab}, f)
    elif kind == "images":  # an ImageFolder: dir/{split}/class{k}/{i}.png
        for split in setup["splits"]:
            for k in range(int(setup["classes"])):
                sub = folder / split / f"class{k}"
                sub.mkdir(parents=True, exist_ok=True)
                for i in range(int(setup["per_class"])):
                    _png(sub / f"{i}.png", int(setup["size"]), rng)
    elif kind == "mnist":  # torchvision's MNIST raw files, so nothing downloads
        for prefix, count in (("train", int(setup["train"])), ("t10k", int(setup["test"]))):
            images = struct.pack(">IIII", 2051, count, 28, 28) + rng.randbytes(count * 784)
            labels = struct.pack(">II", 2049, count) + bytes(
                rng.randrange(10) for _ in range(count)
            )
            (folder / f"{prefix}-images-idx3-ubyte").write_bytes(images)
            (folder / f"{prefix}-labels-idx1-ubyte").write_bytes(labels)
    elif kind == "hub_stub":  # a torch.hub cache entry with no models, so hub.list is offline
        (folder / "hubconf.py").write_text("dependencies = []\n", encoding="utf-8")
    else:
        raise ValueError(f"unknown setup kind {kind!r}: tokens, images, mnist or hub_stub")


# --- running ------------------------------------------------------------------------


@dataclass
class Measured:
    outcome: str
    seconds: float = 0.0
    codes: frozenset[str] = frozenset()
    returncode: int | None = None
    tail: str = ""
    note: str = ""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _descendants(pid: int) -> list[int]:
    """Every process below `pid` (from /proc), children first."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found: list[int] = []
    todo = [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _execute(
    cmd: list[str],
    cwd: Path,
    timeout: float,
    stop_when: str | None,
    extra_env: tuple[tuple[str, str], ...] = (),
) -> tuple[int | None, str, bool, bool]:
    """Run `cmd` in its own session; returns (exit status, output, stopped on `stop_when`,
    timed out). A job stopped on its pattern gets SIGINT (ddpkit stops every rank), then
    SIGKILL if it lingers."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.update((k, v.format(root=cwd)) for k, v in extra_env)
    proc = subprocess.Popen(
        cmd,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        errors="replace",
        start_new_session=True,
    )
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    pattern = re.compile(stop_when) if stop_when else None
    out: list[str] = []
    deadline = time.monotonic() + timeout
    stopped = timed_out = False
    while True:
        try:
            line = lines.get(timeout=max(0.0, min(1.0, deadline - time.monotonic())))
        except queue.Empty:
            if time.monotonic() >= deadline:
                timed_out = True
                break
            continue
        if line is None:
            break
        out.append(line)
        if pattern is not None and pattern.search(line):
            stopped = True
            break
    if stopped or timed_out:
        # ddpkit stops its ranks on SIGINT, but processes a script started itself
        # (mp.spawn's children) live in the ranks' sessions: they are killed by pid.
        below = _descendants(proc.pid)
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        for pid in below:
            with contextlib.suppress(OSError):  # already gone
                os.kill(pid, signal.SIGKILL)
    returncode = proc.wait()
    return (None if timed_out else returncode), "".join(out), stopped, timed_out


def classify(returncode: int | None, output: str, stopped: bool = False) -> str:
    """ok, fails (a traceback), refused (one `ddpkit` line, no traceback) or timeout."""
    if stopped:
        return "ok"
    if returncode is None:
        return TIMEOUT
    if returncode == 0:
        return "ok"
    if "Traceback (most recent call last)" in output:
        return "fails"
    last = next((ln for ln in reversed(output.splitlines()) if ln.strip()), "")
    return "refused" if last.lstrip().startswith("ddpkit") else "fails"


def classify_verify(returncode: int | None, output: str) -> str:
    """pass (0), differs (verify's FAIL), refused, fails (a traceback) or timeout."""
    if returncode is None:
        return TIMEOUT
    if returncode == 0:
        return "pass"
    if "Traceback (most recent call last)" in output:
        return "fails"
    if returncode == 1 and re.search(r"^FAIL\b", output, re.MULTILINE):
        return "differs"
    return "refused"


def _tail(output: str, n: int = 3) -> str:
    return " | ".join(ln.strip() for ln in output.strip().splitlines()[-n:])


class Runner:
    """Runs the modes of one script with one Python (its ddpkit and packages)."""

    def __init__(self, python: str, work: Path) -> None:
        self.python = python
        self.work = work
        help_text = subprocess.run(
            [python, "-m", "ddpkit", "run", "--help"], capture_output=True, text=True, check=False
        ).stdout
        self.has_cpu = "--cpu" in help_text

    def missing(self, s: Script) -> list[str]:
        """The packages the script needs that this Python cannot import."""
        if not s.needs:
            return []
        probe = (
            "import importlib.util as u, sys; "
            "print(' '.join(m for m in sys.argv[1:] if u.find_spec(m) is None))"
        )
        done = subprocess.run(
            [self.python, "-c", probe, *s.needs], capture_output=True, text=True, check=False
        )
        return done.stdout.split()

    def _copy(self, s: Script, mode: str) -> Path:
        dest = self.work / "runs" / s.id / mode
        if dest.exists():
            shutil.rmtree(dest)
        shutil.copytree(_source(self.work, s), dest)
        for setup in s.setup:
            make_data(dest, setup)
        return dest

    def _ddpkit_run(self, s: Script, mode: str, flags: list[str]) -> tuple[Measured, Path]:
        cwd = self._copy(s, mode)
        cmd = [self.python, "-m", "ddpkit", "run", "--nproc", str(s.nproc)]
        cmd += ["--master-port", str(_free_port()), *flags, s.path, *s.args]
        start = time.monotonic()
        rc, output, stopped, _ = _execute(cmd, cwd, s.timeout, s.stop_when, s.env)
        measured = Measured(classify(rc, output, stopped), time.monotonic() - start)
        measured.returncode, measured.tail = rc, _tail(output)
        if stopped:
            measured.note = "stopped at its stop_when line"
        return measured, cwd

    def measure(self, s: Script, mode: str) -> Measured:
        if mode == "run":
            return self._ddpkit_run(s, mode, [])[0]
        if mode == "run_cpu":
            if not self.has_cpu:
                return Measured(SKIPPED, note="this ddpkit has no run --cpu")
            return self._ddpkit_run(s, mode, ["--cpu"])[0]
        if mode == "audit":
            flags = ["--audit", "--log-dir", "ddpkit-logs"]
            if s.cuda:
                if not self.has_cpu:
                    return Measured(SKIPPED, note="a CUDA script: its audit needs run --cpu")
                flags.append("--cpu")
            measured, cwd = self._ddpkit_run(s, mode, flags)
            log = cwd / "ddpkit-logs" / "audit.json"
            if log.exists():
                doc = json.loads(log.read_text(encoding="utf-8"))
                measured.codes = frozenset(str(f["code"]) for f in doc.get("findings", []))
            if measured.outcome == "ok":
                measured.outcome = "findings" if measured.codes else "clean"
            return measured
        if mode == "check":
            src = _source(self.work, s)
            start = time.monotonic()
            done = subprocess.run(
                [self.python, "-m", "ddpkit", "check", "--format", "json"]
                + [str(src / rel) for rel in s.all_files],
                capture_output=True,
                text=True,
                check=False,
            )
            if done.returncode not in (0, 1):
                return Measured("fails", time.monotonic() - start, tail=_tail(done.stderr))
            codes = frozenset(str(f["code"]) for f in json.loads(done.stdout or "[]"))
            return Measured(
                "findings" if codes else "clean", time.monotonic() - start, codes, done.returncode
            )
        if mode == "verify_loop":
            e = s.expect["verify_loop"]
            if e.outcome == "n/a":
                return Measured("n/a")
            cwd = self._copy(s, mode)
            cmd = [self.python, "-m", "ddpkit", "verify", "--loop", f"{s.path}:{e.function}"]
            cmd += ["--nproc", str(max(2, s.nproc)), *e.args]
            start = time.monotonic()
            rc, output, _, _ = _execute(cmd, cwd, s.timeout, None, s.env)
            return Measured(
                classify_verify(rc, output),
                time.monotonic() - start,
                returncode=rc,
                tail=_tail(output),
            )
        raise ValueError(f"unknown mode {mode!r}")


# --- scoring ------------------------------------------------------------------------


def agrees(expect: Expect, measured: Measured) -> bool | None:
    """True when the measurement is what was judged, False when not, None when there is
    nothing to compare (skipped, or a mode that does not apply)."""
    if measured.outcome in (SKIPPED, "not run"):
        return None
    if expect.outcome == "n/a":
        return None if measured.outcome == "n/a" else False
    if measured.outcome != expect.outcome:
        return False
    if expect.outcome == "findings" or measured.outcome == "findings":
        extra = measured.codes - expect.codes - expect.tolerated
        return expect.codes <= measured.codes and not extra
    return True


def cell(expect: Expect, measured: Measured) -> str:
    """One table cell: the outcome, its codes, and `!=expected` on a mismatch."""
    if measured.outcome == "n/a" and expect.outcome == "n/a":
        return "n/a"
    if measured.outcome in (SKIPPED, "not run"):
        return f"({expect.outcome}: {measured.outcome})"
    text = measured.outcome
    if measured.codes:
        text += " " + ",".join(sorted(measured.codes))
    if agrees(expect, measured) is False:
        want = expect.outcome
        if expect.codes:
            want += " " + ",".join(sorted(expect.codes))
        text += f" != {want}"
    return text


@dataclass
class Row:
    script: Script
    cells: dict[str, Measured] = field(default_factory=dict)
    skipped: str | None = None


def score(rows: list[Row]) -> tuple[int, int, int]:
    """(agreeing cells, mismatching cells, cells without a measurement)."""
    good = bad = none = 0
    for row in rows:
        for mode in MODES:
            measured = row.cells.get(mode, Measured("not run"))
            verdict = agrees(row.script.expect[mode], measured)
            if verdict is None:
                none += 1
            elif verdict:
                good += 1
            else:
                bad += 1
    return good, bad, none


def table(rows: list[Row], markdown: bool) -> str:
    """The result as a text or markdown table, the skipped scripts one line each below."""
    head = ["script", *MODES]
    body = [
        [
            row.script.id,
            *(cell(row.script.expect[m], row.cells.get(m, Measured("not run"))) for m in MODES),
        ]
        for row in rows
        if row.skipped is None
    ]
    lines: list[str] = []
    if markdown:
        lines.append("| " + " | ".join(head) + " |")
        lines.append("|" + "---|" * len(head))
        lines += ["| " + " | ".join(r) + " |" for r in body]
    else:
        widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head))]
        lines += [
            "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
            for r in [head, *body]
        ]
    lines += [f"skipped {row.script.id}: {row.skipped}" for row in rows if row.skipped]
    return "\n".join(lines)


def run_all(
    scripts: list[Script], runner: Runner, modes: tuple[str, ...], verbose: bool
) -> list[Row]:
    rows: list[Row] = []
    for s in scripts:
        row = Row(s)
        rows.append(row)
        absent = [rel for rel in s.all_files if not (_source(runner.work, s) / rel).exists()]
        if absent:
            row.skipped = f"files absent ({', '.join(absent)}); get them with --from-git or --fetch"
            continue
        lacking = runner.missing(s)
        if lacking:
            row.skipped = f"{runner.python} lacks {', '.join(lacking)} (see bench/real/README.md)"
            continue
        for mode in modes:
            measured = runner.measure(s, mode)
            row.cells[mode] = measured
            if verbose:
                print(
                    f"  {s.id} {mode}: {measured.outcome} {sorted(measured.codes) or ''} "
                    f"{measured.seconds:.0f}s {measured.note} {measured.tail[-300:]}",
                    flush=True,
                )
    return rows


def rows_from_results(scripts: list[Script], results: list[Path]) -> list[Row]:
    """Rows from saved `--out` files (later files win), to print one table from several
    partial runs without running anything again."""
    by_id = {s.id: Row(s) for s in scripts}
    for path in results:
        doc = json.loads(path.read_text(encoding="utf-8"))
        for saved in doc["rows"]:
            row = by_id.get(saved["id"])
            if row is None:
                continue
            if saved["skipped"]:
                row.skipped = row.skipped if row.cells else saved["skipped"]
                continue
            row.skipped = None
            for mode, c in saved["cells"].items():
                row.cells[mode] = Measured(
                    c["outcome"],
                    c["seconds"],
                    frozenset(c["codes"]),
                    c["returncode"],
                    c["tail"],
                    c["note"],
                )
    return list(by_id.values())


def port_check(
    scripts: list[Script], mirrors: Path | None, download: bool, work: Path, python: str
) -> int:
    """docs/port.md's diff applied to the real file it is against (the list's entry of the
    same repo@commit:path, extracted or downloaded as for the other modes) in a fresh
    copy, and the port run as the page runs it (bench/port_diff.py). Prints a line per
    step; returns 1 when one failed."""
    import port_diff  # bench/port_diff.py, beside this script

    pinned = port_diff.pinned()
    entry = next((s for s in scripts if (s.repo, s.commit, s.path) == pinned), None)
    if entry is None:
        print(f"docs/port.md's diff is against {'@'.join(pinned[:2])}:{pinned[2]}: not listed")
        return 1
    if mirrors is not None:
        extract([entry], mirrors, work)
    if download:
        fetch([entry], work)
    folder = _source(work, entry) / Path(entry.path).parent
    if not all((_source(work, entry) / rel).exists() for rel in entry.all_files):
        print(f"{entry.id}: files absent; get them with --from-git or --fetch")
        return 1
    dest = work / "runs" / entry.id / "port"
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(folder, dest)
    print(f"docs/port.md's diff on {entry.repo}@{entry.commit[:7]}:{entry.path}")
    said = port_diff.check(dest, python)
    for line in said:
        print(f"  {line}")
    return 1 if any(line.startswith("FAILED") for line in said) else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--list", type=Path, default=LIST, help="the scripts and expectations")
    parser.add_argument("--work", type=Path, default=DEFAULT_WORK, help="scratch folder")
    parser.add_argument("--from-git", type=Path, metavar="MIRRORS", help="extract from git copies")
    parser.add_argument("--fetch", action="store_true", help="download the files first")
    parser.add_argument("--python", default=sys.executable, help="the Python that runs ddpkit")
    parser.add_argument("--only", help="comma-separated ids")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated modes")
    parser.add_argument("--markdown", action="store_true", help="print a markdown table")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON result")
    parser.add_argument("-v", "--verbose", action="store_true", help="print each run as it ends")
    parser.add_argument(
        "--results",
        type=Path,
        nargs="+",
        metavar="FILE",
        help="print the table of saved --out files (merged, later ones win); run nothing",
    )
    parser.add_argument(
        "--port",
        action="store_true",
        help="only apply docs/port.md's diff to the tutorial file it is against, and run the port",
    )
    args = parser.parse_args(argv)
    scripts = load(args.list)
    if args.only:
        wanted = set(args.only.split(","))
        unknown = wanted - {s.id for s in scripts}
        if unknown:
            parser.error(f"unknown ids {sorted(unknown)}; the ids: {[s.id for s in scripts]}")
        scripts = [s for s in scripts if s.id in wanted]
    modes = tuple(m for m in args.modes.split(",") if m)
    if set(modes) - set(MODES):
        parser.error(f"unknown modes {sorted(set(modes) - set(MODES))}; the modes: {MODES}")
    if args.results:
        rows = rows_from_results(scripts, args.results)
        print(table(rows, args.markdown))
        good, bad, none = score(rows)
        print(f"{good} as judged, {bad} not, {none} not measured")
        return 1 if bad else 0
    if args.work.resolve().is_relative_to(HERE.parent):
        parser.error("--work must be outside the repository: fetched files are never committed")
    if args.port:
        return port_check(load(args.list), args.from_git, args.fetch, args.work, args.python)
    if args.from_git is not None and extract(scripts, args.from_git, args.work):
        print("some files could not be extracted; their scripts are skipped")
    if args.fetch and fetch(scripts, args.work):
        print("some files could not be downloaded; their scripts are skipped")
    rows = run_all(scripts, Runner(args.python, args.work), modes, args.verbose)
    print(table(rows, args.markdown))
    good, bad, none = score(rows)
    print(f"{good} as judged, {bad} not, {none} not measured")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": args.python,
        "rows": [
            {
                "id": r.script.id,
                "skipped": r.skipped,
                "cells": {
                    m: {
                        "outcome": c.outcome,
                        "codes": sorted(c.codes),
                        "seconds": round(c.seconds, 1),
                        "returncode": c.returncode,
                        "agrees": agrees(r.script.expect[m], c),
                        "tail": c.tail[-500:],
                        "note": c.note,
                    }
                    for m, c in r.cells.items()
                },
            }
            for r in rows
        ],
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

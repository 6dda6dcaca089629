"""Every bad input to the `ddpkit` command: exit status 2 and one line that names the
problem and the fix (or a documented warning), with no traceback, no hang and nothing
left behind. One row per input; each fails before any worker starts."""

from __future__ import annotations

import functools
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _metrics(folder: str, *records: dict[str, object]) -> Callable[[Path], None]:
    def make(work: Path) -> None:
        _write(work / folder / "metrics.jsonl", "".join(json.dumps(r) + "\n" for r in records))

    return make


def _chain(terms: int) -> str:
    return "x = 1" + " + 1" * terms + "\n"


def _unreadable(path: Path, text: str, what: Path | None = None) -> None:
    """Write `path`, then make `what` (the file, or a folder above it) unreadable."""
    _write(path, text)
    (what or path).chmod(0)  # until _readable_again, so that pytest can delete it


# Made unreadable by the MAKERS above (mode 0); a row that needs them runs as a process
# that the permission bits stop (see `_denied_reads`).
UNREADABLE = ("unreadable.py", "locked")


def _readable_again(work: Path) -> None:
    for name in UNREADABLE:
        if (work / name).exists():
            (work / name).chmod(0o700)


# Root reads a file whatever its mode (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH): root's
# child runs without those two capabilities, as root still (it owns the test's files).
_NO_DAC = "-dac_override,-dac_read_search"
_SETPRIV = ("setpriv", f"--inh-caps={_NO_DAC}", f"--bounding-set={_NO_DAC}")


@functools.cache
def _denied_reads() -> tuple[str, ...] | None:
    """The command prefix under which a file of mode 0 cannot be read: none for a user,
    setpriv for root; None where no such prefix works here (the rows then skip)."""
    prefix = _SETPRIV if os.geteuid() == 0 else ()
    if prefix and shutil.which(prefix[0]) is None:
        return None
    with tempfile.TemporaryDirectory() as folder:
        probe = Path(folder, "probe")
        probe.write_text("")
        probe.chmod(0)
        read = [*prefix, sys.executable, "-c", f"open({str(probe)!r}).close()"]
        denied = subprocess.run(read, capture_output=True, timeout=60).returncode != 0
    return prefix if denied else None


def _limit_memory() -> None:
    # A row that reads a device: should it read /dev/zero to the end after all, it
    # fails with MemoryError at 8 GiB instead of filling the machine's memory.
    resource.setrlimit(resource.RLIMIT_AS, (8 * 2**30, resource.RLIM_INFINITY))


# Files a row's command reads, made in the child's working folder (names are relative).
MAKERS: dict[str, Callable[[Path], None]] = {
    "afile": lambda w: _write(w / "afile", ""),
    "adir": lambda w: (w / "adir").mkdir(),
    "fifo.py": lambda w: os.mkfifo(w / "fifo.py"),
    "s.py": lambda w: _write(w / "s.py", "print('ran')\n"),
    # one finding (DDP110), to show that the other files are still checked
    "ok.py": lambda w: _write(w / "ok.py", 'import os\nos.environ["MASTER_PORT"] = "12355"\n'),
    "chain.py": lambda w: _write(w / "chain.py", _chain(100_000)),  # too deep for ast.parse
    "deep.py": lambda w: _write(w / "deep.py", _chain(600)),  # parses; too deep to analyse
    "big.py": lambda w: _write(w / "big.py", "#" * (6 * 2**20)),
    "huge": _metrics(
        "huge",
        {"kind": "step", "step": 1, "loss": 1e308, "samples_per_s": 1e308, "time": 1},
        {"kind": "step", "step": 2, "loss": -1e308, "samples_per_s": 1e308, "time": 2},
        {"kind": "epoch", "step": 2, "epoch": 1, "loss": 1e308, "accuracy": 1e308},
    ),
    "mixed": _metrics(
        "mixed",
        {"kind": "step", "step": 1, "loss": 0.9, "time": 1.0},
        {"kind": "step", "step": 2, "loss": 1e308, "time": 2.0},
        {"kind": "step", "step": 3, "loss": -1e308, "time": 3.0},
        {"kind": "step", "step": 4, "loss": 0.5, "time": 4.0},
    ),
    "words": _metrics(
        "words",
        {"kind": "step", "step": 1, "loss": 0.9},
        {"kind": "epoch", "step": 1, "epoch": 1, "accuracy": "high", "loss": True},
    ),
    "empty": lambda w: _write(w / "empty" / "metrics.jsonl", ""),
    "dirrun": lambda w: (w / "dirrun" / "metrics.jsonl").mkdir(parents=True),
    "fifo.toml": lambda w: os.mkfifo(w / "fifo.toml"),
    "bad.toml": lambda w: _write(w / "bad.toml", "epochs = 3\nbatch_size = = 8\n"),
    # Over the size limit; read whole, it would stop at batch_size (not train).
    "big.toml": lambda w: _write(w / "big.toml", "#" * (2 * 2**20) + "\nbatch_size = 0\n"),
    "unreadable.py": lambda w: _unreadable(w / "unreadable.py", "def build(ctx):\n    pass\n"),
    "locked": lambda w: _unreadable(w / "locked" / "a.py", "x = 1\n", what=w / "locked"),
}
NODE_1 = ("--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1")


@dataclass(frozen=True)
class Row:
    id: str
    argv: tuple[str, ...]
    message: str  # a fragment of the one line on stderr (stdout for `check`)
    code: int = 2
    needs: tuple[str, ...] = ()  # MAKERS to run first
    warning: str | None = None  # a fragment of the one documented warning line
    stream: str = "stderr"  # where the one line is
    also: str | None = None  # a fragment stdout must also hold
    creates: tuple[str, ...] = ()  # what a row that succeeds may write
    stdout_full: bool = False  # stdout is /dev/full
    prefix: str = "ddpkit: error:"  # how the one error line starts
    reads_device: bool = False  # a memory limit keeps a read of /dev/zero from filling RAM
    pending: str | None = None  # why the row is skipped for now: what must change first


ROWS = [
    # -- ddpkit train: options checked before any worker starts ------------------------
    Row("run-dir-is-file", ("train", "--run-dir", "afile"), "'afile' is a file", needs=("afile",)),
    Row(
        "run-dir-under-file",
        ("train", "--run-dir", "afile/sub"),
        "cannot be made: 'afile' is a file",
        needs=("afile",),
    ),
    Row(
        "checkpoint-dir-is-file",
        ("train", "--checkpoint-dir", "afile"),
        "cannot write checkpoints",
        needs=("afile",),
    ),
    Row(
        "checkpoint-dir-under-file",
        ("train", "--checkpoint-dir", "afile/ck"),
        "cannot write checkpoints",
        needs=("afile",),
    ),
    Row("checkpoint-dir-empty", ("train", "--checkpoint-dir", ""), "leave it out"),
    Row("run-dir-empty", ("train", "--run-dir", ""), "run_dir must be a non-empty string"),
    Row("seed-too-large", ("train", "--seed", "9" * 23), "seed must be < 2**63"),
    Row("seed-negative", ("train", "--seed", "-1"), "seed must be >= 0"),
    Row("batch-size-too-large", ("train", "--batch-size", "9" * 20), "batch_size must be < 2**63"),
    Row("nproc-negative", ("train", "--nproc", "-1"), "pass --nproc 2"),
    Row(
        "nproc-over-4x-cores",
        ("train", "--backend", "gloo", "--nproc", str(4 * CORES + 1)),
        "--allow-oversubscribe",
    ),
    Row(
        "nproc-100000",
        ("train", "--backend", "gloo", "--nproc", "100000"),
        f"more than 4 x the {CORES} CPU core(s)",
    ),
    Row(
        "nproc-over-cores-warns",
        ("train", "--backend", "gloo", "--nproc", str(CORES + 1), "--run-dir", "afile"),
        "'afile' is a file",
        needs=("afile",),
        warning=f"is more than the {CORES} CPU core(s)",
    ),
    Row("num-workers-100000", ("train", "--num-workers", "100000"), "pass --num-workers"),
    Row(
        "num-workers-over-cores-warns",
        ("train", "--num-workers", str(CORES + 1), "--run-dir", "afile"),
        "'afile' is a file",
        needs=("afile",),
        warning="--num-workers",
    ),
    # Empty values name nothing: refused, never taken as "the default". Each row also
    # passes --run-dir afile, so that one taken as the default stops there, not trains.
    Row("job-empty", ("train", "--job", "", "--run-dir", "afile"), "(got '')", needs=("afile",)),
    Row(
        "example-empty",
        ("train", "--example", "", "--run-dir", "afile"),
        "unknown example ''",
        needs=("afile",),
    ),
    Row(
        "loggers-empty",
        ("train", "--loggers", "", "--run-dir", "afile"),
        "--loggers '' names no logger",
        needs=("afile",),
    ),
    Row(
        "config-empty",
        ("train", "--config", "", "--run-dir", "afile"),
        "--config '' names no file",
        needs=("afile",),
    ),
    # -- train --config and --job: regular files only, read without blocking ----------
    Row(
        "config-fifo",
        ("train", "--config", "fifo.toml", "--run-dir", "afile"),
        "is not a regular file (a FIFO)",
        needs=("fifo.toml", "afile"),
    ),
    Row(
        "config-dev-zero",
        ("train", "--config", "/dev/zero", "--run-dir", "afile"),
        "is not a regular file (a device)",
        needs=("afile",),
        reads_device=True,
    ),
    Row(
        "config-too-large",
        ("train", "--config", "big.toml"),
        "is too large (2.0 MiB, over the limit of 1 MiB)",
        needs=("big.toml",),
    ),
    Row(
        "config-toml-syntax",
        ("train", "--config", "bad.toml"),
        "line 2 is 'batch_size = = 8'",
        needs=("bad.toml",),
    ),
    Row(
        "job-fifo",
        ("train", "--job", "fifo.py:build", "--run-dir", "afile"),
        "'fifo.py' is a FIFO, not a Python file",
        needs=("fifo.py", "afile"),
    ),
    Row(
        "config-unreadable",
        ("train", "--config", "unreadable.py", "--run-dir", "afile"),
        "cannot read config file 'unreadable.py': Permission denied",
        needs=("unreadable.py", "afile"),
    ),
    Row(
        "job-unreadable",
        ("train", "--job", "unreadable.py:build", "--run-dir", "afile"),
        "cannot read 'unreadable.py' (for --job unreadable.py:build): Permission denied",
        needs=("unreadable.py", "afile"),
    ),
    # -- ddpkit run ----------------------------------------------------------------------
    Row(
        "master-port-99999",
        ("run", *NODE_1, "--master-port", "99999", "s.py"),
        "--master-port must be a port number from 1 to 65535",
        needs=("s.py",),
    ),
    Row(
        "master-port-negative",
        ("run", *NODE_1, "--master-port", "-1", "s.py"),
        "--master-port must be",
        needs=("s.py",),
    ),
    Row("master-port-0", ("run", "--master-port", "0", "s.py"), "(got 0)", needs=("s.py",)),
    Row("master-port-65536", ("run", "--master-port", "65536", "s.py"), "65536", needs=("s.py",)),
    Row(
        "rdzv-timeout-negative",
        ("run", "--rdzv-timeout", "-5", "s.py"),
        "--rdzv-timeout must be a finite number of seconds >= 1",
        needs=("s.py",),
    ),
    Row(
        "rdzv-timeout-nan",
        ("run", *NODE_1, "--rdzv-timeout", "nan", "s.py"),
        "(got nan)",
        needs=("s.py",),
    ),
    Row("rdzv-timeout-inf", ("run", "--rdzv-timeout", "inf", "s.py"), "(got inf)", needs=("s.py",)),
    Row(
        "hang-timeout-nan",
        ("run", "--hang-timeout", "nan", "s.py"),
        "the hang timeout must be a finite number of seconds >= 0 (got nan): pass "
        "--hang-timeout 300, or hang_timeout=300 in Python",
        needs=("s.py",),
    ),
    Row(
        "profile-every-0",
        ("run", "--profile-every", "0", "s.py"),
        "--profile-every 0: the seconds between two verdicts must be a number more than 0",
        needs=("s.py",),
    ),
    Row(
        "baseline-several-nodes",
        ("run", "--baseline", *NODE_1, "s.py"),
        "--baseline runs the script on one rank of this machine first, which a job of 2 "
        "nodes cannot",
        needs=("s.py",),
    ),
    Row(
        "profile-every-inf",
        ("run", "--profile-every", "inf", "s.py"),
        "--profile-every inf: the seconds between two verdicts must be a number more than 0",
        needs=("s.py",),
    ),
    Row(
        "signal-grace-nan",
        ("train", "--signal-grace", "nan"),
        "the signal grace must be a number of seconds > 0 (got nan)",
    ),
    Row(
        "signal-grace-0",
        ("train", "--signal-grace", "0"),
        "pass --signal-grace 60, or signal_grace=60 in Python",
    ),
    # LaunchConfig checks these for `ddpkit train`, `ddpkit run` and launch(): both names.
    Row(
        "train-hang-timeout-negative",
        ("train", "--hang-timeout", "-1"),
        "the hang timeout must be a finite number of seconds >= 0 (got -1.0): pass "
        "--hang-timeout 300, or hang_timeout=300 in Python (0 turns it off)",
    ),
    Row(
        "train-hang-timeout-above-the-collective-timeout",
        ("train", "--hang-timeout", "3600"),
        "the hang timeout (3600 s) must not exceed the collective timeout (1800 s), when the "
        "collectives fail anyway: pass --hang-timeout 1800 or less, or in Python "
        "hang_timeout=1800 or less (or a larger timeout=)",
    ),
    Row("on-signal-maybe", ("train", "--on-signal", "maybe"), "one of save, stop"),
    Row("export-missing", ("export", "nope", "out.pt"), "nope does not exist"),
    Row("export-empty-folder", ("export", "adir", "out.pt"), "no checkpoint in", needs=("adir",)),
    Row("script-is-folder", ("run", "adir"), "'adir' is a folder", needs=("adir",)),
    Row("script-is-fifo", ("run", "fifo.py"), "is a FIFO", needs=("fifo.py",)),
    Row("run-nproc-100000", ("run", "--nproc", "100000", "s.py"), "more than 4 x", needs=("s.py",)),
    Row(
        "local-ranks-filter-5",
        ("run", "--nproc", "2", "--local-ranks-filter", "5", "s.py"),
        "--local-ranks-filter 5: there is no local rank 5 with --nproc 2 (local ranks 0 to 1): "
        "pass local ranks from 0 to 1, such as --local-ranks-filter 0",
        needs=("s.py",),
    ),
    Row(
        "local-ranks-filter-word",
        ("run", "--local-ranks-filter", "zero", "s.py"),
        "--local-ranks-filter 'zero' is not a comma list of local ranks: pass numbers, "
        "such as --local-ranks-filter 0 or 0,1",
        needs=("s.py",),
    ),
    Row(
        "local-ranks-filter-empty",
        ("run", "--local-ranks-filter", "", "s.py"),
        "--local-ranks-filter '' names no local rank",
        needs=("s.py",),
    ),
    Row(
        "log-dir-is-file",
        ("run", "--nproc", "1", "--log-dir", "afile", "s.py"),
        "log_dir 'afile' is a file, not a folder: pass --log-dir with a new or existing folder",
        needs=("s.py", "afile"),
    ),
    Row(
        "log-dir-under-file",
        ("run", "--nproc", "1", "--log-dir", "afile/logs", "s.py"),
        "log_dir 'afile/logs' cannot be made: 'afile' is a file",
        needs=("s.py", "afile"),
    ),
    Row(
        "log-dir-with-bad-filter",  # the folder is not made when another flag is wrong
        ("run", "--nproc", "2", "--log-dir", "newlogs", "--local-ranks-filter", "2", "s.py"),
        "there is no local rank 2",
        needs=("s.py",),
    ),
    Row(
        "script-unreadable",
        ("run", "--nproc", "1", "unreadable.py"),
        "script 'unreadable.py' cannot be read: Permission denied",
        needs=("unreadable.py",),
    ),
    # -- ddpkit export: reads regular files only (cli/export.py) -------------------------
    Row(
        "export-fifo",
        ("export", "fifo.py", "out.pt"),
        "is not a regular file",
        needs=("fifo.py",),
    ),
    Row(
        "export-dev-zero",
        ("export", "/dev/zero", "out.pt"),
        "is not a regular file",
        reads_device=True,
    ),
    # -- ddpkit check: one DDP000 finding per file it cannot check; the others are checked
    Row(
        "check-fifo",
        ("check", "fifo.py"),
        "not a regular file (a FIFO)",
        needs=("fifo.py",),
        stream="stdout",
    ),
    Row("check-dev-zero", ("check", "/dev/zero"), "not a regular file (a device)", stream="stdout"),
    Row(
        "check-too-large",
        ("check", "big.py", "ok.py"),
        "big.py:1:1: DDP000 too large",
        needs=("big.py", "ok.py"),
        stream="stdout",
        also="DDP110",
    ),
    Row(
        "check-100000-additions",
        ("check", "chain.py", "ok.py"),
        "chain.py:1:1: DDP000 nested too deeply",
        needs=("chain.py", "ok.py"),
        stream="stdout",
        also="DDP110",
    ),
    Row(
        "check-600-additions",
        ("check", "deep.py", "ok.py"),
        "deep.py:1:1: DDP000 nested too deeply",
        needs=("deep.py", "ok.py"),
        stream="stdout",
        also="DDP110",
    ),
    Row(
        "check-unreadable-folder",
        ("check", "locked", "ok.py"),
        "locked:1:1: DDP000 cannot read folder: Permission denied",
        needs=("locked", "ok.py"),
        stream="stdout",
        also="DDP110",
    ),
    Row(
        "check-in-unreadable-folder",
        ("check", "locked/a.py", "ok.py"),
        "locked/a.py:1:1: DDP000 cannot read file: Permission denied",
        needs=("locked", "ok.py"),
        stream="stdout",
        also="DDP110",
    ),
    Row(
        "check-missing",
        ("check", "missing.py"),
        "no such file or folder: missing.py",
        prefix="ddpkit check: error:",
    ),
    Row(
        "check-empty-path",
        ("check", ""),
        "an empty PATH ('') names no file or folder",
        prefix="ddpkit check: error:",
    ),
    Row(
        "check-select-empty",
        ("check", "--select", "", "ok.py"),
        "--select '' names no rule code",
        needs=("ok.py",),
        prefix="ddpkit check: error:",
    ),
    # -- ddpkit plot -----------------------------------------------------------------------
    Row(
        "plot-only-huge-values",
        ("plot", "huge", "--out", "out"),
        "nothing to plot",
        needs=("huge",),
    ),
    Row(
        "plot-huge-beside-normal",
        ("plot", "mixed", "--out", "out"),
        "",
        code=0,
        needs=("mixed",),
        creates=("out",),
    ),
    Row(
        "plot-text-and-bool-values",
        ("plot", "words", "--out", "out"),
        "",
        code=0,
        needs=("words",),
        warning="""(line 2 'accuracy': "high", line 2 'loss': true)""",
        creates=("out",),
    ),
    Row("plot-empty-file", ("plot", "empty"), "metrics.jsonl is empty", needs=("empty",)),
    Row(
        "plot-out-empty",
        ("plot", "mixed", "--out", ""),
        "--out '' names no folder",
        needs=("mixed",),
    ),
    Row("plot-run-dir-empty", ("plot", ""), "RUN_DIR '' names no folder"),
    Row(
        "plot-metrics-is-folder",
        ("plot", "dirrun"),
        "metrics.jsonl is not a regular file",
        needs=("dirrun",),
    ),
    # -- output that cannot be written -----------------------------------------------------
    Row(
        "info-to-dev-full",
        ("info",),
        "cannot write output: No space left on device",
        stdout_full=True,
    ),
    Row(
        "check-to-dev-full",
        ("check", "ok.py"),
        "cannot write output: No space left on device",
        needs=("ok.py",),
        stdout_full=True,
    ),
    # argparse itself prints --version and --help, and drops a failed write of them.
    Row("version-to-dev-full", ("--version",), "cannot write output", stdout_full=True),
    Row("help-to-dev-full", ("train", "--help"), "cannot write output", stdout_full=True),
    Row("check-help-to-dev-full", ("check", "--help"), "cannot write output", stdout_full=True),
]


def _listing(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*")}


@pytest.mark.parametrize(
    "row",
    [
        pytest.param(row, id=row.id, marks=[pytest.mark.skip(reason=row.pending)])
        if row.pending
        else pytest.param(row, id=row.id)
        for row in ROWS
    ],
)
def test_bad_input_is_one_line_and_leaves_nothing(tmp_path: Path, row: Row) -> None:
    if row.argv[0] == "plot":
        pytest.importorskip("matplotlib")
    if row.stdout_full and not Path("/dev/full").exists():
        pytest.skip("needs /dev/full")
    prefix: tuple[str, ...] = ()
    if any(name in UNREADABLE for name in row.needs):
        denied = _denied_reads()
        if denied is None:
            pytest.skip("a file of mode 0 stays readable here (root without setpriv)")
        prefix = denied
    work, tmp = tmp_path / "work", tmp_path / "tmp"
    work.mkdir()
    tmp.mkdir()
    try:
        for name in row.needs:
            MAKERS[name](work)
        before = _listing(work)
        proc = _run(row, prefix, work, tmp)
        created = _listing(work) - before
    finally:
        _readable_again(work)
    stdout, stderr = proc.stdout or "", proc.stderr
    assert proc.returncode == row.code, stderr
    assert "Traceback" not in stderr + stdout, stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    warnings = [line for line in lines if line.startswith("ddpkit: warning:")]
    if row.warning is not None:
        assert len(warnings) == 1 and row.warning in warnings[0], stderr
    else:
        assert not warnings, stderr
    errors = [line for line in lines if line not in warnings]
    if row.stream == "stdout":
        assert not errors, stderr
        assert len([line for line in stdout.splitlines() if row.message in line]) == 1, stdout
    elif row.code == 0:
        assert not errors, stderr
    else:
        assert len(errors) == 1, stderr
        assert errors[0].startswith(row.prefix) and row.message in errors[0], stderr
        assert stdout == "", stdout  # the error line is all it says
    if row.also is not None:
        assert row.also in stdout, stdout
    assert {p for p in created if p.split(os.sep)[0] not in row.creates} == set()
    assert all(any(p.startswith(c) for p in created) for c in row.creates), created
    assert _listing(tmp) == set()


def _run(
    row: Row, prefix: tuple[str, ...], work: Path, tmp: Path
) -> subprocess.CompletedProcess[str]:
    """`ddpkit ARGV` in `work` (after `prefix`, which denies reads of mode-0 files)."""
    # CPU only, so that --nproc is checked against the cores on every machine.
    env = {**os.environ, "TMPDIR": str(tmp), "CUDA_VISIBLE_DEVICES": ""}
    with open("/dev/full" if row.stdout_full else os.devnull, "w") as sink:
        return subprocess.run(
            [*prefix, sys.executable, "-m", "ddpkit", *row.argv],
            stdout=sink if row.stdout_full else subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,  # a hang fails the row
            cwd=work,
            env=env,
            preexec_fn=_limit_memory if row.reads_device else None,
        )

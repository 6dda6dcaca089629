"""The documentation site (mkdocs.yml, docs/) builds strictly and says what the code does.

The hand-written tables (exit statuses, `Job` and `FitResult` fields, callback hooks)
are checked against the code here, and the examples the pages share with the README
must be the README's, which tests/test_readme.py runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import re
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import pytest

from ddpkit import cli
from ddpkit.callbacks import Callback
from ddpkit.errors import ConfigError, HangError, Preempted, WorkerError
from ddpkit.job import Job
from ddpkit.trainer import FitResult
from tests.conftest import ROOT

DOCS = ROOT / "docs"


def _table(page: str, heading: str) -> list[list[str]]:
    """The rows (cells without their padding) of the first table after `heading`."""
    section = (DOCS / page).read_text().split(heading + "\n", 1)[1]
    rows = []
    for line in section.splitlines():
        if line.startswith("|"):
            rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
        elif rows:
            break
    assert len(rows) > 2, f"no table under {heading!r} in docs/{page}"
    return rows[2:]  # without the header and the |---| line


def _first_word(cell: str) -> str:
    """`on_epoch_end(trainer, epoch, metrics)` -> on_epoch_end; `` `eval` `` -> eval."""
    match = re.match(r"`(\w+)", cell)
    assert match, cell
    return match.group(1)


# -- exit statuses --------------------------------------------------------------------


def _status_of(exc: BaseException, monkeypatch: pytest.MonkeyPatch) -> int:
    """The exit status `ddpkit` gives when a command raises `exc`."""

    def command(args: argparse.Namespace) -> NoReturn:
        raise exc

    monkeypatch.delenv("DDPKIT_STATUS_DIR", raising=False)  # not a worker of `ddpkit run`
    return cli._run(argparse.Namespace(func=command))


def test_exit_status_table_matches_the_code(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = _table("cli.md", "## Exit status")
    documented = {int(row[0]) for row in rows if row[0].isdigit()}

    # What the code returns: `ddpkit`'s handler of each outcome, and SIGTERM's exit.
    with pytest.raises(SystemExit) as sigterm:
        cli._exit_on_signal(signal.SIGTERM, None)
    actual = {
        "success": 0,
        "a rank failed": _status_of(
            WorkerError(1, "rank 1 raised", exc_type="ValueError"), monkeypatch
        ),
        "bad input": _status_of(ConfigError("bad"), monkeypatch),
        "bad input found in a rank": _status_of(
            WorkerError(1, "bad", exc_type="ConfigError"), monkeypatch
        ),
        "preempted": _status_of(Preempted("ck/ckpt-000000001.pt", 1, signal.SIGTERM), monkeypatch),
        "hung": _status_of(HangError("hung", "stacks"), monkeypatch),
        "Ctrl-C": _status_of(KeyboardInterrupt(), monkeypatch),
        "SIGTERM": sigterm.value.code,
    }
    capsys.readouterr()
    assert actual == {
        "success": 0,
        "a rank failed": 1,
        "bad input": 2,
        "bad input found in a rank": 2,
        "preempted": 75,
        "hung": 124,
        "Ctrl-C": 130,
        "SIGTERM": 143,
    }
    assert documented == set(actual.values())

    # The constants the table names hold its numbers.
    named = 0
    for status, *_, constant in rows:
        if constant:
            module, _, name = constant.strip("`").rpartition(".")
            assert getattr(importlib.import_module(module), name) == int(status), constant
            named += 1
    assert named >= 3

    # `ddpkit run` passes on the signal that stopped its job as 128 + N.
    assert "128 + N" in [row[0] for row in rows]
    assert "return 128 + int(exc.sigval)" in (ROOT / "src/ddpkit/agent.py").read_text()


# -- the tables of docs/jobs.md ------------------------------------------------------


def test_job_table_lists_every_field() -> None:
    rows = _table("jobs.md", "## What a `Job` holds")
    assert [_first_word(r[0]) for r in rows] == [f.name for f in dataclasses.fields(Job)]


def test_fit_result_table_lists_every_field() -> None:
    rows = _table("jobs.md", "## What `fit()` returns: `FitResult`")
    assert [_first_word(r[0]) for r in rows] == [f.name for f in dataclasses.fields(FitResult)]


def test_callback_table_lists_every_hook_with_its_signature() -> None:
    rows = _table("jobs.md", "## Callbacks")
    documented: dict[str, str] = {}
    for row in rows:
        for call in re.findall(r"`(\w+)\(([^)]*)\)`", row[0]):
            documented[call[0]] = call[1]
    public: dict[str, Callable[..., Any]] = {
        name: fn for name, fn in vars(Callback).items() if callable(fn) and not name.startswith("_")
    }
    assert set(documented) == set(public)
    for name, fn in public.items():
        params = list(fn.__code__.co_varnames[1 : fn.__code__.co_argcount])  # without self
        assert documented[name] == ", ".join(params), name


# -- the examples the pages share with the README ---------------------------------------


def _fenced(text: str) -> list[tuple[str, str]]:
    return re.findall(r"^```(\w*)\n(.*?)^```$", text, re.S | re.M)


def test_examples_are_the_readmes() -> None:
    readme = {body for _, body in _fenced((ROOT / "README.md").read_text())}
    for page in sorted(DOCS.glob("*.md")):
        if page.name == "benchmarks.md":  # its commands are the benchmarks' own
            continue
        for lang, body in _fenced(page.read_text()):
            if "mkdocs build" in body or (page.name == "index.md" and lang == "sh"):
                continue  # the site's own command; the index's two-line summary
            assert body in readme, f"docs/{page.name}: a {lang} block that is not the README's"


# -- the build --------------------------------------------------------------------------


def test_the_site_builds_strictly(tmp_path: Path) -> None:
    """A broken link, cross-reference or docstring fails the build (as in .ci/run);
    the pages hold what the brief of each asks for."""
    site = tmp_path / "site"
    out = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr + "\n(pip install -e '.[docs]' installs mkdocs)"

    def text(page: str) -> str:
        return re.sub(r"<[^>]+>", " ", (site / page / "index.html").read_text())

    api = text("api")
    for expected in (
        "FitResult",
        "samples_per_s",
        "stopped_early",
        "on_epoch_end",
        "on_checkpoint",
        "A batch may be any nesting",  # the Trainer's batch contract
        "training_step",
        "Passes over the training data",  # TrainConfig's attribute docstrings
        "grad_compression",
        "signal_grace",  # launch's arguments
        "PREEMPTED_EXIT",
    ):
        assert expected in api, expected
    cli_page = text("cli")
    for expected in ("Exit status", "PREEMPTED_EXIT", "HANG_EXIT", "124", "143", "128 + N"):
        assert expected in cli_page, expected
    assert "on_epoch_end" in text("jobs") and "samples_per_s" in text("jobs")
    assert "Scaling efficiency" in text("benchmarks")
    assert (site / "bench-peers.png").is_file()

"""The documentation site (mkdocs.yml, docs/) builds strictly and says what the code does.

The hand-written tables (exit statuses, `Job` and `FitResult` fields, callback hooks,
the checker's rules) are checked against the code here; the options table is made from
`TrainConfig`'s fields (docs/options_table.py), and the API reference must hold every
public name. The pages' examples run in tests/test_readme.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import re
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any, NoReturn

import pytest

import ddpkit
from ddpkit import cli
from ddpkit.check.rules import RULES
from ddpkit.cli.run import AUDIT_STRICT_EXIT
from ddpkit.cli.verify import NOTHING_TRAINED_EXIT
from ddpkit.errors import ConfigError, HangError, Preempted, StoppedAtStart, WorkerError
from ddpkit.training.config import TrainConfig
from ddpkit.training.job import Job
from ddpkit.training.trainer import Callback, FitResult
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
        "stopped while starting": _status_of(StoppedAtStart(signal.SIGTERM), monkeypatch),
        "hung": _status_of(HangError("hung", "stacks"), monkeypatch),
        "Ctrl-C": _status_of(KeyboardInterrupt(), monkeypatch),
        "SIGTERM": sigterm.value.code,
        "a strict audit found pitfalls": AUDIT_STRICT_EXIT,
        "verify proved nothing": NOTHING_TRAINED_EXIT,
    }
    capsys.readouterr()
    assert actual == {
        "success": 0,
        "a rank failed": 1,
        "bad input": 2,
        "bad input found in a rank": 2,
        "preempted": 75,
        "stopped while starting": 75,
        "hung": 124,
        "Ctrl-C": 130,
        "SIGTERM": 143,
        "a strict audit found pitfalls": 3,
        "verify proved nothing": 4,
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
    assert "return 128 + int(exc.sigval)" in (ROOT / "src/ddpkit/processes/agent.py").read_text()


# -- the tables of docs/jobs.md ------------------------------------------------------


def test_job_section_names_every_field() -> None:
    section = (DOCS / "jobs.md").read_text().split("## What a `Job` holds\n")[1]
    named = re.findall(r"`(\w+)`", section.split("The Trainer's reference")[0])
    assert [n for n in named if n not in ("Job", "Trainer", "ctx", "config", "log_fn")] == [
        f.name for f in dataclasses.fields(Job)
    ]


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


# -- the checker's rules --------------------------------------------------------------


def test_rules_table_lists_every_rule_with_its_severity() -> None:
    rows = _table("check.md", "## Rules")
    assert [(row[0], row[1]) for row in rows] == [(r.code, r.severity) for r in RULES]


# -- the options table, made from TrainConfig ------------------------------------------


def _options_hook() -> ModuleType:
    """docs/options_table.py, the mkdocs hook that makes the options table."""
    spec = importlib.util.spec_from_file_location("options_table", DOCS / "options_table.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_options_table_is_made_from_every_field() -> None:
    hook = _options_hook()
    table: str = hook.options_table()
    names = [_first_word(line.split("|")[1].strip()) for line in table.splitlines()[2:]]
    assert names == [f.name for f in dataclasses.fields(TrainConfig)]
    docs = hook.field_docs()
    assert set(docs) == set(names)  # every field has its documentation under it
    assert docs["seed"].startswith("Seeds Python, NumPy and torch on every rank")
    assert '| `precision` | `--precision` | one of `"32"`, `"bf16"`, `"fp16"` |' in table


def test_the_committed_options_table_is_up_to_date() -> None:
    """docs/options.md holds a copy of the table for readers of the repository; the site
    makes it afresh."""
    hook = _options_hook()
    page = (DOCS / "options.md").read_text()
    assert hook.START in page and hook.END in page
    assert hook.with_table(page) == page, "the fields changed: run python docs/options_table.py"


# -- the API reference ---------------------------------------------------------------

# Names that are not in `import ddpkit` but are documented, with the module to import
# each from.
MORE_BUILDING_BLOCKS = {
    "FitResult": "ddpkit.training.trainer",
    "EarlyStopping": "ddpkit.training.trainer",
    "VerifyReport": "ddpkit.verification",
    "no_backward_sync": "ddpkit.parallel.sync",
    "Accumulation": "ddpkit.parallel.sync",
    "StepPlan": "ddpkit.parallel.steps",
    "MicroBatch": "ddpkit.parallel.steps",
    "SyncBatchNorm": "ddpkit.parallel.syncbn",
    "reduce_sums": "ddpkit.parallel.ranks",
    "model_digest": "ddpkit.checkpoint.digest",
    "rank_seed": "ddpkit.seed",
    "save_checkpoint": "ddpkit.checkpoint.pt",
    "load_checkpoint": "ddpkit.checkpoint.pt",
    "latest_checkpoint": "ddpkit.checkpoint.pt",
    "all_gather": "ddpkit.parallel.ranks",
    "all_gather_object": "ddpkit.parallel.ranks",
    "broadcast_object": "ddpkit.parallel.ranks",
    "ConfigError": "ddpkit.errors",
    "CheckpointError": "ddpkit.errors",
    "WorkerError": "ddpkit.errors",
    "HangError": "ddpkit.errors",
    "Preempted": "ddpkit.errors",
}


def _documented() -> list[str]:
    """The dotted paths that docs/api.md documents: `::: module.name`, and the members
    listed under a `::: module` entry."""
    paths: list[str] = []
    module = ""
    for line in (DOCS / "api.md").read_text().splitlines():
        if line.startswith("::: "):
            module = line[4:].strip()
            paths.append(module)
        elif re.fullmatch(r" +- \w+", line) and module:
            paths.append(f"{module}.{line.strip()[2:]}")
    return paths


def test_the_api_reference_documents_every_public_name() -> None:
    """The 24 names of `import ddpkit` as `::: ddpkit.NAME` (mkdocstrings follows the
    package's imports to the module that defines each, wherever it moves), then the
    other documented names by their modules."""
    documented = _documented()
    public = set(ddpkit._EXPORTS)
    assert len(public) == 24
    before_more = documented[: documented.index("ddpkit.training.trainer.FitResult")]
    for name in sorted(public):
        assert f"ddpkit.{name}" in before_more, f"docs/api.md: add ::: ddpkit.{name}"
    assert len(before_more) == len(public), "docs/api.md: only the 24 before the others"
    for name, module in MORE_BUILDING_BLOCKS.items():
        assert name not in public, f"{name} is in `import ddpkit`: document it with the 24"
        assert f"{module}.{name}" in documented, f"docs/api.md: add ::: {module}.{name}"
        assert hasattr(importlib.import_module(module), name), f"{module}.{name}"
    assert len(documented) == len(set(documented)), "a name documented twice"


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

    # The manual's pages, each with what it is for (the README links to them).
    for page, expected in {
        "port": "changed lines",
        "mapping": "accelerator.gather_for_metrics",
        "options": "Passes over the training data",  # the table, made by the hook
        "fsdp": "Build the optimizer after sharding",
        "preemption": "SLURM",
        "exact": "bit-identical",
        "verify": "likely cause",
        "run": "hang-timeout",
        "check": "DDP111",
        "architecture": "test_layout.py",
        "development": "mkdocs build --strict",
    }.items():
        assert expected in text(page), (page, expected)
    nav = (ROOT / "mkdocs.yml").read_text().split("\nnav:\n", 1)[1].split("\n\n", 1)[0]
    for md in sorted(DOCS.glob("*.md")):
        assert f" {md.name}\n" in nav, f"mkdocs.yml: {md.name} is not in the nav"
    # The hook's source is not published as a page.
    assert not (site / "options_table.py").exists()

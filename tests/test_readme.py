"""The examples of the README and of the documentation pages (docs/*.md) run as written.

The README is the quickstart and the pages are the manual; every fenced block of both is
accounted for here (but docs/benchmarks.md's, whose commands are the benchmarks' own). A
block that two pages share (the README's example is also the guide's) runs once.
- ```python blocks run as scripts, except those whose first line names a file
  (`# myjob.py`): those, like ```toml blocks that name one (`# job.toml`), are written
  under that name, and the commands that use them run beside them;
- ```sh blocks run command by command, as the page gives them (`ddpkit ...` as
  `python -m ddpkit ...` of this Python); the few parts that are not run say why in
  `_NOT_RUN`;
- ```console blocks run their `$ ` commands and compare what they print;
- ```diff is the port of the tutorial's script (docs/port.md), run by its own test below;
- untagged blocks are usage synopses and sample output, ```yaml is a pre-commit
  configuration for other repositories: nothing to run.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest

from tests.conftest import ROOT

DOCS = ROOT / "docs"
README = (ROOT / "README.md").read_text()
# The README, then the site's pages; benchmarks.md's commands are the benchmarks' own.
PAGES = [ROOT / "README.md", *(p for p in sorted(DOCS.glob("*.md")) if p.name != "benchmarks.md")]


@dataclass(frozen=True)
class Block:
    page: str  # relative to the repository: README.md, docs/cli.md
    lang: str
    body: str
    line: int  # where its opening fence is, 1-based

    @property
    def file_name(self) -> str | None:
        """The file the page asks to save this block as (`# myjob.py` on its first line)."""
        first = self.body.split("\n", 1)[0]
        match = re.fullmatch(r"# ([\w.-]+\.(?:py|toml))", first)
        return match.group(1) if match else None

    def __str__(self) -> str:
        return f"{self.page}:{self.line} ({self.lang or 'untagged'})"


def _blocks(page: Path) -> list[Block]:
    text = page.read_text()
    name = page.relative_to(ROOT).as_posix()
    return [
        Block(name, m.group(1), m.group(2), text.count("\n", 0, m.start()) + 1)
        for m in re.finditer(r"^```(\w*)\n(.*?)^```$", text, re.S | re.M)
    ]


def _once(blocks: list[Block]) -> list[Block]:
    """Each block at its first place: one the README shares with a page runs once."""
    seen: set[tuple[str, str]] = set()
    unique = []
    for block in blocks:
        if (block.lang, block.body) not in seen:
            seen.add((block.lang, block.body))
            unique.append(block)
    return unique


README_BLOCKS = _blocks(ROOT / "README.md")
ALL_BLOCKS = [block for page in PAGES for block in _blocks(page)]
BLOCKS = _once(ALL_BLOCKS)
SCRIPTS = [b for b in BLOCKS if b.lang == "python" and b.file_name is None]
FILES = {b.file_name: b.body for b in BLOCKS if b.lang in ("python", "toml") and b.file_name}
SHELL = [b for b in BLOCKS if b.lang == "sh"]
CONSOLE = [b for b in BLOCKS if b.lang == "console"]

# Parts of the pages' shell commands that the test does not run, and why. The test runs
# inside the virtual environment that these commands create, with ddpkit installed.
_NOT_RUN = {
    "python3 -m venv .venv": "makes the virtual environment that this test already runs in",
    ".venv/bin/pip install": "installs into it: CI runs the same install in .ci/run",
    ".venv/bin/python -m pytest": "the test suite itself: .ci/run runs it "
    "(test_ci_runs_the_readme_test_command checks that it is the README's command)",
    ".venv/bin/mkdocs build": "builds this site: tests/test_docs.py does, in "
    "test_the_site_builds_strictly",
}


def _commands(block: Block) -> list[list[str]]:
    """The commands of a shell block to run, as argument lists, in order."""
    commands = []
    for line in block.body.splitlines():
        for part in line.split("&&"):
            words = shlex.split(part, comments=True)
            if not words or any(part.strip().startswith(skip) for skip in _NOT_RUN):
                continue
            program = words[0].removeprefix(".venv/bin/")
            assert program == "ddpkit", f"{block}: add how to run (or why not) {part.strip()!r}"
            commands.append([sys.executable, "-m", "ddpkit", *words[1:]])
    return commands


def _run(command: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=300)


def _page(name: str) -> str:
    return (DOCS / name).read_text()


def test_the_pages_have_examples() -> None:
    assert len(SCRIPTS) >= 2
    assert {"myjob.py", "job.toml"} <= set(FILES)
    # The README's one example is among them: a hand-written loop with launch.
    (example,) = [b for b in README_BLOCKS if b.lang == "python"]
    assert "ddpkit.launch(" in example.body and "prepare_loader" in example.body


def test_every_block_is_one_the_tests_know() -> None:
    for block in ALL_BLOCKS:
        assert block.lang in ("python", "toml", "sh", "console", "diff", "yaml", ""), block
        if block.lang == "toml":
            assert block.file_name, f"{block}: start it with the file's name, # NAME.toml"


def test_the_readme_is_a_quickstart() -> None:
    """At most 200 lines: what ddpkit is, its two commands, one example, the Fabric and
    Accelerate table, and links to the manual for everything else."""
    assert len(README.splitlines()) <= 200
    assert [b.lang for b in README_BLOCKS] == ["sh", "sh", "python"]
    for page in ("port", "mapping", "cli", "check", "verify", "fsdp", "preemption", "api"):
        assert f"](docs/{page}.md)" in README, page


def test_ci_runs_the_readme_test_command() -> None:
    """The README's two commands: the first installs and trains, the second (the tests)
    is the one .ci/run runs; the pages that repeat them repeat them exactly."""
    install, tests = README_BLOCKS[0], README_BLOCKS[1]
    assert install.body.rstrip().endswith(".venv/bin/ddpkit train"), install.body
    command = tests.body.strip()
    assert command.endswith('-m pytest -m "not slow"'), command
    assert command in (ROOT / ".ci" / "run").read_text().splitlines()
    # The venv and the constraints of the install are those of the tests.
    assert install.body.startswith("python3 -m venv .venv && .venv/bin/pip install ")
    assert "-c constraints.txt -e " in install.body
    copies = [b for b in ALL_BLOCKS if b.page != "README.md" and "pip install" in b.body]
    assert copies
    for block in copies:
        assert block.body in (install.body, tests.body), f"{block}: not the README's command"


def test_the_mapping_table_is_the_readmes() -> None:
    """The Fabric/Accelerate table is in the README and on the site, the same."""

    def table(text: str) -> str:
        match = re.search(r"^\| Fabric \| Accelerate \| ddpkit \|\n(?:\|.*\n)+", text, re.M)
        assert match, "no Fabric/Accelerate table"
        return match.group(0)

    readme, site = table(README), table(_page("mapping.md"))
    assert readme == site
    assert readme.count("\n") >= 15


def test_the_guide_says_how_to_get_a_torchvision_that_matches_torch() -> None:
    # PyPI's torchvision is built for PyPI's torch: beside the CPU build of torch that
    # constraints.txt pins, it fails on import (`operator torchvision::nms does not
    # exist`). The guide names the symptom and where a matching build comes from.
    guide = " ".join(_page("guide.md").split())
    assert "torchvision::nms does not exist" in guide
    assert "--index-url https://download.pytorch.org/whl/cpu" in guide


def test_the_table_says_what_the_reductions_return() -> None:
    # Fabric's all_reduce and Accelerate's reduce return tensors; ddpkit's return Python
    # floats (`.item()` on one fails): the table says so, and it is true.
    import torch

    import ddpkit

    rows = [row for row in README.splitlines() if "ddpkit.reduce_sum(" in row]
    assert len(rows) == 1 and "a Python float" in rows[0], rows
    assert "all_reduce" in rows[0] and "accelerator.reduce" in rows[0]
    assert type(ddpkit.reduce_sum(torch.tensor(2.0))) is float
    assert type(ddpkit.reduce_mean(torch.tensor(2.0))) is float


def test_checkpoint_names_are_as_written() -> None:
    """Checkpoints are `ckpt-000000069.pt` (the step, 9 digits): no `ckpt-<step>.pt`."""
    for page in PAGES:
        text = page.read_text()
        assert "ckpt-<" not in text, page.name
        for name in re.findall(r"ckpt-\d+\.(?:pt|dcp)", text):
            assert re.fullmatch(r"ckpt-\d{9}\.(?:pt|dcp)", name), (page.name, name)


def test_relative_links_exist() -> None:
    """The README's links (the site's own are checked by `mkdocs build --strict`)."""
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)\s]*)?\)", README)
    assert len(targets) >= 10
    for target in targets:
        if "://" not in target:
            assert (ROOT / target).exists(), target


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(SCRIPTS)))
def test_example_runs(index: int, tmp_path: Path) -> None:
    script = tmp_path / "example.py"
    script.write_text(SCRIPTS[index].body)
    out = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=240
    )
    assert out.returncode == 0, f"{SCRIPTS[index]}\n{out.stderr}"
    assert out.stdout.strip()


def _check_resume_gives_the_same_model(results: list[dict[str, object]], cwd: Path) -> None:
    # "digest A" twice (the runs with --json): the resumed run ends with the
    # uninterrupted run's model.
    straight, resumed = results
    assert straight["model_digest"] == resumed["model_digest"]
    assert straight["global_step"] == resumed["global_step"]


def _check_two_runs_and_their_plots(results: list[dict[str, object]], cwd: Path) -> None:
    for run in ("bf16", "fp32"):
        assert (cwd / "runs" / run / "metrics.jsonl").is_file()
        names = [p.name for p in (cwd / "runs" / run / "ckpt").glob("ckpt-*")]
        assert names and all(re.fullmatch(r"ckpt-\d{9}\.pt", n) for n in names), names
    config = json.loads((cwd / "runs" / "bf16" / "config.json").read_text())
    assert config["precision"] == "bf16" and config["accumulate"] == 4  # from job.toml
    assert json.loads((cwd / "runs" / "fp32" / "config.json").read_text())["precision"] == "32"
    assert (cwd / "plots" / "loss.png").is_file()


# What each shell block's commands must have done, beyond exiting 0; keyed by a line
# of the block, and the page the block is on. A block without an entry only has to run.
_CHECKS = {
    "--resume --json": ("docs/cli.md", _check_resume_gives_the_same_model),
    "ddpkit plot runs/bf16 runs/fp32": ("docs/jobs.md", _check_two_runs_and_their_plots),
}


def test_each_checked_block_is_where_its_check_says() -> None:
    for key, (page, _) in _CHECKS.items():
        assert [b.page for b in SHELL if key in b.body] == [page], key


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(SHELL)))
def test_shell_block_runs(index: int, tmp_path: Path) -> None:
    """Run the block's commands in order in an empty folder that holds the files the
    pages name (myjob.py, job.toml), as a reader who saved them would."""
    block = SHELL[index]
    for name, text in FILES.items():
        (tmp_path / name).write_text(text)
    commands = _commands(block)
    if not commands:
        pytest.skip(f"{block}: nothing to run here: " + "; ".join(_NOT_RUN.values()))
    results: list[dict[str, object]] = []
    for command in commands:
        out = _run(command, tmp_path)
        assert out.returncode == 0, f"{block}: {shlex.join(command[2:])}\n{out.stderr}"
        if "--json" in command:
            results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    for key, (_, check) in _CHECKS.items():
        if key in block.body:
            check(results, tmp_path)


def _label(line: str) -> str:
    """What a line of sample output says, without its numbers: `PASS  equivalence`,
    `largest difference`, `likely cause: BatchNorm not synchronised`."""
    head, _, rest = line.strip().partition(":")
    return head if head != "likely cause" else f"{head}:{rest.split(':')[0]}"


def test_the_console_blocks_are_verifys() -> None:
    assert [b.page for b in CONSOLE] == ["docs/verify.md"]


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(CONSOLE)))
def test_console_block_prints_what_it_shows(index: int, tmp_path: Path) -> None:
    """Each `$ ` command runs and prints what the page shows: its first line as
    written, then lines that say the same things (the digits of a float64 difference
    depend on the torch build, so they are not compared)."""
    sessions: list[tuple[str, list[str]]] = []
    for line in CONSOLE[index].body.splitlines():
        if line.startswith("$ "):
            sessions.append((line[2:], []))
        else:
            sessions[-1][1].append(line)
    assert sessions
    for command, shown in sessions:
        words = shlex.split(command)
        assert words[0] == "ddpkit", command
        out = _run([sys.executable, "-m", "ddpkit", *words[1:]], tmp_path)
        printed = out.stdout.strip().splitlines()
        assert out.returncode == (0 if shown[0].startswith("PASS") else 1), out.stderr
        assert printed[0] == shown[0]
        assert [_label(line) for line in printed[1:]] == [_label(line) for line in shown[1:]]


def _port_diff() -> ModuleType:
    # bench/port_diff.py reads docs/port.md's diff and applies it; bench/ is a folder of
    # scripts, not a package.
    spec = importlib.util.spec_from_file_location("port_diff", ROOT / "bench" / "port_diff.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["port_diff"] = module
    spec.loader.exec_module(module)
    return module


PORT = _port_diff()
# Written here in the shape of the DDP tutorial's single_gpu.py and datautils.py, with
# the tutorial's lines where docs/port.md's diff changes it (the real file is pinned on
# the page; bench/real.py --port applies the diff to it).
TUTORIAL_SHAPE = ROOT / "tests" / "real_shapes"


def port_versions(into: Path | None = None) -> tuple[str, str, int]:
    """(the one-GPU script, its ddpkit version, lines changed): docs/port.md's diff
    applied to the script shaped like the tutorial's. With `into`, both are written
    there (single_gpu.py, ported.py) beside the datautils.py they import."""
    diff = PORT.diff_block()
    old = (TUTORIAL_SHAPE / "single_gpu.py").read_text()
    new = PORT.apply(diff, old)  # ValueError: a hunk that does not apply
    if into is not None:
        (into / "single_gpu.py").write_text(old)
        (into / "ported.py").write_text(new)
        (into / "datautils.py").write_text((TUTORIAL_SHAPE / "datautils.py").read_text())
    return old, new, PORT.changed_lines(diff)


def test_the_port_says_how_many_lines_change() -> None:
    _, new, changed = port_versions()
    compile(new, "ported.py", "exec")
    assert [b.page for b in BLOCKS if b.lang == "diff"] == ["docs/port.md"]
    assert changed <= 15 and f"with {changed} changed lines" in _page("port.md")
    assert f"with {changed} changed lines" in README
    assert f"with {changed} changed lines" in _page("index.md")


def test_the_port_is_the_pinned_tutorial_file_in_hunks() -> None:
    """The diff is against the real file, pinned on the page (the one bench/real's list
    runs), and shows only what changes: hunks with one or two lines of context, in the
    order of the file, whose headers give the real file's lines."""
    repo, commit, path = PORT.pinned()
    assert (repo, path) == ("pytorch/examples", "distributed/ddp-tutorial-series/single_gpu.py")
    (entry,) = [
        s
        for s in json.loads((ROOT / "bench" / "real" / "real.json").read_text())["scripts"]
        if s["id"] == "tutorial-single_gpu"
    ]
    assert (entry["repo"], entry["commit"], entry["path"]) == (repo, commit, path)
    hunks = PORT.parse(PORT.diff_block())
    assert len(hunks) >= 5
    assert [h.old_start for h in hunks] == sorted({h.old_start for h in hunks})
    for hunk in hunks:
        marks = "".join(mark for mark, _ in hunk.lines)
        lead, trail = len(marks) - len(marks.lstrip(" ")), len(marks) - len(marks.rstrip(" "))
        at_the_end = hunk is hunks[-1]  # the file's last lines: nothing after them
        assert 1 <= lead <= 2 and (1 if not at_the_end else 0) <= trail <= 2, marks
    # What the port keeps of the tutorial: its one-batch peek before set_epoch, its
    # unseeded MyTrainDataset (seeded by the port), its argparse __main__ block.
    _, new, _ = port_versions()
    peek = new.index("b_sz = len(next(iter(self.train_data))[0])")
    assert peek < new.index("self.train_data.set_epoch(epoch)")
    assert new.index("ddpkit.seed_everything(0)") < new.index("MyTrainDataset(2048)")
    assert "F.mse_loss(" in new and "cross_entropy" not in new
    assert "ddpkit.launch(main, args.total_epochs" in new and "parse_args()" in new


@pytest.mark.slow
def test_the_one_gpu_script_and_its_port_run(tmp_path: Path) -> None:
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("launch starts a rank per core: this test needs 2 cores")
    port_versions(tmp_path)
    # The one-GPU script as it is, on the CPU (the tutorial passes 0, cuda:0).
    one = subprocess.run(
        [sys.executable, "-c", "import single_gpu; single_gpu.main('cpu', 2, 1, 32)"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert one.returncode == 0, one.stderr
    assert "[GPUcpu] Epoch 1 | Batchsize: 32 | Steps: 64" in one.stdout, one.stdout
    assert (tmp_path / "checkpoint.pt").is_file()
    # The port as the page runs it, `python single_gpu.py 2 1`: launch starts a rank per
    # core, here 2.
    out = subprocess.run(
        [sys.executable, "ported.py", "2", "1"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
        preexec_fn=lambda: os.sched_setaffinity(0, cores[:2]),
    )
    assert out.returncode == 0, out.stderr
    # Each rank its half of the 2048 samples; the save printed once (rank 0) and written
    # where it says.
    for epoch in (0, 1):
        line = f"[GPUcpu] Epoch {epoch} | Batchsize: 32 | Steps: 32"
        assert out.stdout.count(line) == 2, out.stdout
    assert out.stdout.count("Training checkpoint saved at") == 2, out.stdout
    assert "saved at checkpoints/ckpt-000000001.pt" in out.stdout
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "ckpt-000000000.pt",
        "ckpt-000000001.pt",
    ]


# Each case the hang section of docs/run.md names, and the tests that show it on real
# processes.
HANG_CASES = {
    # stopped
    "the ranks wait in different": [
        "test_hangs.py::test_a_true_hang_is_stopped_within_the_hang_timeout",
        "test_run.py::test_a_collective_under_a_rank_check_is_diagnosed_as_a_hang",
    ],
    "a rank has finished or exited while others wait": [
        "test_hangs.py::test_a_rank_that_returns_while_another_waits_is_named_as_a_hang",
        "test_hangs.py::test_a_rank_that_never_finishes_after_another_returned_is_stopped",
        "test_run.py::test_a_rank_that_exits_0_while_another_waits_is_named",
        "test_run.py::test_a_rank_that_ended_its_script_is_described_as_finished",
    ],
    "a deadlocked lock": [
        "test_hang_watch.py::test_a_hang_is_stopped_while_idle_dataloader_workers_live"
    ],
    "`time.sleep(600)`": [
        "test_hangs.py::test_a_call_that_blocks_without_cpu_longer_than_the_hang_timeout_is_stopped",
        "test_hangs.py::test_a_true_hang_is_stopped_within_the_hang_timeout",
    ],
    "stops the job within a few seconds": [
        "test_run.py::test_a_hang_in_a_script_that_saves_on_signals_is_stopped_as_quickly"
    ],
    # never stopped
    "rank 0 going on alone after `launch` under `ddpkit run`": [
        "test_hang_judge.py::test_rank_0_alone_after_launch_released_the_others_is_never_a_hang"
    ],
    "in a thread that the main thread `join()`s": [
        "test_hang_watch.py::test_work_in_a_thread_that_the_main_thread_joins_is_not_stopped",
        "test_hang_watch.py::test_cpu_of_any_thread_is_work_but_not_the_watchs_own",
    ],
    "a big\n    matmul": ["test_hangs.py::test_a_long_computation_in_rank_zero_first_completes"],
    "whose child uses the CPU": [
        "test_hang_watch.py::test_a_busy_child_is_work_and_an_idle_one_is_only_uncertain",
        "test_hang_watch.py::test_a_childs_cpu_is_work_and_its_mere_existence_is_not",
    ],
    "a download": ["test_hang_watch.py::test_reading_data_is_work_even_without_cpu"],
    # uncertain
    "a rank that polls": [
        "test_hangs.py::test_a_polling_rank_gets_notices_then_stops_at_the_collective_timeout"
    ],
    "for a child that uses no CPU": [
        "test_hang_judge.py::test_a_rank_waiting_for_an_idle_child_is_uncertain_and_said_so"
    ],
    "holds Python's lock": [
        "test_hangs.py::test_one_long_call_that_holds_the_gil_is_never_stopped"
    ],
}


def test_every_case_of_the_hang_section_has_its_tests() -> None:
    page = _page("run.md")
    section = page[page.index("- **hangs**: every worker reports") :]
    section = section[: section.index("With several machines")]
    for words, tests in HANG_CASES.items():
        assert words in section, f"docs/run.md no longer says {words!r}: update HANG_CASES"
        for test in tests:
            path, name = test.split("::")
            assert f"def {name}(" in (ROOT / "tests" / path).read_text(), test


def test_check_is_silent_on_the_readmes_code_and_the_ported_tutorial(tmp_path: Path) -> None:
    from ddpkit.check import check_paths

    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert blocks
    for i, block in enumerate(blocks):
        (tmp_path / f"readme_{i}.py").write_text(block)
    port_versions(into=tmp_path)  # the port of docs/port.md, beside its datautils.py
    (tmp_path / "single_gpu.py").unlink()  # the one-GPU original is not a DDP program
    report = check_paths([tmp_path])
    assert report.files_checked == len(blocks) + 2  # the port and its datautils.py
    assert report.findings == [], [f"{f.path}:{f.line} {f.code}" for f in report.findings]

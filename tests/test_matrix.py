"""The combinations matrix (issue 26: bugs live between features, so test the pairs).

Every strategy (one process, ddp on 2 ranks, fsdp on 2 ranks) is crossed with every
feature of `tests/matrix_jobs.py` (run log with progress, uneven eval batches,
accumulation, uneven map-style shards (alone and with accumulation), uneven
IterableDataset shards, dict batches, bf16, clipping, save_every_steps, BatchNorm
without sync, loader workers with augmentation, and the hand-written loop with ddpkit's
helpers). On every cell, ddpkit's correctness contract:

- no hang: each run is stopped by launch's hang watch (`HANG_TIMEOUT`) or, for one
  process, by the child process's deadline, and the whole cell by pytest-timeout;
- the ranks end bit-identical: parameters, buffers, optimizer and scheduler state;
- a run stopped mid-epoch (a checkpoint after the last step but one of the second
  epoch) and resumed in a fresh launch ends bit-identical to the straight run, on
  every rank, random streams included;
- `ddpkit verify` passes, on the cells it can check (see `VERIFIED`).

Then a run resumed on another number of ranks (2 -> 1, 1 -> 2) must train every sample
of the interrupted epoch exactly once.

A cell that ddpkit refuses by design (one ConfigError line before training) is held
when the refusal says why: `REFUSED` lists them, for the README.

Cost on 2 idle cores: without the slow ones (`FAST`: the ddp column and its resume
2 -> 1; 15 tests) about 10 s after the server's start, about 0.5 s a cell; a hang costs
up to `HANG_TIMEOUT` or `COLLECTIVE_TIMEOUT`.

Every run happens in a child forked from a fresh server process (`in_child`, the
forkserver start with torch preloaded), never from the test process itself: other tests
run one-process launches in the test process, which leave torch's thread pool and gloo's
threads behind there, and a child forked from it could hang on them (it did: in
`destroy_group`, after a one-process test of test_state.py had run first).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import traceback
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import ddpkit
from ddpkit.parallel.fsdp import cpu_supported
from tests import matrix_jobs as mj
from tests.matrix_jobs import FEATURES, STRATEGIES

# (strategy, feature) -> why ddpkit refuses the combination before training: the start
# of its ConfigError, a regular expression. A refused cell passes when the run stops
# with it. None today: every cell is meant to train.
REFUSED: dict[tuple[str, str], str] = {}

HANG_TIMEOUT = 10  # launch's hang watch: a certain hang is stopped after this
COLLECTIVE_TIMEOUT = 20  # a collective that waits longer fails
RUN_DEADLINE = 40  # one launch, in its child process, before it is killed (a cell has 2)
FSDP_SKIP = pytest.mark.skipif(
    not cpu_supported(), reason="FSDP2 on CPU ranks needs torch >= 2.7 (CPU stream events)"
)

# The cells that run without `-m slow`: the ddp column (2 ranks, where most jobs run).
# The one-process and fsdp columns, the other resumes on another number of ranks and
# every `ddpkit verify` are slow.
FAST = {("ddp", feature) for feature in FEATURES}


# -- running in a child process -----------------------------------------------------------
# What every rank imports on its way (DDP imports torch._dynamo: 2 s; FSDP and its
# checkpoints), imported once in the server, so that children and their forked ranks
# find it loaded. Imports start no thread, so `launch` still forks there.
_CONTEXT = multiprocessing.get_context("forkserver")
_CONTEXT.set_forkserver_preload(
    [
        "torch",
        "torch._dynamo",
        "torch.distributed.fsdp",
        "torch.distributed.checkpoint",
        "ddpkit",
        "tests.matrix_jobs",
        "tests.test_matrix",
    ]
)


class RunFailed(Exception):
    """A run raised (or hung) in its child process: the type and message of its error."""


def _child(conn: Any, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    try:
        conn.send(("ok", fn(*args)))
    except BaseException as exc:  # everything goes back to the test, as text
        text = f"{type(exc).__name__}: {exc}"
        if not isinstance(exc, ddpkit.DdpkitError):
            text += "\n" + "".join(traceback.format_exception(exc))
        conn.send(("error", text))
    finally:
        conn.close()
        os._exit(0)  # no pytest exit hooks in the child


def in_child(fn: Callable[..., Any], *args: Any, deadline: float = RUN_DEADLINE) -> Any:
    """`fn(*args)` in a child forked from the server; its result, or RunFailed with its
    error; RunFailed too if it has not answered within `deadline` seconds (it is then
    killed, and launch's workers die with it)."""
    receive, send = _CONTEXT.Pipe(duplex=False)
    child = _CONTEXT.Process(target=_child, args=(send, fn, args))
    child.start()
    send.close()
    try:
        if not receive.poll(deadline):
            raise RunFailed(f"no answer within {deadline} s: a hang")
        try:
            status, value = receive.recv()
        except EOFError:
            raise RunFailed(f"the child died (exit code {child.exitcode})") from None
        if status != "ok":
            raise RunFailed(value)
        return value
    finally:
        if child.is_alive():
            child.kill()
        child.join(5)
        receive.close()


def _launch(nprocs: int, strategy: str, feature: str, phase: str, folder: str) -> Any:
    return ddpkit.launch(
        mj.run_cell,
        strategy,
        feature,
        phase,
        folder,
        nprocs=nprocs,
        backend="gloo",
        timeout=COLLECTIVE_TIMEOUT,
        hang_timeout=HANG_TIMEOUT,
    )


def run(strategy: str, feature: str, phase: str, folder: Path, nprocs: int) -> dict[str, Any]:
    """One phase of a cell on `nprocs` ranks (see `matrix_jobs.run_cell`)."""
    result: dict[str, Any] = in_child(_launch, nprocs, strategy, feature, phase, str(folder))
    return result


def mid_epoch_checkpoint(straight: dict[str, Any]) -> str:
    """The last checkpoint the straight run wrote inside its second epoch."""
    inside = [path for _, epoch, batch, path in straight["checkpoints"] if epoch == 1 and batch]
    assert inside, f"no checkpoint inside the second epoch: {straight['checkpoints']}"
    return str(inside[-1])


def _cells() -> list[Any]:
    cells = []
    for strategy in STRATEGIES:
        for feature in FEATURES:
            marks = [] if (strategy, feature) in FAST else [pytest.mark.slow]
            if strategy == "fsdp":
                marks.append(FSDP_SKIP)
            cells.append(pytest.param(strategy, feature, marks=marks, id=f"{strategy}-{feature}"))
    return cells


# -- the matrix ----------------------------------------------------------------------------
@pytest.mark.timeout(90)
@pytest.mark.parametrize(("strategy", "feature"), _cells())
def test_cell(strategy: str, feature: str, tmp_path: Path) -> None:
    """Straight run: no hang, ranks identical. Resumed from mid-epoch in a fresh launch:
    ranks identical, and every rank bit-identical to the straight run."""
    nprocs = STRATEGIES[strategy][0]
    refused = REFUSED.get((strategy, feature))
    if refused is not None:
        with pytest.raises(RunFailed, match=rf"ConfigError: {refused}"):
            run(strategy, feature, "straight", tmp_path, nprocs)
        return
    straight = run(strategy, feature, "straight", tmp_path, nprocs)
    problems = [f"ranks differ after the straight run: {d}" for d in straight["diffs"]["ranks"]]
    if feature == "eval_uneven":
        seen = straight["eval"].get("eval_samples")
        if seen != mj.EVAL_SAMPLES:
            problems.append(f"evaluation counted {seen} samples, not {mj.EVAL_SAMPLES}")
    if feature == "run_log":
        lines = (tmp_path / "run-straight" / "metrics.jsonl").read_text().splitlines()
        steps = sum(json.loads(line)["kind"] == "step" for line in lines)
        if steps != straight["global_step"]:
            problems.append(
                f"{steps} step lines in metrics.jsonl for {straight['global_step']} steps"
            )
    mj.copy_checkpoint(mid_epoch_checkpoint(straight), tmp_path / "ckpt-resume")
    resumed = run(strategy, feature, "resume", tmp_path, nprocs)
    problems += [f"ranks differ after the resumed run: {d}" for d in resumed["diffs"]["ranks"]]
    problems += [f"resumed != straight: {d}" for d in resumed["diffs"]["resume"]]
    if resumed["global_step"] != straight["global_step"]:
        problems.append(
            f"resumed ended at step {resumed['global_step']}, not {straight['global_step']}"
        )
    assert not problems, "\n".join(problems)


# -- resuming on another number of ranks ---------------------------------------------------
@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("strategy", "before", "after"),
    [
        pytest.param("ddp", 2, 1, id="ddp-2to1"),
        pytest.param("ddp", 1, 2, marks=pytest.mark.slow, id="ddp-1to2"),
        pytest.param("fsdp", 2, 1, marks=[pytest.mark.slow, FSDP_SKIP], id="fsdp-2to1"),
        pytest.param("fsdp", 1, 2, marks=[pytest.mark.slow, FSDP_SKIP], id="fsdp-1to2"),
    ],
)
def test_resume_on_another_world_size(
    strategy: str, before: int, after: int, tmp_path: Path
) -> None:
    """Stopped inside the second epoch on `before` ranks, resumed on `after`: over that
    epoch every sample is trained exactly once (the job records, per rank and step, the
    indices it trained), and the resumed ranks end identical."""
    straight = run(strategy, "indexed", "straight", tmp_path, before)
    cut = mid_epoch_checkpoint(straight)
    cut_step = next(step for step, _, _, path in straight["checkpoints"] if path == cut)
    mj.copy_checkpoint(cut, tmp_path / "ckpt-resume")
    resumed = run(strategy, "indexed", "resume", tmp_path, after)

    def trained(phase: str, ranks: int, epoch: int, before_step: float) -> Counter[int]:
        seen: Counter[int] = Counter()
        for r in range(ranks):
            records = json.loads((tmp_path / f"{phase}-indices-rank{r}.json").read_text())
            for e, steps_done, indices in records:
                if e == epoch and steps_done < before_step:
                    seen.update(indices)
        return seen

    every = Counter(range(mj.SAMPLES))
    # The recording itself: the uninterrupted first epoch trained each sample once.
    assert trained("straight", before, 0, float("inf")) == every
    second = trained("straight", before, 1, cut_step) + trained("resume", after, 1, float("inf"))
    twice = sorted(i for i, n in second.items() if n > 1)
    never = sorted(set(every) - set(second))
    assert not twice and not never, (
        f"the second epoch, cut after step {cut_step} on {before} rank(s) and resumed on "
        f"{after}, trained {len(twice)} sample(s) more than once {twice} and never trained "
        f"{len(never)} {never}"
    )
    assert resumed["diffs"]["ranks"] == []


# -- ddpkit verify ---------------------------------------------------------------------------
# The features whose job `ddpkit verify` checks, and which checks. Not the others: verify
# turns the run folder, evaluation and checkpoints off (run_log, eval_uneven and
# save_every_steps would verify the plain job again), refuses shards of unequal length
# and IterableDatasets (it replays recorded indices), and runs a Trainer job (not the hand
# loop) on 2 ranks or more (not one process). Unsynchronised BatchNorm is what the
# equivalence check exists to report, so that job gets the resume check alone.
VERIFIED: dict[str, tuple[bool, ...]] = {
    "accumulate": (False, True),
    "dict_batches": (False, True),
    "bf16": (False, True),  # the equivalence check compares at precision 32 (its note)
    "clip": (False, True),
    "workers_augment": (False, True),
    "batchnorm_nosync": (True,),
}


@pytest.mark.slow
@pytest.mark.timeout(75)
@pytest.mark.parametrize(
    ("strategy", "feature", "resume"),
    [
        pytest.param(
            strategy,
            feature,
            resume,
            marks=[FSDP_SKIP] if strategy == "fsdp" else [],
            id=f"{strategy}-{feature}-{'resume' if resume else 'equivalence'}",
        )
        for strategy in ("ddp", "fsdp")
        for feature, checks in VERIFIED.items()
        for resume in checks
    ],
)
def test_verify_passes(strategy: str, feature: str, resume: bool) -> None:
    passed, report = in_child(mj.verify_cell, strategy, feature, resume, deadline=60)
    assert passed, report


def test_refused_cells_are_cells() -> None:
    assert set(REFUSED) <= {(s, f) for s in STRATEGIES for f in FEATURES}

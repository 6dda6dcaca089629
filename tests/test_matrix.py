"""The combinations matrix (issue 26: bugs live between features, so test the pairs;
issue 43: the features added since join it as columns).

Every strategy (one process, ddp on 2 ranks, fsdp on 2 ranks) is crossed with every
feature of `tests/matrix_jobs.py` (run log with progress, uneven eval batches,
accumulation, uneven map-style shards (alone and with accumulation), uneven
IterableDataset shards, dict batches, bf16, clipping, save_every_steps, BatchNorm
without sync, loader workers with augmentation, the hand-written loop with ddpkit's
helpers, training by steps (with replacement; over an endless stream), keep_best, early
stopping, a user callback with state, a DistributedSampler subclass, a script's
RandomSampler(num_samples, replacement), tuple and dict targets, a metrics_fn,
ReduceLROnPlateau). On every cell, ddpkit's correctness contract:

- no hang: each run is stopped by launch's hang watch (`HANG_TIMEOUT`) or, for one
  process, by the child process's deadline, and the whole cell by pytest-timeout;
- the ranks end bit-identical: parameters, buffers, optimizer and scheduler state;
- an epoch trains each sample once (or, drawn with replacement, as many draws as asked);
  an evaluation counts each eval sample once;
- a run stopped right after a mid-epoch checkpoint (its folder as it was then: that
  checkpoint, best.pt, the run log so far) and resumed in a fresh launch ends
  bit-identical to the straight run, on every rank, random streams included, with the
  same best.pt, run log (metrics.jsonl, less its timings), callback state and early stop;
- `ddpkit verify` passes, on the cells it can check (see `VERIFIED`).

Then `test_resume_elsewhere`: a run resumed with another batch size, and on another
number of ranks (2 -> 1, 1 -> 2, and with a new batch size), trains every sample of the
interrupted epoch exactly as often as the straight run; data in an order of its own is
refused in one line instead, where it cannot be shared out again.

A cell that ddpkit refuses by design (one ConfigError line before the first optimizer
step) is held when the refusal says why: `REFUSED` lists them, for the README. A cell
that fails only because of a known defect is `KNOWN_DEFECTS`' xfail(strict=True), so it
turns red when the fix lands and its line must go. A feature that lands later joins the
matrix in the same commit: a column here, with these checks (resume on the same and on
other batch sizes and ranks, preemption under `ddpkit run` in test_matrix_run.py).

Cost on 2 idle cores: without the slow ones (`FAST`: the ddp column and its resume
2 -> 1; about 30 tests) about 30 s after the server's start, about 1 s a cell; a hang
costs up to `HANG_TIMEOUT` or `COLLECTIVE_TIMEOUT`.

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
from ddpkit.inrank.breakdown import PARTS
from ddpkit.parallel.fsdp import cpu_supported
from tests import matrix_jobs as mj
from tests.matrix_jobs import FEATURES, STRATEGIES

# (strategy, feature) -> why ddpkit refuses the combination before training: the start
# of its ConfigError, a regular expression. A refused cell passes when the run stops
# with it before its first optimizer step (`matrix_jobs._Cell` marks that step).
_UNEVEN_SYNCBN = "a custom sampler or an IterableDataset can give ranks unequal numbers"
REFUSED: dict[tuple[str, str], str] = {
    # Synchronised BatchNorm cannot run on a rank whose shard ran out; one process has
    # no other rank, and trains.
    ("ddp", "uneven_syncbn"): _UNEVEN_SYNCBN,
    ("fsdp", "uneven_syncbn"): _UNEVEN_SYNCBN,
    **{(s, "early_stop_no_eval"): "early stopping" for s in STRATEGIES},
}

# Cells that fail only because of a defect of issue 43 whose fix has not landed yet:
# "TEST[ID]" as pytest names it -> the defect. Each is xfail(strict=True), so it turns
# red the day the fix lands; then its line here goes, in the fix's commit.
KNOWN_DEFECTS: dict[str, str] = {}

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


def _launch(nprocs: int, strategy: str, feature: str, phase: str, folder: str, batch: int) -> Any:
    return ddpkit.launch(
        mj.run_cell,
        strategy,
        feature,
        phase,
        folder,
        batch,
        nprocs=nprocs,
        backend="gloo",
        timeout=COLLECTIVE_TIMEOUT,
        hang_timeout=HANG_TIMEOUT,
    )


def run(
    strategy: str, feature: str, phase: str, folder: Path, nprocs: int, batch: int = mj.BATCH
) -> dict[str, Any]:
    """One phase of a cell on `nprocs` ranks (see `matrix_jobs.run_cell`)."""
    result: dict[str, Any] = in_child(_launch, nprocs, strategy, feature, phase, str(folder), batch)
    return result


def known_defect(test: str, cell: str) -> list[pytest.MarkDecorator]:
    """xfail(strict=True) for a cell `KNOWN_DEFECTS` names; else no mark."""
    reason = KNOWN_DEFECTS.get(f"{test}[{cell}]")
    return [] if reason is None else [pytest.mark.xfail(strict=True, reason=reason)]


def _cells() -> list[Any]:
    cells = []
    for strategy in STRATEGIES:
        for feature in FEATURES:
            cell = f"{strategy}-{feature}"
            marks = [] if (strategy, feature) in FAST else [pytest.mark.slow]
            if strategy == "fsdp":
                marks.append(FSDP_SKIP)
            marks += known_defect("test_cell", cell)
            cells.append(pytest.param(strategy, feature, marks=marks, id=cell))
    return cells


def trained(folder: Path, phase: str, ranks: int, epoch: int, before: float) -> Counter[int]:
    """The sample indices that `phase`'s `ranks` ranks trained in `epoch`, in the
    optimizer steps that started before step `before` (`matrix_jobs.TRAINED`)."""
    seen: Counter[int] = Counter()
    for r in range(ranks):
        records = json.loads((folder / f"{phase}-indices-rank{r}.json").read_text())
        for e, steps_done, indices in records:
            if e == epoch and steps_done < before:
                seen.update(indices)
    return seen


def _records(path: Path) -> list[dict[str, Any]]:
    """metrics.jsonl's records without their timings, which no two runs share (the
    profile's records are nothing else). The record of the epoch a run resumed inside
    holds the whole epoch's loss and samples."""
    out = []
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if record["kind"] == "profile":
            continue
        for name in ("time", "samples_per_s"):
            record.pop(name, None)
        out.append(record)
    return out


def cut_checkpoint(feature: str, straight: dict[str, Any]) -> tuple[int, str]:
    """(step, path) of the checkpoint a resume starts from: the one the cell wrote to cut
    the run; else (save_every_steps) the last the straight run wrote inside its second
    epoch (inside its first, for a run that never ends one)."""
    checkpoints = straight["checkpoints"]
    if straight["cut"] is not None:
        return next((step, path) for step, _, _, path in checkpoints if path == straight["cut"])
    epoch = 0 if feature in mj.ENDLESS else 1
    inside = [(step, path) for step, e, batch, path in checkpoints if e == epoch and batch]
    assert inside, f"no checkpoint inside epoch {epoch + 1}: {straight['checkpoints']}"
    return inside[-1][0], str(inside[-1][1])


def stop_after(folder: Path, feature: str, straight: dict[str, Any], phase: str) -> int:
    """Make `folder` hold what a straight run stopped right after its cut checkpoint
    left: that checkpoint alone in ckpt-resume, with the best.pt of that moment, and
    the run log as written until then in run-PHASE (for run_log, the whole log: the run
    went on past its checkpoint before it was stopped). Returns the cut's step."""
    step, path = cut_checkpoint(feature, straight)
    mj.copy_checkpoint(path, folder / "ckpt-resume")
    best = folder / "best-after" / Path(path).name
    if best.is_dir():
        for kept in best.iterdir():
            mj.copy_checkpoint(str(kept), folder / "ckpt-resume")
    log = folder / "run-straight" / "metrics.jsonl"
    if log.exists():
        lines = log.read_text().splitlines(keepends=True)
        if feature != "run_log":
            lines = [line for line in lines if json.loads(line)["step"] <= step]
        (folder / f"run-{phase}").mkdir()
        (folder / f"run-{phase}" / "metrics.jsonl").write_text("".join(lines))
    return step


# -- the matrix ----------------------------------------------------------------------------
# The features whose epoch holds each sample once, whose draws are made with replacement,
# and the samples their epochs hold (over all ranks), to check a straight run's first epoch.
REPLACEMENT = ("by_steps", "random_sampler")
EPOCH_SAMPLES = {"random_sampler": mj.RANDOM_SAMPLES}


def _straight_problems(
    feature: str, straight: dict[str, Any], folder: Path, nprocs: int
) -> list[str]:
    """What the straight run of a cell got wrong, besides its ranks' states."""
    problems = [f"ranks differ after the straight run: {d}" for d in straight["diffs"]["ranks"]]
    if feature in mj.EVALUATED:
        cap = mj.FEATURE_OPTIONS.get(feature, {}).get("eval_max_batches")
        want = mj.EVAL_SAMPLES if cap is None else min(mj.EVAL_SAMPLES, nprocs * mj.BATCH * cap)
        seen = straight["eval"].get("eval_samples")
        if seen != want:
            problems.append(f"evaluation counted {seen} samples, not {want}")
    metrics = {"eval_top2", "eval_margin"}
    if feature in ("metrics_fn", "eval_max_batches") and not metrics <= set(straight["eval"]):
        problems.append(f"metrics_fn's metrics are missing: {sorted(straight['eval'])}")
    if feature == "run_log":
        records = _records(folder / "run-straight" / "metrics.jsonl")
        steps = sum(record["kind"] == "step" for record in records)
        if steps != straight["global_step"]:
            problems.append(
                f"{steps} step lines in metrics.jsonl for {straight['global_step']} steps"
            )
    if feature == "profile":
        problems += _profile_problems(folder / "run-straight" / "metrics.jsonl", straight, nprocs)
    if feature not in mj.ENDLESS:
        first = trained(folder, "straight", nprocs, 0, float("inf"))
        samples = EPOCH_SAMPLES.get(feature, mj.SAMPLES)
        if feature in REPLACEMENT:
            if first.total() != samples or len(first) == samples:
                problems.append(
                    f"the first epoch drew {first.total()} samples ({len(first)} distinct), "
                    f"not {samples} with replacement"
                )
        elif first != Counter(range(samples)):
            problems.append(f"the first epoch trained {dict(first)}, not each sample once")
    return problems


def _profile_problems(log: Path, straight: dict[str, Any], nprocs: int) -> list[str]:
    """A profiled run's records: each rank's breakdown at each epoch's end, whose windows
    add up to every step the run took, each part measured."""
    records = [json.loads(line) for line in log.read_text().splitlines()]
    profiles = [r for r in records if r["kind"] == "profile"]
    steps = Counter[int]()
    for record in profiles:
        steps[record["rank"]] += record["steps"]
        if not all(record[f"{part}_ms"] >= 0 for part in PARTS) or record["compute_ms"] <= 0:
            return [f"a profile record without its parts measured: {record}"]
    want = {rank: straight["global_step"] for rank in range(nprocs)}
    return [] if dict(steps) == want else [f"profiled steps per rank {dict(steps)}, not {want}"]


@pytest.mark.timeout(90)
@pytest.mark.parametrize(("strategy", "feature"), _cells())
def test_cell(strategy: str, feature: str, tmp_path: Path) -> None:
    """Straight run: no hang, ranks identical, each sample of an epoch trained once.
    Stopped after a mid-epoch checkpoint and resumed in a fresh launch: ranks identical,
    every rank bit-identical to the straight run, and the same best.pt, run log,
    callback state and early stop. A refused cell stops before its first step."""
    nprocs = STRATEGIES[strategy][0]
    refused = REFUSED.get((strategy, feature))
    if refused is not None:
        with pytest.raises(RunFailed, match=rf"ConfigError: {refused}"):
            run(strategy, feature, "straight", tmp_path, nprocs)
        assert not (tmp_path / "straight-trained").exists(), "refused only after training"
        return
    straight = run(strategy, feature, "straight", tmp_path, nprocs)
    problems = _straight_problems(feature, straight, tmp_path, nprocs)
    stop_after(tmp_path, feature, straight, "resume")
    resumed = run(strategy, feature, "resume", tmp_path, nprocs)
    problems += [f"ranks differ after the resumed run: {d}" for d in resumed["diffs"]["ranks"]]
    problems += [f"resumed != straight: {d}" for d in resumed["diffs"]["resume"]]
    for key in ("global_step", "stopped_early", "best", "callback"):
        if resumed[key] != straight[key]:
            problems.append(f"resumed {key} {resumed[key]}, straight {straight[key]}")
    log = tmp_path / "run-straight" / "metrics.jsonl"
    if log.exists():
        before = _records(log)
        after = _records(tmp_path / "run-resume" / "metrics.jsonl")
        if after != before:
            extra = [r for r in after if r not in before]
            lost = [r for r in before if r not in after]
            problems.append(
                f"the resumed run log differs from the straight one: {len(after)} records "
                f"for {len(before)}; not in the straight log {extra[:3]}; lost {lost[:3]}"
            )
    assert not problems, "\n".join(problems)


# -- resuming on another number of ranks, with another batch size ---------------------------
# The features whose data comes in an order of its own (a sampler or stream that shards
# itself, a DistributedSampler subclass): ddpkit cannot share what is left of it out again
# over another number of ranks, and says so in one line before training; on the ranks
# that saved, each rank goes on in its own order. An endless stream has no epoch to count.
OWN_ORDER = ("uneven_map", "uneven_accumulate", "uneven_iterable", "sampler_subclass")
NOT_ELSEWHERE = (*mj.ENDLESS, "uneven_syncbn", "early_stop_no_eval")
_NOT_SHARED = "the resumed epoch had trained .* cannot be shared out again"


def _elsewhere() -> list[Any]:
    """(strategy, feature, ranks before, after, batch size after) of the resumes
    elsewhere: the plain job both ways and on both strategies, with and without a new
    batch size; every feature on ddp, 2 -> 2 ranks with batch 6 and 2 -> 1 with 6."""
    cells = [
        ("ddp", "plain", 2, 1, mj.BATCH),
        ("ddp", "plain", 1, 2, mj.BATCH),
        ("fsdp", "plain", 2, 1, 6),
        ("fsdp", "plain", 1, 2, 6),
        ("ddp", "plain", 1, 2, 6),
    ]
    for feature in FEATURES:
        if feature not in NOT_ELSEWHERE:
            cells += [("ddp", feature, 2, 2, 6), ("ddp", feature, 2, 1, 6)]
    params = []
    for strategy, feature, before, after, batch in cells:
        name = f"{strategy}-{feature}-{before}to{after}" + (
            f"-batch{batch}" if batch != mj.BATCH else ""
        )
        marks = [] if name == "ddp-plain-2to1" else [pytest.mark.slow]
        if strategy == "fsdp":
            marks.append(FSDP_SKIP)
        marks += known_defect("test_resume_elsewhere", name)
        params.append(pytest.param(strategy, feature, before, after, batch, marks=marks, id=name))
    return params


@pytest.mark.timeout(90)
@pytest.mark.parametrize(("strategy", "feature", "before", "after", "batch"), _elsewhere())
def test_resume_elsewhere(
    strategy: str, feature: str, before: int, after: int, batch: int, tmp_path: Path
) -> None:
    """Stopped inside the second epoch on `before` ranks, resumed on `after` in
    micro-batches of `batch`: over that epoch each sample is trained as often as in the
    straight run (once; a draw with replacement as often as it was drawn), and the
    resumed ranks end identical. Data in an order of its own, on another number of ranks,
    is refused instead."""
    straight = run(strategy, feature, "straight", tmp_path, before)
    cut_step = stop_after(tmp_path, feature, straight, "elsewhere")
    if feature in OWN_ORDER and after != before:
        with pytest.raises(RunFailed, match=rf"ConfigError: {_NOT_SHARED}"):
            run(strategy, feature, "elsewhere", tmp_path, after, batch)
        return
    resumed = run(strategy, feature, "elsewhere", tmp_path, after, batch)
    whole = trained(tmp_path, "straight", before, 1, float("inf"))
    second = trained(tmp_path, "straight", before, 1, cut_step)
    second += trained(tmp_path, "elsewhere", after, 1, float("inf"))
    more = sorted(i for i in second if second[i] > whole[i])
    fewer = sorted(i for i in whole if second[i] < whole[i])
    assert not more and not fewer, (
        f"the second epoch, cut after step {cut_step} on {before} rank(s) and resumed on "
        f"{after} in batches of {batch}, trained {len(more)} sample(s) more often than the "
        f"straight run {more} and {len(fewer)} less often {fewer}"
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


def test_refused_and_known_defects_name_cells() -> None:
    """Each entry of `REFUSED` and `KNOWN_DEFECTS` names a cell that runs (a typo would
    leave a refusal untested, or an xfail mark on nothing)."""
    assert set(REFUSED) <= {(s, f) for s in STRATEGIES for f in FEATURES}
    ids = {f"test_cell[{p.id}]" for p in _cells()}
    ids |= {f"test_resume_elsewhere[{p.id}]" for p in _elsewhere()}
    assert set(KNOWN_DEFECTS) <= ids, sorted(set(KNOWN_DEFECTS) - ids)

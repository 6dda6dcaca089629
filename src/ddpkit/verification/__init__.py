"""Check that a distributed job trains exactly as it should: `ddpkit verify` in Python.

DDP bugs are silent: a BatchNorm that normalises each process's batch alone, a loss
summed instead of averaged, a random dataset built after seeding with the rank, data
every process reads whole, a resume that forgets part of the state. Each trains "fine"
and gives a worse model. `verify` runs your own job through `Trainer`, on CPU with gloo
(so a GPU job can be checked on a laptop), compares the numbers, and names the likely
cause of a difference.

The modules: `equivalence` (N processes against one), `recording` (the samples each
process trained on, replayed in one), `probe` (does every process build the same
dataset, and does fetching a sample draw only seeded randomness?), `resume` (straight
against stopped and resumed), `causes` (why a check failed), `report` (`VerifyReport`)
and `runs` (what both checks' runs share).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ddpkit.errors import ConfigError
from ddpkit.training.config import TrainConfig
from ddpkit.training.job import JobRef
from ddpkit.verification.equivalence import check_equivalence
from ddpkit.verification.report import VerifyReport
from ddpkit.verification.resume import check_resume
from ddpkit.verification.runs import DEFAULT_STEPS, LogFn, LoopRef

__all__ = ["VerifyReport", "verify"]


def verify(
    job: JobRef | None = None,
    config: TrainConfig | None = None,
    *,
    loop: LoopRef | None = None,
    loop_args: Sequence[Any] = (),
    nproc: int = 2,
    steps: int = DEFAULT_STEPS,
    resume: bool = False,
    dtype: str = "float64",
    atol: float | None = None,
    rtol: float | None = None,
    log_fn: LogFn = None,
) -> VerifyReport:
    """Check that `job` computes on `nproc` processes what it computes on one, or, with
    `resume=True`, that stopping and resuming it changes nothing. Instead of a job, a
    training `loop` written by hand with `prepare_model` and `prepare_loader` may be
    checked the same way (the first check only).

    The default check runs `steps` optimizer steps as `nproc` processes with
    `config.batch_size` each, then as one process whose every batch is the union of the
    processes' batches (in the same order), and compares every parameter and buffer
    after each step. Each process draws its own random stream, so the one process
    trains on the samples the processes fetched, recorded as they trained (random
    augmentation included). Dropout is switched off in both runs, since one process
    cannot draw the masks that N processes draw. The resume check runs `steps` steps
    straight, and about half of them + a checkpoint + a resume in a fresh launch + the
    rest, and requires the model, optimizer, scheduler and random states to be
    bit-for-bit equal on every process. Both checks fail a training set whose samples
    draw randomness that ddpkit does not seed.

    Args:
        job: the job to check: a module-level `build(ctx) -> Job` function (it is sent
            to the worker processes by name), a built-in example's name, or a
            "MODULE:FUNCTION" spec.
        loop: instead of `job`, your training loop `main(ctx)`, as you run it with
            `ddpkit.launch(main)` (or its "MODULE:FUNCTION" or "file.py:FUNCTION"). It
            must build one model with `prepare_model`, its training data with one
            `prepare_loader` (a map-style dataset; an eval loader passes
            `evaluation=True`), and step an optimizer. verify runs it on `nproc`
            processes, recording the samples each trains on, then on one process with
            `nproc` times the batch it gives `prepare_loader` and those samples, and
            stops both after `steps` optimizer steps; `config` is not used.
        loop_args: what `loop` takes after `ctx`, as `launch(main, *loop_args)` passes it.
        config: the training options, `batch_size` (per process) and `seed` among them;
            `TrainConfig()` if None. Checkpointing, resuming, the run folder, progress
            and early stopping are turned off; the default check also turns mixed
            precision off (and says so in the report's notes).
        nproc: processes to compare with one (at least 2).
        steps: optimizer steps to run (at least 1; at least 2 with `resume=True`).
        resume: check that resuming is exact instead.
        dtype: "float64" (the default) promotes the model and the data to float64, so
            that rounding stays near 1e-16 and cannot pass for a bug (in float32, Adam
            turns the rounding noise of a gradient that should be zero, such as a bias
            before BatchNorm, into steps of the learning rate); "float32" compares the
            job as it trains. Ignored with `resume=True`.
        atol: absolute tolerance; by default 1e-9 for float64, 1e-5 for float32.
            Ignored with `resume=True`, which asks for equal bits.
        rtol: relative tolerance; by default 1e-7 for float64, 1e-4 for float32.
            Ignored with `resume=True`.
        log_fn: called with one line of text as each run starts (`ddpkit verify` prints
            them); None for silence.

    Returns:
        A `VerifyReport`: whether the check passed, where and by how much the runs
        differ, and the likely causes; `str(report)` is the text `ddpkit verify` prints.

    Raises:
        ConfigError: a bad argument, a call under torchrun (verify starts its own
            processes), or a training sampler that gives processes shards of different
            lengths.
        WorkerError: a process raised or died, the job's own error included (for
            example a dataset without `__len__`, whose order cannot be replayed).
    """
    if (job is None) == (loop is None):
        raise ConfigError(
            "verify checks a job or a loop: pass one of them, e.g. verify('linear') or "
            "verify(loop='train.py:main')"
        )
    if resume:
        if job is None:
            raise ConfigError(
                "verify checks the resume of a Job (its checkpoints are ddpkit's): pass a "
                "build function, or drop resume=True to check the loop's equivalence"
            )
        return check_resume(job, config, nproc=nproc, steps=steps, log_fn=log_fn)
    return check_equivalence(
        job,
        config,
        loop=loop,
        loop_args=tuple(loop_args),
        nproc=nproc,
        steps=steps,
        dtype=dtype,
        atol=atol,
        rtol=rtol,
        log_fn=log_fn,
    )

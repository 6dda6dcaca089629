"""What a flag of `ddpkit run` costs a training loop: the harness that
`bench/audit_cost.py` (`--audit`) and `bench/rehearse_cost.py` (`--cpu`) share.

Each contestant is launched on its own process, the two alternating so that a slow spell
of the machine hits both:

- one process, CPU time of the job's training loop, with and without `prelude` (what
  the flag installs in a rank): the per-step cost, free of machine noise;
- `ddpkit run --nproc 2`, the loop's wall time as the job measures it, with and without
  the flag;
- and a share timed apart (the flag's work in one step, over many calls), which the
  noise of whole runs hides.

A job prints `RESULT {"wall": ..., "cpu": ...}` on rank 0 and takes its step count as
its first argument.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def result(output: str) -> dict[str, float]:
    """The job's `RESULT` line (after `[rank 0] ` under ddpkit run)."""
    for line in output.splitlines():
        _, found, text = line.partition("RESULT ")
        if found:
            return dict(json.loads(text))
    raise RuntimeError(f"the job printed no result:\n{output[-2000:]}")


def one_process(script: Path, steps: int, prelude: str = "") -> float:
    """CPU seconds of the loop in one fresh process, `prelude` run first."""
    code = prelude + f"import sys; sys.argv = ['job', '{steps}']\n" + script.read_text()
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    return result(out.stdout)["cpu"]


def two_ranks(script: Path, steps: int, flag: str | None) -> float:
    """Wall seconds of rank 0's loop under `ddpkit run --nproc 2 [flag]`."""
    command = [sys.executable, "-m", "ddpkit", "run", "--nproc", "2"]
    out = subprocess.run(
        [*command, *([flag] if flag else []), str(script), str(steps)],
        capture_output=True,
        text=True,
        check=True,
        cwd=script.parent,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    return result(out.stdout)["wall"]


def _ratios(measure: Callable[[bool], float], rounds: int) -> list[float]:
    """with / without, `rounds` times, alternating which goes first."""
    ratios = []
    for i in range(rounds):
        order = (False, True) if i % 2 == 0 else (True, False)
        times = {on: measure(on) for on in order}
        ratios.append(times[True] / times[False])
    return ratios


def main(
    argv: list[str] | None,
    *,
    doc: str,
    job: str,
    prelude: str,
    flag: str,
    share: Callable[[Path, int], float],
    share_name: str,
    header: str,
    goal: str,
) -> int:
    """Measure and print the three rows (the command line of each bench script)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400, help="optimizer steps per run")
    parser.add_argument("--rounds", type=int, default=5, help="alternating pairs per row")
    parser.add_argument("--markdown", action="store_true", help="print a markdown table")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "job.py"
        script.write_text(job, encoding="utf-8")
        started = time.perf_counter()
        rows = {
            "1 process, loop CPU time": _ratios(
                lambda on: one_process(script, args.steps, prelude if on else ""), args.rounds
            ),
            "ddpkit run --nproc 2, loop wall time": _ratios(
                lambda on: two_ranks(script, args.steps, flag if on else None),
                max(3, args.rounds // 2 + 1),
            ),
        }
        added = share(script, args.steps)
    if args.markdown:
        print(f"| measurement | {header}, median | spread |")
        print("|---|---|---|")
        print(f"| {share_name} | {1 + added:.5f} | (timed, not noisy) |")
    else:
        print(f"{share_name:40} {1 + added:.5f}")
    for name, ratios in rows.items():
        median = statistics.median(ratios)
        spread = f"{min(ratios):.3f}-{max(ratios):.3f}"
        if args.markdown:
            print(f"| {name} | {median:.3f} | {spread} |")
        else:
            print(f"{name:40} {median:.3f} (spread {spread}, {len(ratios)} pairs)")
    print(f"({time.perf_counter() - started:.0f} s; goal: {goal})")
    return 0

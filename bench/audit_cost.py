"""What `ddpkit run --audit` costs a training loop.

Two measurements, each contestant launched on its own process and alternating:

- one process, CPU time of the training loop of an MLP, with and without the audit's
  hooks installed (`ddpkit.inrank.audit.install`): the per-step cost, free of
  machine noise;
- `ddpkit run --nproc 2`, the loop's wall time as the script measures it, with and
  without `--audit` (the hooks, and the weights hashed once at the end, outside the
  loop).

    .venv/bin/python bench/audit_cost.py            # about 2 minutes on 2 cores
    .venv/bin/python bench/audit_cost.py --markdown

The goal: the audit costs at most 1 % of the loop.
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
from pathlib import Path

HERE = Path(__file__).resolve()
ROOT = HERE.parent.parent

# The job both measurements run: an MLP on random data, AdamW, a DataLoader with a
# DistributedSampler when there is a process group.
JOB = """
import os, sys, time, json
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

torch.set_num_threads(1)
steps = int(sys.argv[1])
distributed = "RANK" in os.environ
if distributed:
    dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.Sequential(
    torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512), torch.nn.ReLU(),
    torch.nn.Linear(512, 10),
)
if distributed:
    model = torch.nn.parallel.DistributedDataParallel(model)
data = TensorDataset(torch.randn(steps * 32, 256), torch.randint(0, 10, (steps * 32,)))
sampler = DistributedSampler(data) if distributed else None
loader = DataLoader(data, batch_size=32, sampler=sampler)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
wall, cpu = time.perf_counter(), time.process_time()
for x, y in loader:
    optimizer.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()
wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
if not distributed or dist.get_rank() == 0:
    print("RESULT " + json.dumps({"wall": wall, "cpu": cpu}), flush=True)
if distributed:
    dist.destroy_process_group()
"""


def _result(output: str) -> dict[str, float]:
    for line in output.splitlines():
        _, found, result = line.partition("RESULT ")  # after `[rank 0] ` under ddpkit run
        if found:
            return dict(json.loads(result))
    raise RuntimeError(f"the job printed no result:\n{output[-2000:]}")


def _one_process(script: Path, steps: int, audited: bool) -> float:
    """CPU seconds of the loop in one fresh process, hooks installed or not."""
    prelude = "from ddpkit.inrank import audit; audit.install(0)\n" if audited else ""
    code = prelude + f"import sys; sys.argv = ['job', '{steps}']\n" + script.read_text()
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    return _result(out.stdout)["cpu"]


def _two_ranks(script: Path, steps: int, audited: bool) -> float:
    """Wall seconds of rank 0's loop under `ddpkit run --nproc 2` (with --audit or not)."""
    command = [sys.executable, "-m", "ddpkit", "run", "--nproc", "2"]
    if audited:
        command.append("--audit")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [*command, str(script), str(steps)],
        capture_output=True,
        text=True,
        check=True,
        cwd=script.parent,
        env=env,
    )
    return _result(out.stdout)["wall"]


def _hook_share(script: Path, steps: int) -> float:
    """The audit's work per optimizer step (its step hook, timed over 100,000 calls)
    as a share of one plain step of the job: the cost the noise of whole runs hides."""
    import torch

    from ddpkit.inrank.audit import _Recorder

    recorder = _Recorder(0)
    optimizer = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    recorder.on_step(optimizer, (), {})  # the first step records; the others look up
    calls = 100_000
    start = time.process_time()
    for _ in range(calls):
        recorder.on_step(optimizer, (), {})
    per_call = (time.process_time() - start) / calls
    per_step = _one_process(script, steps, audited=False) / steps
    return per_call / per_step


def _ratios(measure: object, script: Path, steps: int, rounds: int) -> list[float]:
    ratios = []
    for i in range(rounds):
        # Alternate which goes first, so that a slow spell of the machine hits both.
        order = (False, True) if i % 2 == 0 else (True, False)
        times = {audited: measure(script, steps, audited) for audited in order}  # type: ignore[operator]
        ratios.append(times[True] / times[False])
    return ratios


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--steps", type=int, default=400, help="optimizer steps per run")
    parser.add_argument("--rounds", type=int, default=5, help="alternating pairs per row")
    parser.add_argument("--markdown", action="store_true", help="print a markdown table")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "job.py"
        script.write_text(JOB, encoding="utf-8")
        started = time.perf_counter()
        rows = {
            "1 process, loop CPU time": _ratios(_one_process, script, args.steps, args.rounds),
            "ddpkit run --nproc 2, loop wall time": _ratios(
                _two_ranks, script, args.steps, max(3, args.rounds // 2 + 1)
            ),
        }
        share = _hook_share(script, args.steps)
    if args.markdown:
        print("| measurement | audited / plain, median | spread |")
        print("|---|---|---|")
        print(f"| the step hook alone, per step | {1 + share:.5f} | (timed, not noisy) |")
    else:
        print(f"{'the step hook alone, per step':40} {1 + share:.5f}")
    for name, ratios in rows.items():
        median = statistics.median(ratios)
        spread = f"{min(ratios):.3f}-{max(ratios):.3f}"
        if args.markdown:
            print(f"| {name} | {median:.3f} | {spread} |")
        else:
            print(f"{name:40} {median:.3f} (spread {spread}, {len(ratios)} pairs)")
    print(f"({time.perf_counter() - started:.0f} s; goal: at most 1.01)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What does the stop vote cost a training step?

With a checkpoint folder, a `Trainer` saves and stops on SIGTERM, SIGUSR1 or Ctrl-C,
and its ranks agree on the step to stop after with a small all-reduce (the stop vote,
`ddpkit.inrank.preemption.StopVote`). It used to run after every optimizer step, which cost
15-50 % of the few-millisecond steps of a small CPU job; it now runs about every
0.1 s of steps.

Two configurations of the same job (the DDP tutorial's linear regression, the `linear`
example, batch 32) with the same checkpoint folder settings, so that both save the
same checkpoints:

- `vote`: `on_signal="save"` (the default): the vote runs;
- `no-vote`: `on_signal="stop"`: no vote; a signal stops the job at once.

One launch of N ranks; in the same processes the two take turns (`vote, no-vote /
no-vote, vote / ...`) on fresh models, after one unmeasured warm-up each. Each fit is
timed on rank 0 over the whole `fit()` (wall and CPU). The result is the ratio
no-vote / vote of the median wall times (1.0: the vote costs nothing) with its spread
over the rounds, and the same for CPU time, which machine noise moves less.

    .venv/bin/python bench/stop_vote.py                 # 2 ranks, ~1 min on 2 cores
    .venv/bin/python bench/stop_vote.py --nprocs 1 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import ddpkit
from ddpkit import DistContext, TrainConfig
from ddpkit.parallel.ranks import broadcast_object
from ddpkit.training.job import build_job


def _fit(ctx: DistContext, on_signal: str, epochs: int, folder: str) -> tuple[float, float, int]:
    config = TrainConfig(
        epochs=epochs,
        batch_size=32,
        checkpoint_dir=folder,
        keep_last=1,
        on_signal=on_signal,  # type: ignore[arg-type]
        progress=False,
    )
    trainer = build_job(ctx, "linear", config).trainer(ctx, config)
    trainer.log_fn = lambda line: None
    start, cpu = time.perf_counter(), time.process_time()
    trainer.fit()
    return time.perf_counter() - start, time.process_time() - cpu, trainer.global_step


def _rounds(ctx: DistContext, rounds: int, epochs: int) -> dict[str, list[list[float]]]:
    times: dict[str, list[list[float]]] = {"vote": [], "no-vote": []}
    orders = [("save", "stop"), ("stop", "save")]
    with tempfile.TemporaryDirectory() as scratch:
        shared = broadcast_object(scratch)  # rank 0's folder on every rank
        for i in range(rounds + 1):
            for on_signal in orders[i % 2]:
                folder = str(Path(shared, f"r{i}-{on_signal}"))
                wall, cpu, steps = _fit(ctx, on_signal, epochs, folder)
                if i:  # round 0 warms up both
                    key = "vote" if on_signal == "save" else "no-vote"
                    times[key].append([wall, cpu, steps])
    return times


def _summary(times: dict[str, list[list[float]]]) -> dict[str, Any]:
    def ratio(column: int) -> dict[str, float]:
        vote = [t[column] for t in times["vote"]]
        none = [t[column] for t in times["no-vote"]]
        per_round = [n / v for n, v in zip(none, vote, strict=True)]
        return {
            "median": round(statistics.median(none) / statistics.median(vote), 3),
            "min": round(min(per_round), 3),
            "max": round(max(per_round), 3),
        }

    steps = int(times["vote"][0][2])
    step_ms = statistics.median(t[0] for t in times["no-vote"]) / steps * 1000
    return {
        "steps_per_fit": steps,
        "step_ms_without_vote": round(step_ms, 3),
        "wall_ratio_no_vote_over_vote": ratio(0),
        "cpu_ratio_no_vote_over_vote": ratio(1),
        "raw": times,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nprocs", type=int, default=2, help="ranks (default 2)")
    p.add_argument("--rounds", type=int, default=5, help="measured rounds (default 5)")
    p.add_argument("--epochs", type=int, default=10, help="epochs per fit (default 10)")
    p.add_argument("--json", type=Path, help="also write the result here")
    args = p.parse_args()
    times = ddpkit.launch(_rounds, args.rounds, args.epochs, nprocs=args.nprocs)
    result = {"nprocs": args.nprocs, **_summary(times)}
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    del result["raw"]
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

"""The likely causes of a failed check, named from what its runs recorded."""

from __future__ import annotations

from typing import Any

from ddpkit.verification.report import VerifyReport
from ddpkit.verification.runs import leaves, same


def equivalence_causes(report: VerifyReport, ranks: list[dict[str, Any]]) -> list[str]:
    """Why the N-rank run and the one-process run differ, from the report's first
    divergence and what each rank recorded (`ranks`). Problems that do not show in the
    numbers (unsharded data, per-rank randomness) are causes on their own."""
    n, b = report.nproc, report.batch_size
    causes: list[str] = []
    dropout = ranks[0]["dropout"]
    if not all(r["repeatable"] for r in ranks):
        causes.append(
            "the training sampler gives another order each time it is iterated (a "
            "RandomSampler without a generator?): the data order is not reproducible and "
            "cannot be compared; seed it, or let ddpkit shard and shuffle (no train_sampler)"
        )
    shared = set(ranks[0]["orders"][0]).intersection(*(r["orders"][0] for r in ranks[1:]))
    if len(shared) >= n:  # DistributedSampler repeats at most n - 1 samples as padding
        causes.append(
            f"data is not sharded: all {n} ranks train on the same {len(shared)} samples "
            f"of their {len(ranks[0]['orders'][0])} in epoch 1, so {n} ranks do the work "
            "of one: let ddpkit shard the data (no train_sampler) or use a "
            "DistributedSampler"
        )
    if len({r["rng"] for r in ranks}) > 1 and dropout:
        causes.append(
            f"randomness differs between ranks: the ranks start training with different "
            f"torch RNG states (seeded with the rank?) and the model has {dropout} "
            "Dropout layer(s), so the masks, and the trained model, depend on the rank "
            "and the number of ranks: seed every rank alike (ddpkit seeds all ranks with "
            "--seed before build; do not reseed with ctx.rank)"
        )
    first = report.first_divergence
    if first is None:
        return causes
    step = first["step"]
    ratio, cosine = first.get("update_ratio"), first.get("update_cosine", 0.0)
    plain_bn = ranks[0]["plain_batchnorm"]
    if step == 0:
        causes.append(
            "the two runs start from different models: build(ctx) depends on the rank or "
            "the number of ranks, or on randomness that seed_everything does not cover"
        )
    elif plain_bn:
        causes.append(
            f"BatchNorm not synchronised: {len(plain_bn)} BatchNorm layer(s) (e.g. "
            f"{plain_bn[0]!r}) normalise each rank's batch of {b} alone, while one process "
            f"normalises the global batch of {n * b}: leave sync_batchnorm on (the default), "
            "or convert with ddpkit.convert_sync_batchnorm"
        )
    elif ratio is not None and cosine > 0.99 and abs(ratio / n - 1) < 0.05:
        causes.append(
            f"gradient not averaged over the global batch: one process's update is "
            f"{ratio:.2f}x the {n}-rank update, as with a loss summed over the batch "
            f"(DDP averages over ranks, so a summed loss shrinks {n}-fold): average the "
            "loss over the batch (reduction='mean')"
        )
    elif ratio is not None and cosine > 0.99 and abs(ratio * n - 1) < 0.05:
        causes.append(
            f"gradients summed over ranks instead of averaged: the {n}-rank update is "
            f"{1 / ratio:.2f}x one process's (an extra all_reduce without dividing by the "
            "world size?)"
        )
    elif _ranks_disagree(ranks, step):
        causes.append(
            f"the ranks hold different parameters after step {step}: something changes "
            "the parameters outside DDP's gradient averaging (a rank-dependent update?)"
        )
    else:
        causes.append(
            "no known cause matched: look for ops whose result depends on the batch "
            "size or the rank (a loss normalised by a fixed count, non-deterministic "
            "kernels), or loosen --atol/--rtol if the difference is rounding"
        )
    return causes


def _ranks_disagree(ranks: list[dict[str, Any]], step: int) -> bool:
    """Do the ranks hold different parameters after `step` (or the last one recorded)?"""
    snaps = [r["digests"][min(step, len(r["digests"]) - 1)] for r in ranks]
    return any(s != snaps[0] for s in snaps[1:])


def resume_causes(straight: dict[str, Any], resumed: dict[str, Any]) -> list[str]:
    """Why the resumed run's final state (`resumed`) differs from the uninterrupted
    run's (`straight`): a learning rate or random state the checkpoint did not keep."""
    lr = [
        (g1.get("lr"), g2.get("lr"))
        for g1, g2 in zip(
            straight["optimizer"]["param_groups"],
            resumed["optimizer"]["param_groups"],
            strict=False,
        )
    ]
    causes = []
    if any(x != y for x, y in lr):
        causes.append(
            "the learning rate after resume is not the uninterrupted run's: an LR scheduler "
            "whose state is not in the checkpoint; give it to ddpkit (Job.scheduler or "
            "Trainer(scheduler=...)) or keep its state in your Callback's state_dict()"
        )
    if not all(
        same(x, y)
        for (_, x), (_, y) in zip(leaves(straight["rng"]), leaves(resumed["rng"]), strict=False)
    ):
        causes.append(
            "random state not restored: an RNG the checkpoint does not hold (a "
            "torch.Generator of your own?), or one drawn from outside the training steps"
        )
    return causes

"""The likely causes of a failed check, named from what its runs recorded."""

from __future__ import annotations

from typing import Any

from ddpkit.verification.report import VerifyReport
from ddpkit.verification.runs import leaves, same


def equivalence_causes(
    report: VerifyReport,
    ranks: list[dict[str, Any]],
    *,
    reference_draws: bool = False,
    maker: str = "build(ctx)",
) -> list[str]:
    """Why the N-rank run and the one-process run differ, from the report's first
    divergence, what each rank recorded (`ranks`), and whether the one-process run drew
    random numbers in its steps (`reference_draws`). Problems that do not show in the
    numbers (unsharded data, data that depends on the rank, unseeded randomness) are
    causes on their own. `maker` names what built the data and model: "build(ctx)", or
    "the loop" written by hand."""
    n = report.nproc
    causes: list[str] = []
    unseeded = [r["probe"]["unseeded"] for r in ranks if r["probe"]["unseeded"] is not None]
    if unseeded:
        causes.append(unseeded_cause(unseeded[0]))
    if not all(r["repeatable"] for r in ranks):
        causes.append(
            "the training sampler gives another order each time it is iterated (a "
            "RandomSampler without a generator?): the data order is not reproducible and "
            "cannot be compared; seed it, or let ddpkit shard and shuffle (no train_sampler)"
        )
    differ = datasets_differ(ranks)
    if differ and ranks[0]["shards_by_index"]:
        causes.append(
            "the ranks build different datasets: the first samples of the training set, "
            f"each fetched from the same random state, differ between ranks, so {maker} "
            "makes data that depends on the rank (it reseeds with ctx.rank, or uses an "
            "unseeded generator, before making a random dataset?), and each rank trains "
            "on its share of a dataset of its own: build the same dataset on every rank "
            + (
                "(ddpkit seeds every rank alike before build; do not reseed with ctx.rank)"
                if maker == "build(ctx)"
                else "(seed every rank alike, ddpkit.seed_everything(0), not with ctx.rank)"
            )
        )
    firsts = [r["orders"][0] for r in ranks]
    shared = set(firsts[0]).intersection(*firsts[1:])
    # DistributedSampler repeats at most n - 1 samples as padding; ranks whose datasets
    # differ may use the same indices (each its own shard); draws with replacement
    # repeat indices anyway, and are unsharded only when every rank draws the same.
    replacement = ranks[0].get("replacement", False)
    unsharded = all(f == firsts[0] for f in firsts) if replacement else len(shared) >= n
    if unsharded and not differ:
        causes.append(
            f"data is not sharded: all {n} ranks train on the same {len(shared)} samples "
            f"of their {len(ranks[0]['orders'][0])} in epoch 1, so {n} ranks do the work "
            "of one: let ddpkit shard the data (no train_sampler) or use a "
            "DistributedSampler"
        )
    first = report.first_divergence
    if first is None:
        return causes
    found = _divergence_cause(report, ranks, first, maker)
    if reference_draws and first["step"] > 0:
        causes.append(
            "the training step draws random numbers (noise drawn in forward or in the "
            "loss, a random layer other than Dropout, which verify switches off): one "
            f"process cannot draw what {n} ranks draw, each from its own stream, so the "
            "runs differ by that noise and this job cannot be compared as it is; turn the "
            "noise off while verifying (a flag that build reads) to check the rest"
        )
    elif found is None:
        found = (
            "no known cause matched: look for ops whose result depends on the batch "
            "size or the rank (a loss normalised by a fixed count, non-deterministic "
            "kernels), or loosen --atol/--rtol if the difference is rounding"
        )
    return causes + ([found] if found else [])


def _divergence_cause(
    report: VerifyReport, ranks: list[dict[str, Any]], first: dict[str, Any], maker: str
) -> str | None:
    """The cause that the first divergence's numbers point to, if one does."""
    n, b = report.nproc, report.batch_size
    step = first["step"]
    ratio, cosine = first.get("update_ratio"), first.get("update_cosine", 0.0)
    plain_bn = ranks[0]["plain_batchnorm"]
    if step == 0:
        return (
            f"the two runs start from different models: {maker} depends on the rank or "
            "the number of ranks, or on randomness that seed_everything does not cover"
        )
    if plain_bn:
        return (
            f"BatchNorm not synchronised: {len(plain_bn)} BatchNorm layer(s) (e.g. "
            f"{plain_bn[0]!r}) normalise each rank's batch of {b} alone, while one process "
            f"normalises the global batch of {n * b}: leave sync_batchnorm on (the default), "
            "or convert with ddpkit.convert_sync_batchnorm"
        )
    if ratio is not None and cosine > 0.99 and abs(ratio / n - 1) < 0.05:
        return (
            f"gradient not averaged over the global batch: one process's update is "
            f"{ratio:.2f}x the {n}-rank update, as with a loss summed over the batch "
            f"(DDP averages over ranks, so a summed loss shrinks {n}-fold): average the "
            "loss over the batch (reduction='mean')"
        )
    if ratio is not None and cosine > 0.99 and abs(ratio * n - 1) < 0.05:
        return (
            f"gradients summed over ranks instead of averaged: the {n}-rank update is "
            f"{1 / ratio:.2f}x one process's (an extra all_reduce without dividing by the "
            "world size?)"
        )
    if _ranks_disagree(ranks, step):
        return (
            f"the ranks hold different parameters after step {step}: something changes "
            "the parameters outside DDP's gradient averaging (a rank-dependent update?)"
        )
    return None


def datasets_differ(ranks: list[dict[str, Any]]) -> bool:
    """Did the ranks' training sets give different samples from the same random state?
    (Unknown, so False, where a fetch draws unseeded randomness.)"""
    if any(r["probe"]["unseeded"] is not None for r in ranks):
        return False
    return len({r["probe"]["digest"] for r in ranks}) > 1


def unseeded_cause(index: int) -> str:
    """The cause named when fetching sample `index` twice from the same random state
    gave two different samples."""
    return (
        f"unseeded randomness: sample {index} of the training set came out different when "
        "fetched twice from the same random state, so its __getitem__ draws from a "
        "source that ddpkit neither seeds nor checkpoints (np.random.default_rng() "
        "without a seed, a torch.Generator of its own, os.urandom, ...), and its draws "
        "can be neither reproduced nor resumed: draw from torch's, random's or NumPy's "
        "global RNG instead (ddpkit seeds each rank's, and each sample's in worker "
        "processes)"
    )


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

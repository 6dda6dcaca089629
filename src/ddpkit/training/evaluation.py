"""The Trainer's evaluation: the exact loss and metrics over an eval set, each sample
counted once, all ranks together."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn
from torch.utils.data import DataLoader

from ddpkit.context import DistContext
from ddpkit.errors import ConfigError
from ddpkit.parallel.batches import MetricsFn, count_samples, is_pair, to_device
from ddpkit.parallel.data import ShardSampler
from ddpkit.parallel.model import unwrap
from ddpkit.parallel.precision import Precision
from ddpkit.parallel.ranks import broadcast_object, reduce_sums
from ddpkit.parallel.strategy import Strategy
from ddpkit.training.config import TrainConfig
from ddpkit.training.progress import Bar

# (model, batch) -> (mean loss, the model's outputs or None)
LossOf = Callable[[nn.Module, Any], tuple[torch.Tensor, Any]]


class Evaluation:
    """Evaluates `model` over `loader` (see `Trainer.evaluate`).

    Args:
        model: what runs: the bare model (DDP's forward would broadcast buffers at each
            batch, and ranks may hold unequal numbers of eval batches), compiled or not.
        loader: the eval set's loader (`prepare_loader(..., evaluation=True)`).
        loss_of: a batch's loss and outputs, as in training.
        pairs: batches are `(inputs, targets)` pairs whose targets accuracy may use
            (not with a training_step).
        strategy: the model's: under FSDP every forward gathers, so the ranks run as many.
    """

    def __init__(
        self,
        model: nn.Module,
        loader: DataLoader[Any],
        ctx: DistContext,
        config: TrainConfig,
        precision: Precision,
        loss_of: LossOf,
        metrics_fn: MetricsFn | None,
        *,
        pairs: bool,
        strategy: Strategy,
    ) -> None:
        self.model, self.loader, self.ctx, self.config = model, loader, ctx, config
        self.precision, self.loss_of, self.metrics_fn = precision, loss_of, metrics_fn
        self.pairs, self.strategy = pairs, strategy

    def run(self) -> dict[str, float]:
        """The eval set's metrics, the same on every rank (call on every rank)."""
        bare, model = unwrap(self.model), self.model
        was_training = bare.training
        bare.eval()
        device = self.ctx.device
        sums: dict[str, torch.Tensor] = {}  # each metric's sum over this rank's samples
        count, classify = 0, False
        batches = 0
        bar = Bar(self.config, self.ctx)  # it may run mid-epoch, beside the pass's
        try:
            cap, length = self.config.eval_max_batches, _length(self.loader)
            if cap is not None and length is not None:
                length = min(length, cap)
            for batch in bar.wrap(self.loader, "eval", length):
                if cap is not None and batches >= cap:
                    break
                batches += 1
                n = count_samples(batch)
                batch = to_device(batch, device)
                loss, outputs, own = self._forwards(model, batch)
                # Under the names they are reported by, apart from ddpkit's own loss
                # and top-1 accuracy: a metrics_fn's "accuracy" is eval_accuracy.
                values = {f"eval_{k}": v for k, v in own.items()}
                values["loss"] = loss
                targets = batch[1] if self.pairs and is_pair(batch) else None
                if _class_logits(outputs, targets):
                    classify = True
                    values["accuracy"] = (outputs.argmax(dim=1) == targets).float().mean()
                for name, value in values.items():
                    weighted = torch.as_tensor(value, device=device).detach().double() * n
                    sums[name] = sums[name] + weighted if name in sums else weighted
                count += n
            stand_ins = self.strategy.forwards_to_match(batches, self._rank_0s_batches)
            if stand_ins:
                self._stand_in_forwards(model, stand_ins)
        finally:
            bar.close()
        bare.train(was_training)
        # Every rank reduces the same names in the same order, even one with no batch.
        names = ["loss", *(self._metric_names(sums)), "accuracy"]
        zero = torch.zeros((), device=device, dtype=torch.float64)
        totals = reduce_sums([*(sums.get(k, zero) for k in names), count, int(classify)], self.ctx)
        *values_sum, total, any_classify = totals
        means = {k: v / max(total, 1.0) for k, v in zip(names, values_sum, strict=True)}
        metrics: dict[str, float] = {"eval_loss": means.pop("loss"), "eval_samples": total}
        accuracy = means.pop("accuracy")
        metrics.update(means)  # metrics_fn's, named eval_*
        if any_classify:
            metrics["accuracy"] = accuracy
        return metrics

    def _metric_names(self, sums: dict[str, torch.Tensor]) -> list[str]:
        """The names metrics_fn gave (as eval_<name>), the same list on every rank (rank
        0's: a rank with no eval batch has seen none, and rank 0 has the most samples)."""
        names = [k for k in sums if k not in ("loss", "accuracy")]
        if self.metrics_fn is None:
            return names
        if self.ctx.distributed:
            names = broadcast_object(names)
        for name in set(names) & {"eval_loss", "eval_samples"}:  # every rank raises
            raise ConfigError(
                f"metrics_fn returned {name[5:]!r}, reported as {name}, which is the "
                f"evaluation's own: rename it (e.g. 'my_{name[5:]}')"
            )
        return names

    def _rank_0s_batches(self) -> int:
        """The eval batches rank 0 runs, the most of any rank (shards differ by at most
        one sample)."""
        loader = self.loader
        shard = cast(ShardSampler, loader.sampler)
        longest = math.ceil(
            len(range(0, shard.length, shard.world_size)) / (loader.batch_size or 1)
        )
        if self.config.eval_max_batches is not None:
            longest = min(longest, self.config.eval_max_batches)
        return longest

    def _stand_in_forwards(self, model: nn.Module, count: int) -> None:
        """Run `count` uncounted forwards, so that this rank runs as many as rank 0
        (FSDP's parameter gathers must pair up over the ranks). Each runs the loss's and
        metrics_fn's forwards, as a real batch does (`_forwards`)."""
        loader = self.loader
        # The eval set's first sample stands in (a rank may have had none at all). The
        # loader draws its seed from a generator of its own: from the global one, it
        # would move this rank's random stream (and a resume that evaluates again, at
        # the end of the epoch it saved in, would then drift from the straight run).
        first = DataLoader(
            loader.dataset,
            batch_size=1,
            collate_fn=loader.collate_fn,
            generator=torch.Generator().manual_seed(0),
        )
        stand_in = to_device(next(iter(first)), self.ctx.device)
        for _ in range(count):
            self._forwards(model, stand_in)  # its results are dropped: weight 0

    def _forwards(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, Any, Any]:
        """(loss, the model's outputs or None, metrics_fn's values) of one eval batch.
        A stand-in batch runs exactly these forwards too, so that under FSDP every rank
        gathers as often as the others, whatever metrics_fn does with the model."""
        with self.precision.autocast():
            loss, outputs = self.loss_of(model, batch)
            own = self.metrics_fn(model, batch) if self.metrics_fn else {}
        return loss, outputs, own


def _class_logits(outputs: Any, targets: Any) -> bool:
    """Whether `outputs` are class scores for integer `targets` (accuracy applies)."""
    return (
        isinstance(outputs, torch.Tensor)
        and isinstance(targets, torch.Tensor)
        and outputs.ndim == 2
        and outputs.shape[1] > 1
        and not targets.is_floating_point()
    )


def _length(loader: Any) -> int | None:
    try:
        return len(loader)
    except TypeError:  # an IterableDataset without __len__
        return None

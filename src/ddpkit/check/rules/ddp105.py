"""DDP105: a model with BatchNorm wrapped in DDP without SyncBatchNorm (the DDP tutorial's note)."""

from __future__ import annotations

import re
from collections.abc import Iterator

from ddpkit.check.analysis import FileAnalysis
from ddpkit.check.model import Severity
from ddpkit.check.rules.base import Hit, Rule, argument, is_constant

_BATCH_NORM = re.compile(r"^(?:Lazy)?BatchNorm[123]d$")
# torchvision models built with BatchNorm layers.
_BN_MODELS = re.compile(
    r"^(?:resnet|resnext|wide_resnet|densenet|efficientnet|mobilenet|regnet|inception|"
    r"googlenet|mnasnet|shufflenet|vgg\d+_bn)"
)
# Any of these means the user already handles BatchNorm across ranks.
_SYNCED = ("convert_sync_batchnorm", "convert_syncbn_model", "SyncBatchNorm")
# BatchNorm with fixed statistics (DETR's backbone): nothing to synchronise.
_FROZEN = "FrozenBatchNorm2d"


def _uses_batch_norm(fa: FileAnalysis) -> bool:
    if any(_BATCH_NORM.match(name) for name in fa.index.seen):
        return True
    for name, sites in fa.calls_by_tail.items():
        if not _BN_MODELS.match(name):
            continue
        for site in sites:
            qualified = fa.imports.resolve(site.call.func)
            if qualified is not None and qualified.startswith("torchvision.models."):
                return True
    return False


def _keeps_eval_in_train(fa: FileAnalysis) -> bool:
    """`def train(self, mode=True): super().train(mode); self.backbone.eval()`: the
    frozen part stays in eval mode while training, so its statistics never change."""
    return any(site.scope.is_method and site.scope.name == "train" for site in fa.calls("eval"))


def _frozen_feature_norm(fa: FileAnalysis) -> bool:
    """Every BatchNorm is `affine=False` (a feature normaliser) and the encoder it
    normalises is frozen (`requires_grad_(False)` and `.eval()`)."""
    norms = [
        site
        for name, sites in fa.calls_by_tail.items()
        if _BATCH_NORM.match(name)
        for site in sites
    ]
    if not norms or not all(is_constant(argument(s.call, None, "affine"), False) for s in norms):
        return False
    return bool(fa.calls("requires_grad_") and fa.calls("eval"))


def check(fa: FileAnalysis) -> Iterator[Hit]:
    wraps = fa.ddp_wraps
    if not wraps or any(fa.mentions(name) for name in _SYNCED):
        return
    if not _uses_batch_norm(fa):
        return
    if fa.mentions(_FROZEN) or _keeps_eval_in_train(fa) or _frozen_feature_norm(fa):
        return
    yield (
        wraps[0].node,
        "the model has BatchNorm layers but is wrapped in DDP without SyncBatchNorm, so "
        "each rank normalises with its own small batch's statistics; call "
        "`model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)` before wrapping",
    )


RULE = Rule(
    "DDP105",
    Severity.WARNING,
    "BatchNorm model wrapped in DDP without convert_sync_batchnorm",
    check,
)

"""DDP105: a model with BatchNorm wrapped in DDP without SyncBatchNorm (the DDP tutorial's note)."""

from __future__ import annotations

import re
from collections.abc import Iterator

from ddpkit.check.analysis import FileAnalysis
from ddpkit.check.model import Severity
from ddpkit.check.rules.base import Hit, Rule

_BATCH_NORM = re.compile(r"^(?:Lazy)?BatchNorm[123]d$")
# torchvision models built with BatchNorm layers.
_BN_MODELS = re.compile(
    r"^(?:resnet|resnext|wide_resnet|densenet|efficientnet|mobilenet|regnet|inception|"
    r"googlenet|mnasnet|shufflenet|vgg\d+_bn)"
)
# Any of these means the user already handles BatchNorm across ranks.
_SYNCED = ("convert_sync_batchnorm", "convert_syncbn_model", "SyncBatchNorm")


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


def check(fa: FileAnalysis) -> Iterator[Hit]:
    wraps = fa.ddp_wraps
    if not wraps or any(fa.mentions(name) for name in _SYNCED):
        return
    if not _uses_batch_norm(fa):
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

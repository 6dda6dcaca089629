"""DDP105: a model with BatchNorm wrapped in DDP without SyncBatchNorm (the DDP tutorial's note)."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator

from ddpkit.check.analysis import FileAnalysis
from ddpkit.check.index import Scope, Site
from ddpkit.check.rules.base import Hit, Rule, argument, is_constant
from ddpkit.findings import Severity

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


def _builds_bn_model(fa: FileAnalysis) -> bool:
    """A torchvision model with BatchNorm layers (`torchvision.models.resnet50()`)."""
    for name, sites in fa.calls_by_tail.items():
        if not _BN_MODELS.match(name):
            continue
        for site in sites:
            qualified = fa.imports.resolve(site.call.func)
            if qualified is not None and qualified.startswith("torchvision.models."):
                return True
    return False


def _uses_batch_norm(fa: FileAnalysis) -> bool:
    return any(_BATCH_NORM.match(name) for name in fa.index.seen) or _builds_bn_model(fa)


def _keeps_eval_in_train(fa: FileAnalysis) -> bool:
    """`def train(self, mode=True): super().train(mode); self.backbone.eval()`: the
    frozen part stays in eval mode while training, so its statistics never change."""
    return any(site.scope.is_method and site.scope.name == "train" for site in fa.calls("eval"))


def _freezes_parameters(fa: FileAnalysis) -> bool:
    """`encoder.requires_grad_(False)` or `p.requires_grad = False` somewhere."""
    if any(
        is_constant(argument(s.call, 0, "requires_grad"), False) for s in fa.calls("requires_grad_")
    ):
        return True
    return any(
        isinstance(a.target, ast.Attribute)
        and a.target.attr == "requires_grad"
        and is_constant(a.value, False)
        for a in fa.index.assignments
    )


def _frozen_feature_norm(fa: FileAnalysis) -> bool:
    """Every BatchNorm is `affine=False` (a feature normaliser in front of a linear probe's
    head, MoCo v3 / MAE style) and the encoder it normalises is frozen."""
    norms = {name: sites for name, sites in fa.calls_by_tail.items() if _BATCH_NORM.match(name)}
    if not norms or _builds_bn_model(fa):
        return False
    # A BatchNorm class passed along uncalled (`norm_layer=nn.BatchNorm2d`) has its affine.
    if any(_BATCH_NORM.match(name) and name not in norms for name in fa.index.seen):
        return False
    if not all(
        is_constant(argument(s.call, None, "affine"), False)
        for sites in norms.values()
        for s in sites
    ):
        return False
    return _freezes_parameters(fa)


def _method_calls(fa: FileAnalysis, name: str, method: str, scope: Scope) -> list[Site]:
    return [
        site
        for site in fa.calls(method)
        if site.scope is scope
        and isinstance(site.call.func, ast.Attribute)
        and isinstance(site.call.func.value, ast.Name)
        and site.call.func.value.id == name
    ]


def _frozen_in_eval_mode(fa: FileAnalysis, wrap: Site) -> bool:
    """Linear evaluation of a pretrained network: `model.requires_grad_(False)` (all but
    the head), and `model.eval()` while it trains, with `model.train()` only on another
    branch (fine-tuning), so the BatchNorm layers keep their pretrained statistics."""
    model = argument(wrap.call, 0, "module")
    if not isinstance(model, ast.Name):
        return False
    frozen = any(
        is_constant(argument(s.call, 0, "requires_grad"), False)
        for s in _method_calls(fa, model.id, "requires_grad_", wrap.scope)
    )
    if not frozen or not _method_calls(fa, model.id, "eval", wrap.scope):
        return False
    return all(
        any(isinstance(g.owner, ast.If) for g in s.guards)
        for s in _method_calls(fa, model.id, "train", wrap.scope)
    )


def check(fa: FileAnalysis) -> Iterator[Hit]:
    wraps = fa.ddp_wraps
    if not wraps or any(fa.mentions(name) for name in _SYNCED):
        return
    if not _uses_batch_norm(fa):
        return
    if fa.mentions(_FROZEN) or _keeps_eval_in_train(fa) or _frozen_feature_norm(fa):
        return
    if all(_frozen_in_eval_mode(fa, wrap) for wrap in wraps):
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

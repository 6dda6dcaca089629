"""The Strategy does what depends on it (issue 45): what a checkpoint holds of the model
and optimizer, putting it back, the same-strategy check of a resume, and the model's
whole state. The checkpoint layer, the Trainer, export and verify call it instead of
asking whether the model is sharded; the questions still asked outside `parallel/` are
listed here, so that a new one is added on purpose or not at all.

One process, no collective: the sharded paths run on 2 ranks in test_state_fsdp.py and
test_fsdp.py.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch import nn

import ddpkit
from ddpkit import DistContext
from ddpkit.checkpoint.digest import model_digest
from ddpkit.errors import CheckpointError
from ddpkit.parallel.strategy import Strategy

CTX = DistContext.single("cpu")
SRC = Path(ddpkit.__file__).parent

# "Is it sharded?" asked by name: the strategy's answers, FSDP's own test of a module,
# a checkpoint file's marker, and save_checkpoint's shards.
QUESTION = re.compile(
    r"shards_model|shards_checkpoints|as_sharded\(|get\(.sharded.\)|shards is (not )?None"
)
# Where it is still asked outside parallel/ (the Strategy and the primitives it is made
# of) and check/ (the static checker, which reads user code, not models): the checkpoint
# format on save (a `.pt` file or a `.dcp` folder: save_checkpoint's own `shards`; a
# file is recognised by Strategy.holds_model). The
# Trainer asks none: the Strategy checks its optimizer, says which ranks compute a
# gathered value and how many forwards a rank runs to match the others.
STILL_ASKED = {
    "checkpoint": 1,  # pt.py
}


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.2), nn.BatchNorm1d(8), nn.Linear(8, 2))


def _stepped(model: nn.Module) -> torch.optim.AdamW:
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    loss = model(torch.randn(6, 4)).pow(2).mean()
    loss.backward()
    optimizer.step()
    return optimizer


def test_the_sharded_question_is_asked_only_where_listed() -> None:
    asked: Counter[str] = Counter()
    for path in SRC.rglob("*.py"):
        package = path.relative_to(SRC).parts[0].removesuffix(".py")
        if package in ("parallel", "check"):
            continue
        asked[package] += len(QUESTION.findall(path.read_text()))
    # By package, at most as often as listed: one fewer is progress (lower the number
    # then), one more is a branch that the Strategy should take instead.
    more = {k: v for k, v in asked.items() if v > STILL_ASKED.get(k, 0)}
    assert more == {}, (
        "call the Strategy (checkpoint_tensors, load_checkpoint_tensors, check_resume, "
        "full_state, whole) instead of asking whether the model is sharded"
    )


def test_a_whole_checkpoint_goes_back_through_the_strategy(tmp_path: Path) -> None:
    model = _net()
    optimizer = _stepped(model)
    plan = Strategy("ddp", CTX)
    entries, shards = plan.checkpoint_tensors(model, optimizer)
    assert shards is None and set(entries) == {"model", "optimizer"}
    # As a file holds them: copies, not the live objects.
    state = {k: {**v} for k, v in entries.items()}
    state["model"] = {k: v.clone() for k, v in entries["model"].items()}

    other = _net()
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)
    other_opt = torch.optim.AdamW(other.parameters(), lr=0.01)
    checked: list[Path] = []
    plan.load_checkpoint_tensors(
        tmp_path / "ckpt.pt", state, other, other_opt, lambda m, s, p: checked.append(p)
    )
    assert checked == [tmp_path / "ckpt.pt"]  # the checkpoint layer's check ran first
    assert model_digest(other) == model_digest(model)
    assert other_opt.state_dict()["state"][0]["step"] == optimizer.state_dict()["state"][0]["step"]
    assert plan.full_state(other).keys() == model.state_dict().keys()


def test_an_optimizer_of_another_shape_is_one_line_naming_the_file(tmp_path: Path) -> None:
    model = _net()
    entries, _ = Strategy("ddp", CTX).checkpoint_tensors(model, _stepped(model))
    bigger = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    with pytest.raises(CheckpointError, match="does not fit this optimizer"):
        Strategy("ddp", CTX).load_checkpoint_tensors(
            tmp_path / "ckpt.pt",
            entries,
            model,
            torch.optim.AdamW(bigger.parameters(), lr=0.01),
            lambda m, s, p: None,
        )


@pytest.mark.parametrize(("written", "runs"), [({"sharded": True}, "ddp"), ({}, "fsdp")])
def test_a_resume_under_another_strategy_is_refused_naming_both(
    written: dict[str, bool], runs: str
) -> None:
    was = "fsdp" if written else "ddp"
    with pytest.raises(CheckpointError) as info:
        Strategy(runs, CTX).check_resume(Path("ck/ckpt-000000010.pt"), written)
    assert str(info.value) == (
        f"ck/ckpt-000000010.pt was written with strategy {was} and this run uses {runs}: "
        "resume with the same --strategy"
    )
    Strategy(was, CTX).check_resume(Path("ck/ckpt-000000010.pt"), written)  # the same: fine

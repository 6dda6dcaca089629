"""bench/real: its list of public scripts is well-formed, and its scorer compares what was
measured with what was judged (on a made-up table, without running anything)."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "real.py"
LIST = ROOT / "bench" / "real" / "real.json"


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("real_bench", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["real_bench"] = module
    spec.loader.exec_module(module)
    return module


def test_the_list_has_enough_pinned_scripts_each_judged_in_every_mode() -> None:
    doc = json.loads(LIST.read_text(encoding="utf-8"))
    assert doc["judged"] == "2026-12-04"
    scripts = doc["scripts"]
    assert len(scripts) >= 12
    assert len({s["repo"] for s in scripts}) >= 8
    bench = _bench()
    for s in scripts:
        assert re.fullmatch(r"[0-9a-f]{40}", s["commit"]), s["id"]
        assert s["path"] and not s["path"].startswith("/")
        assert set(s["expect"]) == set(bench.MODES), s["id"]
        for mode, e in s["expect"].items():
            assert e["outcome"] in bench.ALLOWED[mode], (s["id"], mode)
            assert e["why"], (s["id"], mode)
            if e["outcome"] == "findings":
                assert e["codes"], (s["id"], mode)
        assert s.get("shaped_test") or s.get("no_shaped_test"), s["id"]
    paths = {(s["repo"], s["path"]) for s in scripts}
    for must in [
        ("pytorch/examples", "distributed/ddp-tutorial-series/multigpu.py"),
        ("pytorch/examples", "distributed/ddp-tutorial-series/multigpu_torchrun.py"),
        ("pytorch/examples", "distributed/ddp-tutorial-series/single_gpu.py"),
        ("pytorch/examples", "imagenet/main.py"),
        ("karpathy/nanoGPT", "train.py"),
        ("huggingface/pytorch-image-models", "train.py"),
    ]:
        assert must in paths
    assert {"Lightning-AI/pytorch-lightning", "huggingface/accelerate"} <= {
        s["repo"] for s in scripts
    }
    assert len(bench.load(LIST)) == len(scripts)


def test_a_malformed_entry_is_refused_naming_it(tmp_path: Path) -> None:
    doc = json.loads(LIST.read_text(encoding="utf-8"))
    bad = tmp_path / "real.json"
    doc["scripts"][0]["expect"]["run"]["outcome"] = "works"
    bad.write_text(json.dumps(doc), encoding="utf-8")
    with pytest.raises(ValueError, match=r"tutorial-single_gpu .*run outcome 'works'"):
        _bench().load(bad)
    doc["scripts"][0]["expect"]["run"]["outcome"] = "ok"
    doc["scripts"][0]["commit"] = "77f55b9"
    bad.write_text(json.dumps(doc), encoding="utf-8")
    with pytest.raises(ValueError, match="40 hex"):
        _bench().load(bad)


def _made_up(b: ModuleType, name: str, **expect: tuple[str, set[str], set[str]]) -> Any:
    """A script judged as `expect` says (mode: (outcome, codes, tolerated)), n/a elsewhere."""
    judged = {m: b.Expect("n/a", "made up") for m in b.MODES}
    for mode, (outcome, codes, tolerated) in expect.items():
        judged[mode] = b.Expect(outcome, "made up", frozenset(codes), frozenset(tolerated))
    return b.Script(
        id=name,
        repo="o/r",
        commit="0" * 40,
        path="t.py",
        files=(),
        args=(),
        nproc=2,
        cuda=True,
        needs=(),
        setup=(),
        stop_when=None,
        timeout=1.0,
        expect=judged,
    )


def test_the_scorer_on_a_made_up_table() -> None:
    b = _bench()
    tutorial = _made_up(
        b,
        "tutorial",
        run=("fails", set(), set()),
        run_cpu=("ok", set(), set()),
        audit=("findings", {"DDP103", "DDP112"}, set()),
        check=("clean", set(), set()),
        verify_loop=("refused", set(), set()),
    )
    row = b.Row(tutorial)
    row.cells = {
        "run": b.Measured("fails"),
        "run_cpu": b.Measured("ok"),
        "audit": b.Measured("findings", codes=frozenset({"DDP103"})),  # DDP112 missed
        "check": b.Measured("clean"),
        # verify_loop not run
    }
    assert b.score([row]) == (3, 1, 1)
    moco = _made_up(
        b,
        "moco",
        run=("fails", set(), set()),
        run_cpu=("ok", set(), set()),
        audit=("findings", {"DDP103", "DDP111"}, {"DDP104", "DDP105"}),
        check=("findings", {"DDP111"}, {"DDP107"}),
    )
    other = b.Row(moco)
    other.cells = {
        "run": b.Measured("ok"),  # judged: fails
        "run_cpu": b.Measured(b.SKIPPED, note="no --cpu"),
        "audit": b.Measured("findings", codes=frozenset({"DDP103", "DDP104", "DDP111"})),
        "check": b.Measured("findings", codes=frozenset({"DDP111", "DDP103"})),  # DDP103 extra
        "verify_loop": b.Measured("n/a"),
    }
    assert b.score([other]) == (1, 2, 2)
    assert b.agrees(moco.expect["verify_loop"], b.Measured("pass")) is False
    assert b.cell(tutorial.expect["audit"], row.cells["audit"]) == (
        "findings DDP103 != findings DDP103,DDP112"
    )
    assert b.cell(moco.expect["run_cpu"], other.cells["run_cpu"]) == "(ok: skipped)"
    assert b.cell(tutorial.expect["verify_loop"], b.Measured("not run")) == "(refused: not run)"
    text = b.table([row, other], markdown=True)
    assert text.splitlines()[0] == "| script | run | run_cpu | audit | check | verify_loop |"
    assert "| moco | ok != fails |" in text


def test_outcomes_are_read_from_exit_status_and_output() -> None:
    b = _bench()
    crash = "Traceback (most recent call last):\n  ...\nRuntimeError: x\nddpkit: the job failed"
    assert b.classify(0, "") == "ok"
    assert b.classify(1, crash) == "fails"
    assert b.classify(2, "ddpkit run: error: --nproc must be at least 1") == "refused"
    assert b.classify(1, "some output\nexiting") == "fails"
    assert b.classify(None, "") == b.TIMEOUT
    assert b.classify(-2, "", stopped=True) == "ok"
    assert b.classify_verify(0, "PASS") == "pass"
    assert b.classify_verify(1, "FAIL: rank 1 differs") == "differs"
    assert b.classify_verify(1, crash) == "fails"
    assert b.classify_verify(2, "ddpkit verify: main never called prepare_model") == "refused"


def test_tiny_data_is_generated(tmp_path: Path) -> None:
    b = _bench()
    b.make_data(tmp_path, {"kind": "tokens", "dir": "d", "vocab": 65, "tokens": 100})
    assert (tmp_path / "d" / "train.bin").stat().st_size == 200
    b.make_data(
        tmp_path,
        {
            "kind": "images",
            "dir": "i",
            "splits": ["train"],
            "classes": 2,
            "per_class": 2,
            "size": 8,
        },
    )
    png = tmp_path / "i" / "train" / "class1" / "1.png"
    assert png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    b.make_data(tmp_path, {"kind": "mnist", "dir": "m", "train": 3, "test": 2})
    assert (tmp_path / "m" / "train-images-idx3-ubyte").stat().st_size == 16 + 3 * 784
    with pytest.raises(ValueError, match="unknown setup kind"):
        b.make_data(tmp_path, {"kind": "video", "dir": "v"})


def test_scripts_without_their_files_are_skipped_in_one_line_each(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = _bench().main(
        ["--only", "nanogpt,dino", "--work", str(tmp_path / "w"), "--out", str(tmp_path / "o")]
    )
    assert code == 0
    printed = capsys.readouterr().out.splitlines()
    skipped = [line for line in printed if line.startswith("skipped ")]
    assert len(skipped) == 2 and all("files absent" in line for line in skipped)

"""The real-world corpus for `ddpkit check`: it parses, and the scorer skips without files."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "check_corpus.py"
CORPUS = ROOT / "bench" / "corpus" / "corpus.json"


def _scorer() -> ModuleType:
    spec = importlib.util.spec_from_file_location("check_corpus", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["check_corpus"] = module
    spec.loader.exec_module(module)
    return module


def test_corpus_parses_with_enough_pinned_files() -> None:
    doc = json.loads(CORPUS.read_text(encoding="utf-8"))
    files = doc["files"]
    assert len(files) >= 60
    assert len({f["repo"] for f in files}) >= 15
    for f in files:
        assert re.fullmatch(r"[0-9a-f]{40}", f["commit"]), f
        assert f["path"] and not f["path"].startswith("/")
        for exp in f["expected"]:
            # EARLY-EXIT: judged before its rule has a code (issue 44); the scorer skips it.
            assert re.fullmatch(r"DDP\d{3}|EARLY-EXIT", exp["code"]) and exp["why"]
    keys = [(f["repo"], f["path"]) for f in files]
    assert len(keys) == len(set(keys))
    assert len(_scorer().load_corpus(CORPUS)) == len(files)


def test_scorer_skips_cleanly_without_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "result.json"
    code = _scorer().main(["--files", str(tmp_path / "absent"), "--out", str(out)])
    assert code == 0
    printed = capsys.readouterr().out.strip().splitlines()
    assert len(printed) == 1 and "absent" in printed[0]
    assert not out.exists()


def test_expected_codes_the_checker_lacks_are_not_scored(tmp_path: Path) -> None:
    scorer = _scorer()
    program = tmp_path / "owner" / "repo"
    program.mkdir(parents=True)
    (program / "train.py").write_text("import torch\n", encoding="utf-8")
    entry = scorer.Entry(
        "owner/repo",
        "0" * 40,
        "train.py",
        "owner/repo",
        (scorer.Expected("EARLY-EXIT", 1, "a rule judged before it exists"),),
        (),
    )
    score = scorer.score_group("owner/repo", [entry], tmp_path, 0)
    assert (score.tp, score.fn, score.unscored) == (0, 0, 1)

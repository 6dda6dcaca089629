"""The package's layers: `ddpkit.cli` on top, nothing below it imports it, and the
checker never needs torch. Every module is imported for real, and every import
statement (also those inside functions, which run later) is read from the source."""

from __future__ import annotations

import ast
import importlib
import pkgutil
import subprocess
import sys
from pathlib import Path

import ddpkit

PACKAGE = Path(ddpkit.__file__).parent


def _modules() -> list[str]:
    names = ["ddpkit"]
    for info in pkgutil.walk_packages([str(PACKAGE)], prefix="ddpkit."):
        # `__main__` modules are entry points, like the console script: they run the CLI.
        if not info.name.endswith("__main__"):
            names.append(info.name)
    return names


def _source(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    assert spec is not None and spec.origin is not None
    return Path(spec.origin)


def _imported(name: str) -> set[str]:
    """Every module that `name`'s source imports, anywhere in the file."""
    tree = ast.parse(_source(name).read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def test_every_module_imports() -> None:
    for name in _modules():
        importlib.import_module(name)


def test_only_the_cli_imports_the_cli() -> None:
    offenders = {
        name: sorted(m for m in _imported(name) if m == "ddpkit.cli" or m.startswith("ddpkit.cli."))
        for name in _modules()
        if not (name == "ddpkit.cli" or name.startswith("ddpkit.cli."))
    }
    assert {k: v for k, v in offenders.items() if v} == {}


def test_the_checker_never_imports_torch() -> None:
    checker = [n for n in _modules() if n == "ddpkit.check" or n.startswith("ddpkit.check.")]
    assert len(checker) > 10
    for name in checker:
        assert not any(m == "torch" or m.startswith("torch.") for m in _imported(name)), name
    code = (
        "import sys, importlib\n"
        f"for name in {checker!r}: importlib.import_module(name)\n"
        "import ddpkit.cli.check\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_import_ddpkit_stays_lazy() -> None:
    code = "import sys, ddpkit; assert 'torch' not in sys.modules, 'torch was imported'"
    subprocess.run([sys.executable, "-c", code], check=True)

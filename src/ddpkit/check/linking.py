"""Which checked files import which, so that a folder is analysed as one program.

`import utils`, `from util import misc`, `from . import misc`, `from .misc import f`
and `import util.misc as misc` in one checked file bind a local name to another
checked file (a module) or to a name defined there (a member). Imports anywhere among
the statements count, also those in a function body (`def main(): from comm import
reduce_mean`), which bind their names for the whole file unless one at module level
binds the same name; finding them walks statements only, never expressions.

Modules are looked up the way `python script.py` finds them: next to the importing
file, then in the folders above it, as far up as the folder that was checked; and a
package that imports itself by its own name (`from mypkg.util import misc` inside
`mypkg/`, run from the repository root) from the folder that holds it.
"""

from __future__ import annotations

import ast
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class Link:
    """What a local name stands for: a checked file (`member` None) or a name in it."""

    target: int  # the position of the file among the files checked together
    member: str | None


_Import = tuple[ast.Import | ast.ImportFrom, bool]
# The statements that hold no block of statements: most of a file, passed over at once.
_SIMPLE = frozenset(
    {ast.Expr, ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Return, ast.Pass, ast.Raise}
    | {ast.Assert, ast.Delete, ast.Global, ast.Nonlocal, ast.Break, ast.Continue}
)


def imports_in(body: list[ast.stmt], in_function: bool = False) -> list[_Import]:
    """The import statements of a block and of the blocks it holds, in source order,
    each with whether it sits in a function body."""
    found: list[_Import] = []
    _collect_imports(body, in_function, found)
    return found


def _collect_imports(body: list[ast.stmt], in_function: bool, found: list[_Import]) -> None:
    for stmt in body:
        if type(stmt) in _SIMPLE:
            continue
        if isinstance(stmt, (ast.Import, ast.ImportFrom)):
            found.append((stmt, in_function))
            continue
        inner = in_function or isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef))
        for name in ("body", "orelse", "finalbody"):
            block = getattr(stmt, name, None)
            if isinstance(block, list):
                _collect_imports(block, inner, found)
        for part in (*getattr(stmt, "handlers", ()), *getattr(stmt, "cases", ())):
            _collect_imports(part.body, inner, found)


class Linker:
    """Finds the checked file an import names."""

    def __init__(self, files: Sequence[Path], roots: Sequence[Path]) -> None:
        self._position = {path.resolve(): i for i, path in enumerate(files)}
        self._roots = [root.resolve() for root in roots]
        # What `_find` gave, by the importing file's folder, level and module: the files
        # of a folder import the same modules (`torch`, `os`) over and over.
        self._found: dict[tuple[Path, int, str], int | None] = {}

    def _bases(self, folder: Path) -> list[Path]:
        """The importing file's folder and the folders above it, up to a checked root."""
        root = next((r for r in self._roots if folder == r or r in folder.parents), folder)
        bases = [folder]
        while folder != root and folder.parent != folder:
            folder = folder.parent
            bases.append(folder)
        return bases

    def _module(self, base: Path, dotted: str) -> int | None:
        parts = [p for p in dotted.split(".") if p]
        path = base.joinpath(*parts)
        found = self._position.get(path.with_suffix(".py")) if parts else None
        return found if found is not None else self._position.get(path / "__init__.py")

    def _find(self, importer: Path, level: int, dotted: str) -> int | None:
        key = (importer.parent, level, dotted)
        if key not in self._found:
            self._found[key] = self._look_up(importer.parent, level, dotted)
        return self._found[key]

    def _look_up(self, folder: Path, level: int, dotted: str) -> int | None:
        """The checked file that `dotted` names, imported by a file of `folder`."""
        if level:
            base = folder
            for _ in range(level - 1):
                base = base.parent
            return self._module(base, dotted)
        for base in self._bases(folder):
            found = self._module(base, dotted)
            if found is not None:
                return found
        # `from mypkg.util import misc` inside `mypkg/`: the package by its own name.
        package = dotted.partition(".")[0]
        for above in (folder, *folder.parents):
            if above.name == package:
                return self._module(above.parent, dotted)
        return None

    def links(self, path: Path, tree: ast.Module) -> dict[str, Link]:
        """Local names of `path` (dotted for `import a.b`) bound to checked files."""
        importer = path.resolve()
        links: dict[str, Link] = {}
        in_functions: dict[str, Link] = {}
        for node, in_function in imports_in(tree.body):
            bound = in_functions if in_function else links
            if isinstance(node, ast.Import):
                for alias in node.names:
                    target = self._find(importer, 0, alias.name)
                    if target is not None:
                        bound[alias.asname or alias.name] = Link(target, None)
                continue
            module = node.module or ""
            for alias in node.names:
                if alias.name == "*":
                    continue
                local = alias.asname or alias.name
                sub = self._find(importer, node.level, f"{module}.{alias.name}")
                if sub is not None:
                    bound[local] = Link(sub, None)
                    continue
                owner = self._find(importer, node.level, module)
                if owner is not None:
                    bound[local] = Link(owner, alias.name)
        return in_functions | links

"""Which checked files import which, so that a folder is analysed as one program.

`import utils`, `from util import misc`, `from . import misc`, `from .misc import f`
and `import util.misc as misc` in one checked file bind a local name to another
checked file (a module) or to a name defined there (a member). Only the imports at
the top of a file (also inside `if`/`try` there) are followed: that is where people
put them, and finding them needs no walk of the whole tree.

Modules are looked up the way `python script.py` finds them: next to the importing
file, then in the folders above it, as far up as the folder that was checked.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class Link:
    """What a local name stands for: a checked file (`member` None) or a name in it."""

    target: int  # the position of the file among the files checked together
    member: str | None


def top_imports(body: list[ast.stmt]) -> Iterator[ast.Import | ast.ImportFrom]:
    """The import statements at module level, also those inside `if`/`try` blocks there."""
    for stmt in body:
        if isinstance(stmt, (ast.Import, ast.ImportFrom)):
            yield stmt
        elif isinstance(stmt, ast.If):
            yield from top_imports(stmt.body)
            yield from top_imports(stmt.orelse)
        elif isinstance(stmt, ast.Try):
            yield from top_imports(stmt.body)
            for handler in stmt.handlers:
                yield from top_imports(handler.body)
            yield from top_imports(stmt.orelse)


class Linker:
    """Finds the checked file an import names."""

    def __init__(self, files: Sequence[Path], roots: Sequence[Path]) -> None:
        self._position = {path.resolve(): i for i, path in enumerate(files)}
        self._roots = [root.resolve() for root in roots]

    def _bases(self, importer: Path) -> list[Path]:
        """The importing file's folder and the folders above it, up to a checked root."""
        folder = importer.parent
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
        if level:
            base = importer.parent
            for _ in range(level - 1):
                base = base.parent
            return self._module(base, dotted)
        for base in self._bases(importer):
            found = self._module(base, dotted)
            if found is not None:
                return found
        return None

    def links(self, path: Path, tree: ast.Module) -> dict[str, Link]:
        """Local names of `path` (dotted for `import a.b`) bound to checked files."""
        importer = path.resolve()
        links: dict[str, Link] = {}
        for node in top_imports(tree.body):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    target = self._find(importer, 0, alias.name)
                    if target is None:
                        continue
                    links[alias.asname or alias.name] = Link(target, None)
                continue
            module = node.module or ""
            for alias in node.names:
                if alias.name == "*":
                    continue
                local = alias.asname or alias.name
                sub = self._find(importer, node.level, f"{module}.{alias.name}")
                if sub is not None:
                    links[local] = Link(sub, None)
                    continue
                owner = self._find(importer, node.level, module)
                if owner is not None:
                    links[local] = Link(owner, alias.name)
        return links

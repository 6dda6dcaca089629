"""Which library object an expression names, through the file's own imports.

`import torch.distributed as dist` makes `dist.barrier` resolve to
`torch.distributed.barrier`; `from torch.distributed import barrier as b` makes `b`
resolve to the same. Collectives have common names (`reduce`, `gather`), so rules
that would misfire on `functools.reduce` or `torch.gather` insist on a resolved name.
"""

from __future__ import annotations

import ast

# Submodules that re-export what users import from the package itself.
_CANONICAL_PREFIXES = (
    ("torch.distributed.distributed_c10d.", "torch.distributed."),
    ("torch.distributed.c10d.", "torch.distributed."),
    # `funcol.all_reduce(x, ...)` waits for every rank of its group just the same.
    ("torch.distributed._functional_collectives.", "torch.distributed."),
)


def dotted(expr: ast.expr) -> str | None:
    """`a.b.c` for a chain of attributes on a name, as written; None for anything else."""
    parts: list[str] = []
    while isinstance(expr, ast.Attribute):
        parts.append(expr.attr)
        expr = expr.value
    if not isinstance(expr, ast.Name):
        return None
    parts.append(expr.id)
    return ".".join(reversed(parts))


def tail(expr: ast.expr) -> str | None:
    """The last name of `a.b.c` (`c`) or of a bare name; None for calls, subscripts, ..."""
    if isinstance(expr, ast.Attribute):
        return expr.attr
    if isinstance(expr, ast.Name):
        return expr.id
    return None


class Imports:
    """The names a file's imports bind, and what they stand for."""

    def __init__(self) -> None:
        self.aliases: dict[str, str] = {}
        # Modules imported with `from M import *`: their names can appear bare.
        self.star_modules: set[str] = set()
        self._memo: dict[int, str | None] = {}

    def add(self, node: ast.Import | ast.ImportFrom) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    self.aliases[alias.asname] = alias.name
                else:
                    # `import torch.distributed` binds `torch`.
                    top = alias.name.split(".", 1)[0]
                    self.aliases[top] = top
            return
        module = ("." * node.level) + (node.module or "")
        for alias in node.names:
            if alias.name == "*":
                self.star_modules.add(module)
            else:
                self.aliases[alias.asname or alias.name] = f"{module}.{alias.name}"

    def resolve(self, expr: ast.expr) -> str | None:
        """The fully qualified name `expr` denotes, or None when no import explains it."""
        key = id(expr)
        if key in self._memo:
            return self._memo[key]
        result: str | None = None
        name = dotted(expr)
        if name is not None:
            head, _, rest = name.partition(".")
            base = self.aliases.get(head)
            if base is not None:
                result = f"{base}.{rest}" if rest else base
                for prefix, canonical in _CANONICAL_PREFIXES:
                    if result.startswith(prefix):
                        result = canonical + result[len(prefix) :]
        self._memo[key] = result
        return result

    def resolves_to(self, expr: ast.expr, module: str, names: frozenset[str]) -> str | None:
        """The member of `module` in `names` that `expr` denotes, else None.

        A bare name also counts when the file star-imports `module`.
        """
        qualified = self.resolve(expr)
        if qualified is not None:
            mod, _, member = qualified.rpartition(".")
            return member if mod == module and member in names else None
        if (
            isinstance(expr, ast.Name)
            and expr.id in names
            and module in self.star_modules
            and expr.id not in self.aliases
        ):
            return expr.id
        return None

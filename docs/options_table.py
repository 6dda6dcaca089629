"""The table of every `TrainConfig` option in docs/options.md, built from the dataclass.

Each row comes from one field of `ddpkit.training.config.TrainConfig`: its name, its
`ddpkit train` flag, its type and range (the field's annotation and `ge`/`gt` metadata),
its default, and its documentation (the docstring written under the field, which the API
reference shows too). So the table cannot fall behind the code:

- mkdocs runs this file as a hook (`hooks:` in mkdocs.yml): the site's options page gets
  the table made from the fields at build time;
- the copy committed in docs/options.md, between the two markers, is what a reader of
  the repository sees; tests/test_docs.py fails when it differs from what the fields
  say, and `python docs/options_table.py` writes it afresh.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import sys
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from ddpkit.training import config

PAGE = Path(__file__).with_name("options.md")
START = "<!-- options table: generated from TrainConfig by docs/options_table.py -->"
END = "<!-- end of the options table -->"


def field_docs() -> dict[str, str]:
    """Each field's docstring (the string right under it), as one line of Markdown."""
    tree = ast.parse(Path(inspect.getfile(config)).read_text())
    (cls,) = [
        node
        for node in tree.body
        if isinstance(node, ast.ClassDef) and node.name == config.TrainConfig.__name__
    ]
    docs: dict[str, str] = {}
    for node, after in zip(cls.body, cls.body[1:], strict=False):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = " ".join(inspect.cleandoc(after.value.value).split())
    return docs


def _choices(kind: Any) -> str:
    return ", ".join(f'`"{choice}"`' for choice in typing.get_args(kind))


def _value(field: dataclasses.Field[Any]) -> str:
    """What the field takes, in words: `an int ≥ 1`, `"epoch" or "step"`, ..."""
    kind, optional = config.field_type(field.name)
    if typing.get_origin(kind) is Literal:
        words = "one of " + _choices(kind)
    elif typing.get_origin(kind) is Sequence:
        words = "a list of " + _choices(typing.get_args(kind)[0])
    else:
        words = {int: "an int", float: "a number", str: "a string", bool: "a bool"}[kind]
    for key, sign in (("ge", "≥"), ("gt", ">")):
        bound = field.metadata[key]
        if bound is not None:
            words += f" {sign} {bound:g}"
    return words + (", or `None`" if optional else "")


def _flag(field: dataclasses.Field[Any]) -> str:
    kind, _ = config.field_type(field.name)
    flag = "--" + field.name.replace("_", "-")
    if kind is bool:
        return f"`{flag}`, `--no-{flag[2:]}`"
    if typing.get_origin(kind) is Sequence:
        return f"`{flag} NAME,NAME`"
    return f"`{flag}`"


def _default(field: dataclasses.Field[Any]) -> str:
    default = field.default
    return "`[]`" if default == () else f"`{default!r}`".replace("'", '"')


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def options_table() -> str:
    """The Markdown table of every TrainConfig field, in the dataclass's order."""
    docs = field_docs()
    rows = [
        "| option | flag | value | default | what it does |",
        "|---|---|---|---|---|",
    ]
    for field in dataclasses.fields(config.TrainConfig):
        doc = docs.get(field.name) or field.metadata["help"]
        cells = [f"`{field.name}`", _flag(field), _value(field), _default(field), doc]
        rows.append("| " + " | ".join(_cell(cell) for cell in cells) + " |")
    return "\n".join(rows)


def with_table(markdown: str) -> str:
    """`markdown` with the table between START and END made afresh."""
    head, found, rest = markdown.partition(START)
    if not found:
        return markdown
    _, found, tail = rest.partition(END)
    assert found, f"{START!r} without {END!r}"
    return f"{head}{START}\n{options_table()}\n{END}{tail}"


def on_page_markdown(markdown: str, /, **kwargs: Any) -> str:
    """mkdocs' hook: every page's Markdown passes here before it is rendered."""
    return with_table(markdown)


if __name__ == "__main__":
    PAGE.write_text(with_table(PAGE.read_text()))
    sys.stdout.write(f"wrote the options table of {PAGE}\n")

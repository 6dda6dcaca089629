"""The benchmarks' tables: aligned columns for a terminal, or markdown for the docs."""

from __future__ import annotations


def format_table(head: list[str], body: list[list[str]], markdown: bool) -> str:
    """`head` and `body` (cells already formatted) as a table: the first column left
    aligned, the numbers right aligned."""
    if markdown:
        lines = [
            "| " + " | ".join(head) + " |",
            "|" + "|".join(["---"] + ["--:"] * (len(head) - 1)) + "|",
        ]
        return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in body])
    widths = [max(len(x) for x in col) for col in zip(head, *body, strict=True)]

    def fmt(row: list[str]) -> str:
        return "  ".join(
            cell.ljust(w) if i == 0 else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        )

    return "\n".join([fmt(head), "  ".join("-" * w for w in widths), *map(fmt, body)])

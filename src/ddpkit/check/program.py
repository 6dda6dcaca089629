"""Checking a folder as one program: the files it holds, linked through their imports.

`utils.init_distributed_mode(args)` in `main.py` runs the `init_process_group` of
`utils.py` on every rank; `MetricLogger` of `util/misc.py` is built in `engine.py`.
Each file still gets its own findings, but where code runs (the call graph) and
whether the group is ever destroyed are answered for the files together.
"""

from __future__ import annotations

import ast
from collections.abc import Sequence
from functools import cache
from pathlib import Path

from ddpkit.check.analysis import FileAnalysis
from ddpkit.check.callgraph import CallGraph
from ddpkit.check.index import defined_names
from ddpkit.check.linking import Link, Linker
from ddpkit.check.ranks import RankFacts, RankModel


def _components(links: Sequence[dict[str, Link]]) -> list[int]:
    """For each file, a representative of the files it is connected to by imports."""
    parent = list(range(len(links)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for i, file_links in enumerate(links):
        for link in file_links.values():
            a, b = find(i), find(link.target)
            if a != b:
                parent[a] = b
    return [find(i) for i in range(len(links))]


def _imported(links: Sequence[dict[str, Link]], position: int) -> set[int]:
    """The files that a file imports, directly or through the files it imports."""
    found: set[int] = set()
    stack = [link.target for link in links[position].values()]
    while stack:
        target = stack.pop()
        if target not in found:
            found.add(target)
            stack.extend(link.target for link in links[target].values())
    return found


def analyse_program(
    files: Sequence[tuple[Path, ast.Module]], roots: Sequence[Path]
) -> list[FileAnalysis]:
    """One `FileAnalysis` per file, in order, sharing one call graph."""
    linker = Linker([path for path, _ in files], roots)
    links = [linker.links(path, tree) for path, tree in files]
    names: dict[int, frozenset[str]] = {}
    analyses: list[FileAnalysis] = []
    for position, ((_, tree), file_links) in enumerate(zip(files, links, strict=True)):
        linked = {local.rpartition(".")[2] for local in file_links}
        # Also the names of the files those import, and so on: `model.save(step)` calls a
        # method of a class that a factory of an imported file builds from a third one.
        for target in _imported(links, position):
            if target not in names:
                names[target] = frozenset(defined_names(files[target][1]))
            linked |= names[target]
        analyses.append(FileAnalysis(tree, file_links, frozenset(linked)))
        analyses[-1].position = position
    if len(analyses) < 2:
        return analyses

    @cache
    def shared() -> CallGraph:
        return CallGraph([fa.unit for fa in analyses])

    groups: dict[int, list[FileAnalysis]] = {}
    for fa, group in zip(analyses, _components(links), strict=True):
        fa.peers = groups.setdefault(group, [])
        fa.peers.append(fa)
    for fa in analyses:
        if len(fa.peers) > 1:
            fa.shared_callgraph = shared
    for members in groups.values():
        if len(members) < 2:
            continue
        facts = RankFacts()
        for fa in members:
            fa.rank_facts = facts
        # A first pass over every file, so that each file's own model (built when a
        # rule asks) sees what the others show: `args.rank` set in `utils.py`.
        for fa in members:
            RankModel(fa.index, by_name=False, facts=facts)
    return analyses

"""Everything the rules ask about one file, computed once and shared.

`FileAnalysis` joins the index (one walk of the tree), the rank model (which
conditions depend on the rank) and the call graph (where each function runs), and
answers the questions rules have in common: which calls go to which library
function, is this a DDP script, does this call run on every rank or only on some.
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

from ddpkit.check.callgraph import CallGraph, Context, Unit
from ddpkit.check.index import Guard, Index, Ref, Scope, Site, build_index
from ddpkit.check.linking import Link
from ddpkit.check.names import tail
from ddpkit.check.paths import Divergence, PathModel, on_error_path
from ddpkit.check.ranks import SPAWNERS, RankFacts, RankModel

DDP_CLASS = "DistributedDataParallel"
# ddpkit's own API (`launch`, `prepare_model`, `prepare_loader`), which scripts written
# with it use instead of torchrun's calls.
DDPKIT = "ddpkit"


# How many callers deep `runs_normally` looks before it takes the code to run.
_MAX_HOPS = 4


def _has_base(peers: list[FileAnalysis], method: Scope) -> bool:
    """The class of `method` derives from something other than `object`."""
    for peer in peers:
        info = peer.index.classes.get(method.class_name or "")
        if info is not None and method in info.methods.values():
            return any(base != "object" for base in info.bases)
    return False


def _is_main_block(test: ast.expr) -> bool:
    """`__name__ == "__main__"`."""
    return (
        isinstance(test, ast.Compare)
        and isinstance(test.left, ast.Name)
        and test.left.id == "__name__"
        and len(test.comparators) == 1
        and isinstance(test.comparators[0], ast.Constant)
        and test.comparators[0].value == "__main__"
    )


@dataclass(frozen=True)
class RankOnly:
    """Why a piece of code runs on some ranks only."""

    guard: Guard | None  # the rank condition (in the caller when `via` is set)
    via: Scope | None  # the function through which it is reached, if not direct
    # The line of the guard (or of the guarded call of `via`), for messages.
    line: int
    # The two ranks that the guard tells apart (None through a decorator).
    divergence: Divergence | None = None
    # True when the rank test is a rank by data flow (see `RankModel`), not by its name.
    proven: bool = False


class FileAnalysis:
    """One file; checked with a folder, it also sees the files it imports or is imported by.

    `links` binds local names to other checked files (see `linking.py`), `linked_names`
    are the names those files may provide; `program.py` fills in `peers` (the files
    analysed together with this one, itself included) and the shared call graph;
    `release()` drops them once the rules have run.
    """

    def __init__(
        self,
        tree: ast.Module,
        links: dict[str, Link] | None = None,
        linked_names: frozenset[str] = frozenset(),
    ) -> None:
        self.tree = tree
        self.index: Index = build_index(tree, linked_names)
        self.imports = self.index.imports
        self.links: dict[str, Link] = links or {}
        # Empty when checked alone (a list holding `self` would be a reference cycle).
        self.peers: list[FileAnalysis] = []
        # This file's place among the files checked together (what `Link.target` counts).
        self.position = 0
        self.shared_callgraph: Callable[[], CallGraph] | None = None
        # Shared with the other files of the program by `program.py`.
        self.rank_facts: RankFacts | None = None
        self.calls_by_tail = self.index.calls_by_tail

    @cached_property
    def ranks(self) -> RankModel:
        return RankModel(self.index)

    @cached_property
    def proven(self) -> RankModel:
        """Ranks by data flow only: what an error-level finding rests on."""
        return RankModel(self.index, by_name=False, facts=self.rank_facts)

    @cached_property
    def paths(self) -> PathModel:
        return PathModel(self.ranks.is_rank_condition)

    @cached_property
    def unit(self) -> Unit:
        return Unit(
            self.index, self.ranks, self.paths, self.proven, self.links, self.runs_as_script
        )

    def is_proven(self, divergence: Divergence, scope: Scope) -> bool:
        """The rank test that tells the two ranks apart is a rank by data flow."""
        return self.proven.is_rank_condition(divergence.atom, scope)

    @cached_property
    def callgraph(self) -> CallGraph:
        if self.shared_callgraph is not None:
            return self.shared_callgraph()
        return CallGraph([self.unit])

    def release(self) -> None:
        """Drop the links to the other files (they form reference cycles)."""
        self.peers = []
        self.shared_callgraph = None
        self.__dict__.pop("callgraph", None)

    @cached_property
    def runs_as_script(self) -> bool:
        """The file has an `if __name__ == "__main__":` block at module level."""
        return any(isinstance(s, ast.If) and _is_main_block(s.test) for s in self.tree.body)

    def imported_by_a_script(self) -> bool:
        """Another file of the program that runs as a script imports this one."""
        return any(
            peer is not self
            and peer.runs_as_script
            and any(link.target == self.position for link in peer.links.values())
            for peer in self.peers
        )

    def served_files(self) -> list[FileAnalysis]:
        """This file, the files that import it (directly or not), and all those import:
        the code that runs with it. A separate entry point of the same folder (a test
        that starts its own group, another script sharing the helpers) is left out."""
        peers = self.peers or [self]
        importers = {self.position}
        while grown := {
            p.position
            for p in peers
            if p.position not in importers and any(k.target in importers for k in p.links.values())
        }:
            importers |= grown
        served = set(importers)
        while grown := {
            link.target
            for p in peers
            if p.position in served
            for link in p.links.values()
            if link.target not in served
        }:
            served |= grown
        return [p for p in peers if p.position in served]

    def program_reaches(self, name: str, served_only: bool = False) -> bool:
        """True when code that runs when nothing fails (see `runs_normally`), in this file
        or a file analysed with it (with `served_only`, one of `served_files`), calls
        `name` or hands it on (`atexit.register(name)`), not behind a rank test (a destroy
        in the else of `if rank == 0:` leaves rank 0 without one)."""
        for peer in self.served_files() if served_only else self.peers or [self]:
            if name not in peer.index.seen:
                continue
            for site in peer.index.calls:
                call = site.call
                named = tail(call.func) == name or any(tail(a) == name for a in call.args)
                if (
                    named
                    and not peer.on_error_path(site)
                    and self.callgraph.reachable(site.scope)
                    and self.runs_normally(site.scope)
                    and peer.paths.divergence(site.guards, site.scope) is None
                ):
                    return True
        return False

    def on_error_path(self, site: Site) -> bool:
        """The call or mention at `site` runs only when something failed: inside `except`,
        or in an `if` branch that ends in `raise` or `sys.exit(1)`."""
        call = site.call_expr if isinstance(site, Ref) else site.node
        return id(call) in self.index.calls_in_except or on_error_path(site.guards)

    def runs_normally(self, scope: Scope, _depth: int = 0) -> bool:
        """Code in `scope` runs on a way through the program where nothing fails: module
        level does, and a function that such code mentions outside an error path (a
        `cleanup()` called only in `except`, or a `close()` method that nothing calls,
        does not). Dunder methods and the methods of a class with a base (hooks that a
        framework calls) do, and in a library, whose callers are elsewhere, all code does."""
        peers = self.peers or [self]
        if scope.is_module or _depth > _MAX_HOPS or not any(p.runs_as_script for p in peers):
            return True
        if scope.is_method and (scope.name.startswith("__") or _has_base(peers, scope)):
            return True
        return any(
            ref.name == scope.name
            and ref.scope is not scope
            and not peer.on_error_path(ref)
            and self.runs_normally(ref.scope, _depth + 1)
            for peer in peers
            for ref in peer.index.refs
        )

    # -- finding calls ----------------------------------------------------------------

    def calls(self, *names: str) -> list[Site]:
        """Calls whose callee's last name is one of `names` (`dist.barrier`, `barrier`)."""
        if len(names) == 1:
            return self.calls_by_tail.get(names[0], [])
        return [site for name in names for site in self.calls_by_tail.get(name, ())]

    def resolved_calls(self, module: str, names: frozenset[str]) -> list[tuple[Site, str]]:
        """Calls that resolve through the imports to `module.<name>`, with that name."""
        found = []
        for name in names:
            for site in self.calls_by_tail.get(name, ()):
                member = self.imports.resolves_to(site.call.func, module, names)
                if member is not None:
                    found.append((site, member))
        return found

    def mentions(self, name: str) -> bool:
        """True when `name` is read anywhere (as a name or an attribute), even in `except`."""
        return name in self.index.seen or name in self.index.seen_in_except

    def callees(self, ref: Ref) -> list[Scope]:
        """The functions of the program that a mention in this file surely stands for."""
        return self.callgraph.callees(self.unit, ref)

    def home_of(self, scope: Scope) -> FileAnalysis | None:
        """The file, among those analysed with this one, that defines `scope`."""
        root = scope
        while root.parent is not None:
            root = root.parent
        return next((p for p in self.peers or [self] if p.index.module is root), None)

    @cached_property
    def process_group_inits(self) -> list[Site]:
        return self.calls("init_process_group")

    @cached_property
    def ddp_names(self) -> frozenset[str]:
        """Names the DDP class goes by here: DistributedDataParallel and import aliases (DDP)."""
        names = {DDP_CLASS}
        names.update(
            alias for alias, q in self.imports.aliases.items() if q.endswith("." + DDP_CLASS)
        )
        return frozenset(names)

    @cached_property
    def ddp_wraps(self) -> list[Site]:
        """Calls that wrap a model in DistributedDataParallel, in source order."""
        sites = [site for name in self.ddp_names for site in self.calls_by_tail.get(name, ())]
        return sorted(sites, key=lambda s: (s.line, s.call.col_offset))

    def is_ddp_wrap(self, node: ast.expr) -> bool:
        """`DDP(model, ...)`, or ddpkit's `prepare_model(model, ctx)` (DDP unless told
        to shard with FSDP)."""
        if not isinstance(node, ast.Call):
            return False
        if tail(node.func) in self.ddp_names:
            return True
        if self.imports.resolves_to(node.func, DDPKIT, frozenset({"prepare_model"})) is None:
            return False
        strategy = next((k.value for k in node.keywords if k.arg == "strategy"), None)
        return strategy is None or (isinstance(strategy, ast.Constant) and strategy.value == "ddp")

    def ddpkit_calls(self, name: str) -> list[Site]:
        """Calls of ddpkit's own `name` (`ddpkit.launch`, or `launch` imported from it)."""
        return [site for site, _ in self.resolved_calls(DDPKIT, frozenset({name}))]

    @cached_property
    def joins_process_group(self) -> bool:
        """The file's code runs as the ranks of a process group: it calls
        `init_process_group`, or hands a function to `ddpkit.launch`, which starts the
        group on every rank before calling it."""
        return bool(self.process_group_inits or self.ddpkit_calls("launch"))

    def in_process_group(self, scope: Scope) -> bool:
        """Code in `scope` runs in the ranks of a process group: its file joins one, or
        code of the program that starts one calls it (`dist_utils.init_distributed()` in
        the script, then `model.save(step)` of a class in `models/`)."""
        return self.joins_process_group or scope in self.callgraph.group_code

    @cached_property
    def is_ddp_script(self) -> bool:
        """The file sets up or uses DDP itself (rather than being a plain training script)."""
        return bool(self.process_group_inits or self.ddp_wraps or self.calls("DistributedSampler"))

    # -- where code runs ----------------------------------------------------------------

    def runs_on_every_rank(self, site: Site) -> bool:
        """True only when sure: no rank guard around it and its function runs on every rank."""
        if self.ranks.rank_guard(site.guards, site.scope) is not None:
            return False
        return self.callgraph.context(site.scope) is Context.ALL

    def rank_only(self, site: Site) -> RankOnly | None:
        """Why `site` runs on some ranks only, or None when it may run on all of them.

        Its own guards count as one condition (see `paths.py`); through its callers,
        the call graph's GUARDED context and the guard of the mention that shows it.
        """
        found = self.paths.divergence(site.guards, site.scope)
        if found is not None:
            proven = self.is_proven(found, site.scope)
            return RankOnly(found.guard, None, found.guard.test.lineno, found, proven)
        if self.callgraph.context(site.scope) is not Context.GUARDED:
            return None
        witness = self.callgraph.witness(site.scope)
        if witness is None:
            # A `@rank_zero_only`-style decorator: the library runs it on rank 0 only.
            return RankOnly(None, site.scope, getattr(site.scope.node, "lineno", 1), None, True)
        line = witness.guard.test.lineno if witness.guard is not None else witness.ref.line
        # The proof lies where the chain of callers meets its rank test.
        edge, seen = witness, {site.scope}
        while edge.guard is None and edge.owner is not None and edge.owner not in seen:
            seen.add(edge.owner)
            caller = self.callgraph.witness(edge.owner)
            if caller is None:  # a `@rank_zero_only`-style decorator further up
                return RankOnly(witness.guard, site.scope, line, None, True)
            edge = caller
        return RankOnly(witness.guard, site.scope, line, edge.divergence, edge.proven)

    @cached_property
    def launcher_scopes(self) -> set[Scope]:
        """Scopes that start the ranks with `mp.spawn(...)`."""
        return {site.scope for site in self.calls(*SPAWNERS)}

    def in_launcher(self, site: Site) -> bool:
        """Code of the parent process that spawns the ranks: it is not a rank itself."""
        launchers = self.launcher_scopes
        if not launchers:
            return False
        if not site.scope.is_module:
            return site.scope in launchers
        return any(_is_main_block(g.test) for g in site.guards)

    @cached_property
    def functions_in_loops(self) -> set[Scope]:
        return self.callgraph.called_in_loops()

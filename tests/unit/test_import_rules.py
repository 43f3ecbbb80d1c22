"""Tessera's import rules, read from the source with ``ast`` (function-level imports included): no import
cycles among its modules, and each layer imports only what lies beneath it (style.md, item 15)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SOURCE_ROOTS = (REPO / "platform" / "src", REPO / "operators" / "src")
PACKAGES = ("tessera", "tessera_operators")

# (importer prefix, forbidden prefixes): a module under the importer may import none of them.
LAYER_RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("tessera.routing", ("tessera.engine", "tessera.gateway")),
    ("tessera.asgi", ("tessera",)),
    ("tessera.registry", ("tessera.engine", "tessera.gateway", "tessera.routing")),
    ("tessera.engine.protocol", ("tessera",)),
)


def _module_files() -> Iterator[tuple[str, Path]]:
    for root in SOURCE_ROOTS:
        for package in PACKAGES:
            for path in sorted((root / package).rglob("*.py")):
                parts = list(path.relative_to(root).with_suffix("").parts)
                if parts[-1] == "__init__":
                    parts.pop()
                yield ".".join(parts), path


MODULES: dict[str, Path] = dict(_module_files())


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _resolve(name: str) -> str | None:
    """The known module ``name`` is, or lies in (``from pkg.mod import func`` names ``pkg.mod.func``)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(module: str) -> set[str]:
    """Every Tessera module ``module`` imports, at any depth of its code (functions, ``TYPE_CHECKING``)."""
    path = MODULES[module]
    return imports_in(path.read_text(), module, is_package=path.name == "__init__.py")


def imports_in(source: str, module: str, is_package: bool = False) -> set[str]:
    package = module if is_package else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source, module)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            names = [f"{base}.{alias.name}" for alias in node.names] + [base]
        for name in names:
            target = _resolve(name)
            if target is not None and target != module:
                found.add(target)
    return found


GRAPH: dict[str, set[str]] = {module: imports_of(module) for module in MODULES}


def _ancestors(module: str) -> set[str]:
    """Importing ``a.b.c`` runs ``a/__init__`` and ``a/b/__init__`` first: not edges of a cycle of its own."""
    parts = module.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each strongly connected group of two or more modules, as one cycle through it (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []
    counter = 0
    edges = {m: sorted(t for t in targets if t not in _ancestors(m)) for m, targets in graph.items()}
    for root in sorted(graph):
        if root in index:
            continue
        work: list[tuple[str, int]] = [(root, 0)]
        while work:
            node, i = work.pop()
            if i == 0:
                index[node] = low[node] = counter
                counter += 1
                stack.append(node)
                on_stack.add(node)
            targets = edges[node]
            if i < len(targets):
                work.append((node, i + 1))
                target = targets[i]
                if target not in index:
                    work.append((target, 0))
                elif target in on_stack:
                    low[node] = min(low[node], index[target])
                continue
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    groups.append(_one_cycle(sorted(group), edges))
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
    return groups


def _one_cycle(group: list[str], edges: dict[str, list[str]]) -> list[str]:
    """A shortest path from the group's first module back to itself, within the group (breadth first)."""
    start, members = group[0], set(group)
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for target in edges[node]:
                if target == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [*reversed(path), start]
                if target in members and target not in came_from:
                    came_from[target] = node
                    following.append(target)
        frontier = following
    raise AssertionError(f"not a cycle: {group}")


def test_the_scan_sees_the_packages() -> None:
    assert {"tessera.gateway.app", "tessera.routing.policies", "tessera_operators.kvcontrol.ledger"} <= set(MODULES)
    # A function-level import is an edge too, and a relative one resolves against the module's package.
    source = "def f():\n    from .policies import make_policy\n    import tessera.registry\n"
    assert imports_in(source, "tessera.routing.router") == {"tessera.routing.policies", "tessera.registry"}


def test_cycle_finder_reports_the_cycle() -> None:
    graph = {"a.x": {"a.y"}, "a.y": {"a.z"}, "a.z": {"a.x"}, "a.w": {"a.x"}}
    assert find_cycles(graph) == [["a.x", "a.y", "a.z", "a.x"]]
    assert find_cycles({"a.x": {"a.y"}, "a.y": set()}) == []


def test_no_import_cycles() -> None:
    cycles = find_cycles(GRAPH)
    assert not cycles, "import cycles (one per group of modules that import each other):\n" + "\n".join(
        " -> ".join(cycle) for cycle in cycles)


@pytest.mark.parametrize(("importer", "forbidden"), LAYER_RULES, ids=[rule[0] for rule in LAYER_RULES])
def test_layer_rules(importer: str, forbidden: tuple[str, ...]) -> None:
    broken = sorted(f"{module} imports {target}"
                    for module, targets in GRAPH.items() if _within(module, importer)
                    for target in targets if any(_within(target, f) for f in forbidden))
    assert importer in MODULES or any(_within(m, importer) for m in MODULES), f"no module {importer}"
    assert not broken, "\n".join(broken)


# What each package may import from the others (docs/architecture.md draws the same table). The base
# modules import nothing of Tessera's; a new arrow is a design decision: add it here and to the doc.
BASE = ("tessera.asgi", "tessera.cpu_info", "tessera.native_steps", "tessera.redis_conn", "tessera.redis_wire",
        "tessera.redis_tls", "tessera.redis_sentinel", "tessera.refresher", "tessera.registry", "tessera.resp",
        "tessera.settings", "tessera.engine.ports", "tessera.engine.protocol", "tessera.swallowed_cancel",
        "tessera.unique_ids", "tessera.wake_grid")
MAY_IMPORT: dict[str, tuple[str, ...]] = {
    **{base: () for base in BASE},
    # a rediss:// URL's TLS options, as redis-py reads them; a redis+sentinel:// URL and its primary; the
    # commands' bytes (resp: the one packer, which the Sentinel resolver writes with too)
    "tessera.redis_wire": ("tessera.redis_tls", "tessera.redis_sentinel", "tessera.resp", "tessera.wake_grid"),
    "tessera.refresher": ("tessera.wake_grid",),  # the instants periodic work shares
    "tessera.redis_sentinel": ("tessera.resp",),
    # a redis+sentinel:// URL; a port for a Redis of its own, below the ephemeral range; connections that raise a
    # cancellation redis-py's write swallowed
    "tessera.redis_conn": ("tessera.redis_sentinel", "tessera.engine.ports", "tessera.swallowed_cancel"),
    "tessera.registry": ("tessera.redis_wire",),  # gateways read the registry over the lean connection
    # The data-plane signature: its ASGI check (asgi) and where its key file is configured (settings).
    "tessera.data_plane_auth": ("tessera.asgi", "tessera.settings"),
    "tessera.telemetry": (),
    "tessera.tenancy": ("tessera.redis_wire", "tessera.unique_ids"),  # lease ids
    # the pod's replay in C where built (native_steps: which C steps there are and how each is chosen)
    # a loop's guard against a cancellation redis-py swallowed (swallowed_cancel), the engine's and gateway's too
    "tessera.routing": ("tessera.native_steps", "tessera.registry", "tessera.redis_wire", "tessera.refresher",
                        "tessera.swallowed_cancel"),
    # Proposals are EngineConfigs; the engine reads the planner's pure formulas (speculation break-even).
    "tessera.planner": ("tessera.engine.config",),
    "tessera.engine": ("tessera.asgi", "tessera.data_plane_auth", "tessera.planner", "tessera.redis_conn",
                       "tessera.registry", "tessera.routing", "tessera.settings", "tessera.swallowed_cancel",
                       "tessera.telemetry", "tessera.wake_grid"),
    "tessera.gateway": ("tessera.asgi", "tessera.data_plane_auth", "tessera.engine.protocol", "tessera.native_steps",
                        "tessera.redis_conn", "tessera.redis_wire",
                        "tessera.refresher", "tessera.registry", "tessera.routing", "tessera.settings",
                        "tessera.swallowed_cancel", "tessera.telemetry", "tessera.tenancy", "tessera.unique_ids",
                        "tessera.wake_grid"),
    "tessera.local": ("tessera.cpu_info", "tessera.data_plane_auth", "tessera.engine", "tessera.gateway",
                      "tessera.redis_conn", "tessera.registry",
                      "tessera.tenancy", "tessera.settings", "tessera.telemetry"),
    "tessera_operators.kvcontrol": ("tessera.data_plane_auth", "tessera.redis_conn", "tessera.registry",
                                    "tessera.routing", "tessera.swallowed_cancel",
                                    "tessera.settings", "tessera.telemetry", "tessera.tenancy"),
    "tessera_operators.operator": ("tessera.engine.config", "tessera.redis_conn", "tessera.registry",
                                   "tessera.settings", "tessera.tenancy"),
    # The command line and `tessera doctor` sit on top and may use anything.
}


def _package_of(module: str) -> str | None:
    owners = [p for p in MAY_IMPORT if _within(module, p)]
    return max(owners, key=len) if owners else None


def test_each_package_imports_only_what_lies_beneath_it() -> None:
    broken = []
    for module, targets in GRAPH.items():
        package = _package_of(module)
        if package is None:
            continue
        for target in targets:
            if _within(target, package) or any(_within(target, allowed) for allowed in MAY_IMPORT[package]):
                continue
            broken.append(f"{module} imports {target} ({package} may import: {', '.join(MAY_IMPORT[package])})")
    assert not broken, "\n".join(sorted(broken))


def test_the_allowlist_names_real_packages() -> None:
    for package, allowed in MAY_IMPORT.items():
        for name in (package, *allowed):
            assert any(_within(m, name) for m in MODULES), f"no module {name} (MAY_IMPORT is stale)"

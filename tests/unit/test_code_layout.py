"""The shape of `services/`: modules of a bounded size, no import cycle between modules
at import time, and no import cycle between packages at all.

A package is a directory under `services/`; a top-level module (`services/cli.py`) is a
node of its own. Between packages every import counts: at module level, under
`TYPE_CHECKING` and inside functions, since each is a dependency of the code, whether or
not it runs when the module is imported.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

SERVICES = Path(__file__).resolve().parents[2] / "services"
MAX_LINES = 600


def module_name(path: Path) -> str:
    parts = path.relative_to(SERVICES.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_of(module: str) -> str:
    """`services.router.local` -> `services.router`; `services.cli` stays itself."""
    parts = module.split(".")
    if len(parts) > 2 or (SERVICES / parts[-1]).is_dir():
        return ".".join(parts[:2])
    return module


def imported(nodes: Iterable[ast.stmt | ast.AST], modules: set[str]) -> set[str]:
    """The services modules named by the import statements among `nodes`."""
    out: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                out.add(sub if sub in modules else node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m for m in out if m in modules}


def module_graph(every_import: bool) -> dict[str, set[str]]:
    """module -> the services modules it imports: at import time (module-level statements
    only), or anywhere in its source."""
    paths = {module_name(p): p for p in SERVICES.rglob("*.py")}
    graph = {}
    for m, p in paths.items():
        tree = ast.parse(p.read_text())
        nodes = ast.walk(tree) if every_import else tree.body
        graph[m] = imported(nodes, set(paths)) - {m}
    return graph


def tangles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one node: each is a set of nodes that
    all reach one another (empty: the graph is acyclic). Tarjan's algorithm."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []

    def visit(m: str) -> None:
        index[m] = low[m] = len(index)
        stack.append(m)
        on_stack.add(m)
        for n in sorted(graph.get(m, ())):
            if n not in index:
                visit(n)
                low[m] = min(low[m], low[n])
            elif n in on_stack:
                low[m] = min(low[m], index[n])
        if low[m] == index[m]:
            component = set()
            while True:
                n = stack.pop()
                on_stack.discard(n)
                component.add(n)
                if n == m:
                    break
            if len(component) > 1:
                found.append(component)

    for m in sorted(graph):
        if m not in index:
            visit(m)
    return found


def describe(graph: dict[str, set[str]], component: set[str],
             why: dict[tuple[str, str], list[str]] | None = None) -> str:
    """The edges inside one tangle, one a line (with the imports behind each, if known)."""
    lines = []
    for a in sorted(component):
        for b in sorted(graph[a] & component):
            detail = f" ({', '.join(sorted(why[a, b]))})" if why else ""
            lines.append(f"  {a} -> {b}{detail}")
    return "\n".join(lines)


def test_no_module_is_over_the_line_budget() -> None:
    long = {str(p.relative_to(SERVICES.parent)): n for p in SERVICES.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"split these modules (over {MAX_LINES} lines): {long}"


def test_no_import_cycles_between_modules() -> None:
    graph = module_graph(every_import=False)
    found = tangles(graph)
    assert not found, "import cycles:\n" + "\n\n".join(describe(graph, c) for c in found)


def test_no_import_cycles_between_packages() -> None:
    packages: dict[str, set[str]] = {}
    why: dict[tuple[str, str], list[str]] = {}
    for m, deps in module_graph(every_import=True).items():
        a = package_of(m)
        packages.setdefault(a, set())
        for d in deps:
            b = package_of(d)
            if a != b:
                packages[a].add(b)
                why.setdefault((a, b), []).append(f"{m} -> {d}")
    found = tangles(packages)
    assert not found, "package cycles:\n" + "\n\n".join(
        describe(packages, c, why) for c in found)

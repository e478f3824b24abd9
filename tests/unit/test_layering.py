"""The tree's import graph: no circles, no arrow from a lower floor to a higher one, the engine never reaches
the services or the benchmarks.

Every import counts, wherever it is written: at the top of a module, inside a function, under
`if TYPE_CHECKING:`. A lazy or type-only import still couples the two modules (a reader must know both, a
rename breaks both), so it is held to the same rules. `from pkg import name` counts as an import of the
submodule `pkg.name` when that is a module, else of `pkg`.

Floors, bottom to top (a module may import its own floor and those below):

    engine.settings                  every environment variable (standard library only)
    proto, kernels                   generated messages; kernels with their references
    engine.config < engine.structured < engine.kv < engine.core < engine.attention < engine.model
      < engine.loading < engine.hisparse < engine.runner < engine.parallel < engine.frontend < engine
    planner
    services.rpc < services.cluster < services.transfer < services.kvstore < services.engine_host
      < services.rank_watch < services.prefill, services.decode < services.router < services.launch
    bench
    services.cli                     the `pdserve` command table (it starts the benchmarks too)

`engine` (the package root and the modules directly in it) sits above its subpackages: it is where the
engine is put together. The table is in docs/structure.md ("Floors").
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

from tests.helpers import ROOT

PACKAGES = ("engine", "kernels", "services", "planner", "bench", "proto")

# (floor, its packages); a module belongs to the longest prefix that names it
FLOORS: list[tuple[str, ...]] = [
    ("engine.settings",),
    ("proto",),
    ("kernels",),
    ("engine.config",),
    ("engine.structured",),
    ("engine.kv",),
    ("engine.core",),
    ("engine.attention",),
    ("engine.model",),
    ("engine.loading",),
    ("engine.hisparse",),
    ("engine.runner",),
    ("engine.parallel",),
    ("engine.frontend",),
    ("engine",),
    ("planner",),
    ("services.rpc",),
    ("services.cluster",),
    ("services.transfer",),
    ("services.kvstore",),
    ("services.engine_host",),
    ("services.rank_watch",),
    ("services.prefill", "services.decode"),
    ("services.router",),
    ("services.launch",),
    ("services",),
    ("bench",),
    ("services.cli",),  # the `pdserve` command table: every command, the benchmarks' included
]


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg in PACKAGES:
        for f in (ROOT / pkg).rglob("*.py"):
            parts = list(f.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            elif parts[-1] == "__main__":
                continue  # an entry point: nothing imports it
            if "_pb2" in parts[-1]:
                continue  # generated
            mods[".".join(parts)] = f
    return mods


MODULES = _modules()


def _resolve(name: str) -> str | None:
    parts = name.split(".")
    while parts:
        if ".".join(parts) in MODULES:
            return ".".join(parts)
        parts.pop()
    return None


def _imports(mod: str, path: Path) -> list[tuple[str, int]]:
    """(imported module of the tree, line) for every import statement in the file, at any depth."""
    is_pkg = path.name == "__init__.py"
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.extend((r, node.lineno) for a in node.names if (r := _resolve(a.name)))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            for a in node.names:
                r = _resolve(f"{target}.{a.name}") or _resolve(target)
                if r:
                    out.append((r, node.lineno))
    return [(r, line) for r, line in out if r != mod]


GRAPH = {mod: _imports(mod, path) for mod, path in MODULES.items()}


def _floor(mod: str) -> int:
    best, best_len = None, -1
    for i, names in enumerate(FLOORS):
        for name in names:
            if (mod == name or mod.startswith(name + ".")) and len(name) > best_len:
                best, best_len = i, len(name)
    assert best is not None, f"{mod} is on no floor: add its package to FLOORS (and to docs/structure.md)"
    return best


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_the_graph_is_read():
    # the walk sees the tree (a broken resolver would find no edges and pass every rule below)
    assert len(MODULES) > 200
    assert ("engine.core.scheduler", 0) not in GRAPH["engine.core.core"]
    assert any(t == "engine.core.scheduler" for t, _ in GRAPH["engine.core.core"])
    assert any(t.startswith("kernels.") for t, _ in GRAPH["engine.model.layers"])


def test_no_import_circles():
    graph = {m: {t for t, _ in edges} for m, edges in GRAPH.items()}
    circles = _cycles(graph)
    assert not circles, "import circles (break each by moving what both sides need down a floor):\n" + "\n".join(
        " <-> ".join(c) for c in circles)


def test_cycle_finder_finds_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_runs_up_a_floor():
    up = [f"{m}:{line} -> {t}" for m, edges in GRAPH.items() for t, line in edges if _floor(t) > _floor(m)]
    assert not up, "imports from a lower floor into a higher one (see this file's docstring):\n" + "\n".join(up)


@pytest.mark.parametrize("lower,higher", [("engine", "services"), ("engine", "bench"), ("kernels", "engine"),
                                          ("kernels", "services"), ("services", "bench"), ("planner", "services")])
def test_package_never_imports(lower, higher):
    allowed = {("kernels", "engine.settings")}
    bad = [f"{m}:{line} -> {t}" for m, edges in GRAPH.items() if m.split(".")[0] == lower
           for t, line in edges if t.split(".")[0] == higher
           and not any(lower == a and (t == b or t.startswith(b + ".")) for a, b in allowed)]
    if (lower, higher) == ("services", "bench"):
        bad = [b for b in bad if not b.startswith("services.cli:")]  # the command table starts benchmarks
    assert not bad, f"{lower} imports {higher}:\n" + "\n".join(bad)


def test_the_engine_imports_nothing_by_name():
    """Calls between ranks take functions (pickled by reference), not "module:function" strings, and the
    engine never imports a module named at run time."""
    users = defaultdict(list)
    for mod, path in MODULES.items():
        if mod.split(".")[0] in ("engine", "kernels"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    names = [a.name for a in node.names] + ([node.module] if isinstance(node, ast.ImportFrom) else [])
                    if "importlib" in names or "import_module" in names:
                        users[mod].append(node.lineno)
    assert not users, f"modules importing by name: {dict(users)}"


def _unexplained_function_imports(path: Path) -> list[int]:
    """Lines of imports inside a function with no comment saying why: on the import, within its block of
    consecutive imports, or on the line right above the block."""
    lines = path.read_text().splitlines()
    out = []

    def visit(node, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, True)
            elif in_function and isinstance(child, (ast.Import, ast.ImportFrom)):
                first, last = child.lineno - 1, child.end_lineno - 1
                while first > 0 and (not lines[first - 1].strip()
                                     or lines[first - 1].strip().startswith(("import ", "from "))):
                    first -= 1  # the block of imports (blank lines between them) this one belongs to
                block = lines[max(first - 1, 0): last + 1]
                if not any("#" in line for line in block):
                    out.append(child.lineno)
            else:
                visit(child, in_function)

    visit(ast.parse("\n".join(lines)), False)
    return out


def test_function_level_imports_say_why():
    """An import inside a function is there to spare a process a heavy dependency (torch in the router, nixl
    where nothing moves, a command's tools in `pdserve`), and its comment says which; otherwise it belongs at
    the top, where the graph above sees it plainly."""
    bad = [f"{path.relative_to(ROOT)}:{line}" for mod, path in MODULES.items()
           if mod.split(".")[0] in ("engine", "kernels", "services", "planner")
           for line in _unexplained_function_imports(path)]
    assert not bad, "imports inside functions without a reason:\n" + "\n".join(bad)


def test_the_reason_check_flags_a_bare_import(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("def f():\n    import os\n    return os\n\n\ndef g():\n    # why\n    import sys\n\n    import json\n")
    assert _unexplained_function_imports(f) == [2]

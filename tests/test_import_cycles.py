"""No import cycle inside megatron_qarl/, read from the source with ``ast``, in two graphs:

1. module-level imports: every ``import`` / ``from ... import`` executed when a module is imported, i.e. at the
   module's top level, including inside top-level ``try`` / ``if`` / ``with`` blocks. A cycle here can break an
   import (a module sees the other half-initialised).
2. every import, lazy ones too (inside functions and methods: they run when the function is called, after both
   modules have loaded, so they cannot break an import). A cycle here is two modules that each need the other:
   one concept split over two rooms (moe/model.py <-> moe/te.py was one: model.py now owns the transformer
   config and te.py no longer imports it).
The second graph also counts ``if TYPE_CHECKING:`` imports: a type annotation naming another module's class is a
need of that module as much as a call is (config.py once validated through plan.py and rollout/vllm_launcher.py,
both of which annotated with config.py's QarlConfig: one design question, now answered by preflight/rules.py).
The implicit import of a module's parent packages is not counted. ``from pkg import name`` is an edge to
``pkg.name`` when that is a module, else to ``pkg``.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = "megatron_qarl"


def module_files(root: Path, package: str) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of the package under ``root``."""
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(body: list[ast.stmt], lazy: bool):
    """The Import / ImportFrom statements of ``body`` that run when the module is imported; ``lazy``: also those
    in functions and classes, and those under ``if TYPE_CHECKING:``."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If):
            if lazy or not _is_type_checking(node.test):
                yield from _imports(node.body, lazy)
            yield from _imports(node.orelse, lazy)
        elif isinstance(node, (ast.Try, getattr(ast, "TryStar", ast.Try))):
            for block in (node.body, node.orelse, node.finalbody, *[h.body for h in node.handlers]):
                yield from _imports(block, lazy)
        elif isinstance(node, (ast.With, ast.For, ast.While)):
            yield from _imports(node.body, lazy)
        elif lazy and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield from _imports(node.body, lazy)


def import_graph(root: Path, package: str, lazy: bool = False) -> dict[str, set[str]]:
    """module -> the package's modules it imports at module level (``lazy``: anywhere)."""
    files = module_files(root, package)
    graph: dict[str, set[str]] = {m: set() for m in files}
    for module, path in files.items():
        is_pkg = path.name == "__init__.py"
        for node in _imports(ast.parse(path.read_text(), str(path)).body, lazy):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:  # relative: resolved against this module's package
                    anchor = module.split(".") if is_pkg else module.split(".")[:-1]
                    anchor = anchor[:len(anchor) - (node.level - 1)]
                    base = ".".join([*anchor, base] if base else anchor)
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in files else base for alias in node.names]
            graph[module] |= {t for t in targets if t in files and t != module}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [m0, m1, ..., m0], or None (iterative depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for start in sorted(graph):
        if state.get(start):
            continue
        path, stack = [start], [iter(sorted(graph[start]))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph[nxt])))
    return None


def test_megatron_qarl_has_no_module_level_import_cycle():
    graph = import_graph(REPO, PACKAGE)
    assert len(graph) > 50 and sum(map(len, graph.values())) > 50  # the graph was read, not empty
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle at module level: " + " -> ".join(cycle)


def test_megatron_qarl_has_no_import_cycle_even_through_lazy_or_type_checking_imports():
    graph = import_graph(REPO, PACKAGE, lazy=True)
    assert sum(map(len, graph.values())) > sum(map(len, import_graph(REPO, PACKAGE).values()))  # lazy ones counted
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle (counting imports inside functions and under TYPE_CHECKING): " + \
        " -> ".join(cycle) + "; one of the two modules should own what both need"


def test_the_check_sees_cycles_through_relative_lazy_and_type_checking_imports(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    for init in (pkg / "__init__.py", pkg / "sub" / "__init__.py"):
        init.write_text("")
    (pkg / "a.py").write_text("from pkg.sub import b\n")
    (pkg / "sub" / "b.py").write_text("try:\n    from ..c import X\nexcept ImportError:\n    X = None\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import a\n"
                              "def f():\n    import pkg.a\n")
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.a"] == {"pkg.sub.b"} and graph["pkg.sub.b"] == {"pkg.c"} and graph["pkg.c"] == set()
    assert find_cycle(graph) is None
    assert find_cycle(import_graph(tmp_path, "pkg", lazy=True)) == ["pkg.a", "pkg.sub.b", "pkg.c", "pkg.a"]
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import a\n")
    assert find_cycle(import_graph(tmp_path, "pkg")) is None  # never executed: no module-level cycle
    assert find_cycle(import_graph(tmp_path, "pkg", lazy=True)) == ["pkg.a", "pkg.sub.b", "pkg.c", "pkg.a"]
    (pkg / "c.py").write_text("import pkg.a as a\n")
    assert find_cycle(import_graph(tmp_path, "pkg")) == ["pkg.a", "pkg.sub.b", "pkg.c", "pkg.a"]

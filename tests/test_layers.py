"""Unit: the import graph keeps its shape — the product never imports the simulated world or the
benchmarks, the contracts in ``flexpipe/`` import no component but the pure core, and no modules
import each other in a cycle (lazy imports inside functions count: they are cycles all the same).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("flexpipe", "gearbox", "probes", "streams", "runtime", "sim", "bench")
PRODUCT = ("gearbox", "probes", "streams", "runtime")
# NOTE: the contracts may use gearbox's types (the config carries GearboxConfig and model shapes):
# gearbox is the pure core everything depends on, and it imports nothing of ours.
COMPONENTS = ("probes", "streams", "runtime", "sim", "bench")
FRONT_DOOR = "flexpipe.cli"  # the one flexpipe module that may reach every component


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = path
    return out


def _imports(path: Path) -> Iterator[tuple[int, str]]:
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.lineno, node.module
            for alias in node.names:
                yield node.lineno, f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name


MODULES = _modules()


def _top(module: str) -> str:
    return module.split(".")[0]


def test_the_product_imports_neither_sim_nor_bench() -> None:
    bad = [
        f"{name}:{line} imports {target}"
        for name, path in MODULES.items()
        if _top(name) in PRODUCT
        for line, target in _imports(path)
        if _top(target) in ("sim", "bench")
    ]
    assert not bad, "\n".join(bad)


def test_contracts_import_no_component() -> None:
    bad = [
        f"{name}:{line} imports {target}"
        for name, path in MODULES.items()
        if _top(name) == "flexpipe" and name != FRONT_DOOR
        for line, target in _imports(path)
        if _top(target) in COMPONENTS
    ]
    assert not bad, "\n".join(bad)


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {name: set() for name in MODULES}
    for name, path in MODULES.items():
        for _, target in _imports(path):
            if target in MODULES and target != name and not name.startswith(f"{target}."):
                graph[name].add(target)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[v] = min(low[v], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_cycles() -> None:
    assert _cycles(_graph()) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]

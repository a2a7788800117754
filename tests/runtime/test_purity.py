"""Unit: the runtime's cores do no I/O and read no clock — the DES benchmark depends on it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
PURE = (
    "runtime.router",
    "runtime.transition",
    "runtime.throttle",
    "runtime.admission",
    "runtime.timing",
    "runtime.engine.sim",
    "runtime.serving",
    "runtime.executor",
    "runtime.deployment",
    "runtime.stats",
    "runtime.inventory",
    "runtime.host",
)
FORBIDDEN = {"asyncio", "aiokafka", "aiohttp", "time", "socket", "faust", "random", "threading"}


def _imports(module: str) -> set[str]:
    path = ROOT / (module.replace(".", "/") + ".py")
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
    return out


def _closure(module: str) -> set[str]:
    seen: set[str] = set()
    todo = [module]
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        path = ROOT / (current.replace(".", "/") + ".py")
        if current.startswith("runtime") and path.exists():
            todo.extend(_imports(current))
    return seen


@pytest.mark.parametrize("module", PURE)
def test_core_module_imports_no_io_and_no_clock(module: str) -> None:
    reached = _closure(module)
    bad = {m for m in reached if m.split(".")[0] in FORBIDDEN}
    assert not bad, f"{module} reaches {sorted(bad)}"

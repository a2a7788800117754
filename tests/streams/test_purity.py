"""The folding, windowing, snapshot and decision modules stay pure: no I/O, no clocks."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

STREAMS = Path(__file__).resolve().parents[2] / "streams"
PURE = (
    "catalog", "clock", "codec", "cursor", "deployments", "inflight", "intake", "load",
    "neighbours", "order", "ondemand", "step", "replay", "snapshot", "state", "view", "windows",
)  # fmt: skip
FORBIDDEN = {
    "aiokafka", "asyncio", "datetime", "faust", "os", "prometheus_client", "random",
    "socket", "subprocess", "threading", "time", "urllib",
}  # fmt: skip


@pytest.mark.parametrize("name", PURE)
def test_pure_module_imports_no_io(name: str) -> None:
    tree = ast.parse((STREAMS / f"{name}.py").read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
            if node.module.startswith("streams.") and node.module.split(".")[1] not in PURE:
                imported.add(node.module)
    bad = imported & FORBIDDEN | {m for m in imported if m.startswith("streams.")}
    assert not bad, f"streams/{name}.py imports {sorted(bad)}"

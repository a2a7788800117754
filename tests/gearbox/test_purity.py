"""gearbox must stay pure: no I/O libraries, no clocks, no global randomness, no file access."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

GEARBOX = Path(__file__).resolve().parents[2] / "gearbox"

FORBIDDEN_MODULES = {
    "aiohttp",
    "aiokafka",
    "asyncio",
    "bcc",
    "datetime",
    "faust",
    "io",
    "os",
    "pathlib",
    "prometheus_client",
    "pynvml",
    "random",
    "requests",
    "shutil",
    "socket",
    "subprocess",
    "sys",
    "tempfile",
    "threading",
    "time",
    "torch",
    "urllib",
}
FORBIDDEN_CALLS = {"open", "input", "print", "exec", "eval", "__import__"}


def _sources() -> list[Path]:
    return sorted(GEARBOX.rglob("*.py"))


def _violations(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        found += [f"imports {n}" for n in names if n.split(".")[0] in FORBIDDEN_MODULES]
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in FORBIDDEN_CALLS
        ):
            found.append(f"calls {node.func.id}()")
    return [f"{path.name}:{v}" for v in found]


@pytest.mark.unit
def test_gearbox_has_sources() -> None:
    assert len(_sources()) >= 10


@pytest.mark.unit
@pytest.mark.parametrize("path", _sources(), ids=lambda p: p.name)
def test_module_is_pure(path: Path) -> None:
    assert _violations(path) == []


@pytest.mark.unit
def test_checker_catches_an_impure_module(tmp_path: Path) -> None:
    impure = tmp_path / "impure.py"
    impure.write_text("import time\nfrom asyncio import sleep\nopen('x')\n")
    assert _violations(impure) == [
        "impure.py:imports time",
        "impure.py:imports asyncio",
        "impure.py:calls open()",
    ]

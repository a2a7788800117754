"""Alert rules pass Prometheus's own checker and their promtool unit tests."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit
DASHBOARDS = Path(__file__).resolve().parents[2] / "dashboards"


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("promtool")
    assert exe, "promtool not found: `make test` installs it (Debian package prometheus)"
    return subprocess.run([exe, *args], capture_output=True, text=True, check=False, timeout=60)


def test_rules_are_valid() -> None:
    proc = promtool("check", "rules", str(DASHBOARDS / "alerts.yaml"))
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize(
    "case", sorted((DASHBOARDS / "tests").glob("*_test.yaml")), ids=lambda p: p.name
)
def test_rule_unit_tests(case: Path) -> None:
    proc = promtool("test", "rules", str(case))
    assert proc.returncode == 0, proc.stdout + proc.stderr

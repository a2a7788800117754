"""E2e: `flexpipe up` — broker, stream worker, runtime worker, simulated agents and load, whole.

One short run of the demo scenario (10 simulated minutes at 20×, about 45 s wall) as a
subprocess against the session broker: it must end cleanly, show chat-70b serving from start-up
and shifting after the 08:00 preemption with its three phases, and write the report and the PNG.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from flexpipe.config import FlexPipeConfig

pytestmark = pytest.mark.e2e

PREEMPT = "00:08:00"


def _run_up(kafka_cfg: FlexPipeConfig, out: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEXPIPE_")}
    env |= {
        "FLEXPIPE_KAFKA__BOOTSTRAP_SERVERS": kafka_cfg.kafka.bootstrap_servers or "",
        "FLEXPIPE_TOPICS__PREFIX": kafka_cfg.topics.prefix,
    }
    cmd = [sys.executable, "-m", "flexpipe.cli", "up", "--duration", "600", "--speed", "20"]
    return subprocess.run(
        [*cmd, "--out", str(out)], env=env, capture_output=True, text=True, timeout=240
    )


def _phases_after(stdout: str, deployment: str, after: str) -> dict[int, list[str]]:
    """Completed phases per transition of ``deployment`` printed at or after ``after``."""
    found: dict[int, list[str]] = {}
    pattern = rf"^(\d\d:\d\d:\d\d)    ↳ {deployment} #(\d+) (\w+) [\d.]+ s ✓"
    for t, seq, phase in re.findall(pattern, stdout, flags=re.M):
        if t >= after:
            found.setdefault(int(seq), []).append(phase)
    return found


def test_up_shifts_chat_70b_after_the_preemption_and_writes_the_report(
    kafka_cfg: FlexPipeConfig, tmp_path: Path
) -> None:
    proc = _run_up(kafka_cfg, tmp_path)
    out = proc.stdout
    assert proc.returncode == 0, f"exit {proc.returncode}\n{out[-3000:]}\n{proc.stderr[-3000:]}"
    # Start-up: the starting plan is loaded as transition 0, before any decision.
    assert re.search(r"↳ chat-70b #0 done [\d.]+ s ✓", out), out[-3000:]
    # The preemption, a decision for chat-70b, and a shift with all three phases after it.
    assert f"{PREEMPT}  ⚡ preempt on node-a1 (4 GPUs)" in out
    assert re.search(rf"^{PREEMPT}  ⚙ chat-70b: forced_infeasible \[topology_change\]", out, re.M)
    shifts = _phases_after(out, "chat-70b", PREEMPT)
    assert any(p[:4] == ["prepare", "switch", "cleanup", "done"] for p in shifts.values()), shifts
    assert re.search(r"^chat-70b #\d+: 00:08:00 preempt on node-a1 .* seen", out, re.M)
    # chat-70b serves from start-up: no status block before the preemption counts a request
    # turned away for want of a plan, and few are over the whole run (the preemption's outage).
    blocks = re.findall(r"^(\d\d:\d\d:\d\d)  ▸ chat-70b (.*)$", out, re.M)
    assert [t for t, _ in blocks if t < PREEMPT], out[-3000:]
    assert all("no_serving_plan" not in line for t, line in blocks if t < PREEMPT), blocks
    admitted = re.search(r"^chat-70b .* admitted (\d+)(?:, no_serving_plan (\d+))?", out, re.M)
    assert admitted is not None, out[-2000:]
    assert int(admitted.group(2) or 0) < 0.1 * int(admitted.group(1))
    # The summary, the report and the figure.
    assert "== shifts" in out and "== throughput and admission" in out
    report = (tmp_path / "report.md").read_text()
    assert "## Decisions that changed a plan" in report and "chat-70b" in report
    png = (tmp_path / "timeline.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
    assert (tmp_path / "streams.log").exists()

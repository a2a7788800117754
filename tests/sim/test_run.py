"""`flexpipe run` end to end: simulated cluster → real broker → subscriber view → summary."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from flexpipe.config import FlexPipeConfig

pytestmark = pytest.mark.e2e


def test_run_prints_block_view_and_summary(kafka_cfg: FlexPipeConfig) -> None:
    env = os.environ | {
        "FLEXPIPE_KAFKA__BOOTSTRAP_SERVERS": kafka_cfg.kafka.bootstrap_servers or "",
        "FLEXPIPE_TOPICS__PREFIX": kafka_cfg.topics.prefix,
    }
    # 2h15m of the seed scenario covers the first preemption (2:00) of block A.
    proc = subprocess.run(
        [sys.executable, "-m", "flexpipe.cli", "run", "--duration", "8100", "--speed", "800"],
        capture_output=True,
        text=True,
        env=env,
        timeout=180,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "preempt on node-a1 (4 GPUs)" in out
    assert "A ████████░░░░  8/12" in out, "block A shows 4 GPUs lost after the preemption"
    summary = out.split("== summary", 1)[1]
    assert "consumed cluster.event" in summary and "invalid" not in summary
    assert "preempt 1" in summary

"""`flexpipe up --engine torch`: the demo's preemption shift served by the torch engine.

The demo scenario for 10 simulated minutes (the preemption at 08:00): every deployment's
replicas are TorchEngines (rank processes on this CPU), the control loop and cluster are
simulated. Checked: the seven invariants hold, chat-70b shifts after the preemption, the
engines generated real tokens, and the requests across the shift equal the single-process
reference (`up` itself exits 1 otherwise).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from flexpipe.config import FlexPipeConfig

pytestmark = [pytest.mark.torch, pytest.mark.e2e]


@pytest.mark.timeout(480)
def test_up_with_the_torch_engine_shifts_token_exact(
    kafka_cfg: FlexPipeConfig, tmp_path: Path
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEXPIPE_")}
    env |= {
        "FLEXPIPE_KAFKA__BOOTSTRAP_SERVERS": kafka_cfg.kafka.bootstrap_servers or "",
        "FLEXPIPE_TOPICS__PREFIX": kafka_cfg.topics.prefix,
    }
    cmd = [sys.executable, "-m", "flexpipe.cli", "up", "--engine", "torch", "--duration", "600"]
    cmd += ["--speed", "8", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=420)
    out = proc.stdout
    assert proc.returncode == 0, f"exit {proc.returncode}\n{out[-3000:]}\n{proc.stderr[-3000:]}"
    assert "torch engine on CPU" in out
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["invariants_ok"] is True, summary["broken"]
    assert summary["events"] and summary["events"][0]["deployment"] == "chat-70b"
    assert re.search(r"^chat-70b #\d+: 00:08:00 preempt on node-a1 .*\n.*: done in", out, re.M)
    served = re.search(r"^torch engine, chat-70b: \d+ requests, (\d+) tokens", out, re.M)
    assert served is not None and int(served.group(1)) > 0, out[-2000:]
    checked = re.findall(r"across the shift to \S+: (\d+)/(\d+) requests", out)
    assert checked and all(a == b and int(b) > 0 for a, b in checked), checked

"""`flexpipe up --engine torch`: the demo's preemption shift served by the torch engine.

The demo scenario for 12 simulated minutes (the preemption at 08:00): every deployment's
replicas are TorchEngines (rank processes on this CPU), the control loop and cluster are
simulated. Checked: the invariants hold, chat-70b shifts after the preemption (or, when it
was moved off the preempted GPUs before, then), the engines generated real tokens, and the
requests across each shift equal the single-process reference (`up` itself exits 1 otherwise).
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
    # NOTE: 12 minutes, not 10: beside a busy CPU the 08:00 shift took 60 s and its first
    # requests had not finished on the new plan by 10:00 (nothing across it to check), and a
    # downshift before 05:00 that gave them time is now held (gearbox downshift_min_evidence_s)
    cmd = [sys.executable, "-m", "flexpipe.cli", "up", "--engine", "torch", "--duration", "720"]
    cmd += ["--speed", "8", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=420)
    out = proc.stdout
    assert proc.returncode == 0, f"exit {proc.returncode}\n{out[-3000:]}\n{proc.stderr[-3000:]}"
    assert "torch engine on CPU" in out
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["invariants_ok"] is True, summary["broken"]
    # NOTE: beside a busy CPU the ranks load slowly and chat-70b serves nothing for a simulated
    # minute or more; the stream may then downshift it (from 05:00) to TP4 on node-a2, off the
    # GPUs the preemption takes (a voluntary switch on the load it saw), and the preemption
    # hits no serving plan. Either way chat-70b shifts while the torch engine serves it.
    if any(e["deployment"] == "chat-70b" for e in summary["events"]):
        preempted = r"^chat-70b #\d+: 00:08:00 preempt on node-a1 .*\n.*: done in"
        assert re.search(preempted, out, re.M), out[-3000:]
    else:
        earlier = r"^chat-70b #[1-9]\d*: 00:0[0-7]:\d\d .*\n.*→ .*: done in"
        assert re.search(earlier, out, re.M), f"the preemption hit no plan\n{out[-3000:]}"
    served = re.search(r"^torch engine, chat-70b: \d+ requests, (\d+) tokens", out, re.M)
    assert served is not None and int(served.group(1)) > 0, out[-2000:]
    across = r"^torch engine, chat-70b: .*\n  across the shift to \S+: (\d+)/(\d+) requests"
    assert re.search(across, out, re.M), out[-2000:]
    checked = re.findall(r"across the shift to \S+: (\d+)/(\d+) requests", out)
    assert checked and all(a == b and int(b) > 0 for a, b in checked), checked

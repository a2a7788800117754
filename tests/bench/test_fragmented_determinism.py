"""Unit: the fragmented-cluster benchmark is reproducible to the byte.

Runs ``python -m bench.fragmented`` twice on the first 10 minutes of a scenario with a
preemption (every system, separate interpreters, different hash seeds and worker counts) and
compares the results files and PNGs byte for byte; the printed last line must be the file's summary.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
SCENARIO = ROOT / "tests" / "fixtures" / "scenarios" / "fragmented-short.yaml"


def run_bench(out: Path, workers: int, hash_seed: str) -> str:
    env = {**os.environ, "PYTHONHASHSEED": hash_seed, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.fragmented",
            "--scenario",
            str(SCENARIO),
            "--seed",
            "3",
            "--seeds",
            "1",
            # NOTE: the preemption at 300 s and the response to it, at half the oracle's cost
            "--duration",
            "600",
            "--workers",
            str(workers),
            "--out",
            str(out),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=420,
        check=False,
    )
    # NOTE: a 10-minute slice misses some of the targets (exit 1, MISSED on stderr);
    # nothing may break (FAILED) and nothing else may end it
    assert done.returncode in (0, 1), done.stderr[-2000:]
    assert "FAILED:" not in done.stdout, done.stdout[-2000:]
    json.loads(done.stdout.strip().splitlines()[-1])  # it ran to its summary line
    return done.stdout


# NOTE: each run simulates every oracle candidate too; beside busy loops that is minutes
@pytest.mark.timeout(900)
def test_same_seed_gives_identical_bytes(tmp_path: Path) -> None:
    first = run_bench(tmp_path / "a", workers=2, hash_seed="1")
    second = run_bench(tmp_path / "b", workers=1, hash_seed="2")
    json_a = (tmp_path / "a" / "fragmented-short-600s.json").read_bytes()
    json_b = (tmp_path / "b" / "fragmented-short-600s.json").read_bytes()
    assert json_a == json_b
    png_a = (tmp_path / "a" / "fragmented-short-600s.png").read_bytes()
    assert png_a == (tmp_path / "b" / "fragmented-short-600s.png").read_bytes()
    results = json.loads(json_a)
    for stdout in (first, second):
        assert json.loads(stdout.strip().splitlines()[-1]) == results["summary"]
    # The run really exercised a preemption and FlexPipe's response to it.
    flex = results["systems"]["flexpipe"]
    assert results["preemptions_s"] == [300.0]
    assert flex["decision_delay_s"] is not None
    assert flex["deployments"]["chat-70b"]["completions"] > 0
    assert any(s["forced"] for s in flex["shifts"])

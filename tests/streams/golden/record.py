"""Record the golden trace: ``python -m tests.streams.golden.record`` (rewrites the fixtures).

The trace is the seed scenario's simulated agents around the first preemption of block A:
start-up (t = 0–1 s), then 02:00 ± 1 min; the expected decisions are what the replay decides.
"""

from __future__ import annotations

import gzip
from pathlib import Path

from flexpipe import envelope
from sim.fleet import SimFleet
from sim.scenario import SEED_FRAGMENTED, load_scenario

HERE = Path(__file__).resolve().parent
TRACE = HERE / "seed-preemption.jsonl.gz"
DECISIONS = HERE / "seed-preemption.decisions.json"


def record_trace() -> int:
    """Write the trace; returns the number of envelopes."""
    fleet = SimFleet(load_scenario(SEED_FRAGMENTED), seed=7, launch_interval_s=5.0)
    envs = [*fleet.events(0.0, 1.0), *fleet.events(7140.0, 7260.0)]
    with gzip.open(TRACE, "wb") as f:
        for e in envs:
            f.write(envelope.encode(e) + b"\n")
    return len(envs)


if __name__ == "__main__":
    print(f"{record_trace()} envelopes → {TRACE}")
    print("now run: FLEXPIPE_UPDATE_GOLDEN=1 pytest tests/streams/test_replay.py")

"""A machine calibration figure: the time of a fixed pure-Python workload.

Benchmarks print it beside their figures so runs on different machines (or the same machine
beside other work) can be compared: a figure twice as slow on a machine whose calibration is twice
as slow says the machine, not the code, changed. The workload mixes what the hot paths do —
dict and tuple churn, string formatting, float arithmetic — and never changes.
"""

from __future__ import annotations

import time

__all__ = ["calibration_ms"]

_ROUNDS = 100_000


def _workload() -> int:
    table: dict[str, tuple[int, float]] = {}
    total = 0
    for i in range(_ROUNDS):
        key = f"gpu-{i % 1024}"
        prev = table.get(key, (0, 0.0))
        table[key] = (prev[0] + 1, prev[1] * 0.5 + i * 0.25)
        total += len(key) + prev[0]
    return total + len(table)


def calibration_ms(repeats: int = 3) -> float:
    """The fastest of ``repeats`` runs of the fixed workload, in milliseconds (the minimum is the
    run least disturbed by other processes)."""
    best = float("inf")
    for _ in range(max(1, repeats)):
        start = time.perf_counter()
        _workload()
        best = min(best, time.perf_counter() - start)
    return round(best * 1000, 1)

"""A profiled stream worker's CPU, split by who spends it: faust, aiokafka, mode, asyncio,
prometheus_client, or ours (``streams/``, ``flexpipe/``, ``gearbox/``).

Reads the pstats file ``python -m streams.worker --profile PATH`` writes; the by-origin split and
the top-functions list are shared with ``bench.agent`` and ``bench.intake``. A C builtin's time is
charged to its caller (orjson's ``loads`` called by ``flexpipe/envelope.py`` is ours), so the
split says whose code paid for it.
"""

from __future__ import annotations

import pstats
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["origin", "own_cpu_by_origin", "profile_lines", "top_functions"]

# pstats' raw table: (file, line, function) -> (calls, primitive, own s, cumulative s, callers)
StatsTable = dict[tuple[str, int, str], Any]

_LIBRARIES = (
    ("/faust/", "faust"),
    ("/aiokafka/", "aiokafka"),
    ("/mode/", "mode"),
    ("/asyncio/", "asyncio"),
    ("/prometheus_client/", "prometheus_client"),
    ("/kafka/", "kafka-python (aiokafka's protocol)"),
)
_OURS = ("streams/", "flexpipe/", "gearbox/")


def origin(filename: str, function: str) -> str:
    """Who a profiled function belongs to: ours (by file), a library, or a C builtin."""
    for part, name in _LIBRARIES:
        if part in filename:
            return name
    if filename == "~":
        return f"C: {function}"
    for ours in _OURS:
        if f"/{ours}" in filename and "site-packages" not in filename:
            return "ours: " + ours + filename.split(f"/{ours}", 1)[1]
    return Path(filename).name


def _owner(where: str) -> str:
    return "ours" if where.startswith("ours: ") else where


Origin = Callable[[str, str], str]


def own_cpu_by_origin(stats: StatsTable, where: Origin) -> dict[str, float]:
    """Own (exclusive) CPU seconds per ``where(filename, function)``; a C builtin's time is
    charged to its callers, each its share (the builtin's entry lists its time per caller)."""
    by_origin: dict[str, float] = defaultdict(float)
    for (filename, _, function), (_, _, own_s, _, callers) in stats.items():
        if filename != "~" or not callers:
            by_origin[where(filename, function)] += own_s
            continue
        for (caller_file, _, caller_fn), (_, _, caller_s, _) in callers.items():
            by_origin[where(caller_file, caller_fn)] += caller_s
    return by_origin


def top_functions(stats: StatsTable, total: float, where: Origin, top: int) -> list[str]:
    """The ``top`` functions by own CPU, each with its share of ``total`` and its call count."""
    ranked = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    return [
        f"  {own_s / total:6.1%}  {calls:>9}  {function} ({where(filename, function)}:{line})"
        for (filename, line, function), (_, calls, own_s, _, _) in ranked
    ]


def profile_lines(path: Path, top: int = 15) -> list[str]:
    """Own (exclusive) CPU by owner and by origin, then the top functions by own CPU."""
    stats: StatsTable = pstats.Stats(str(path)).stats  # type: ignore[attr-defined]
    by_origin = own_cpu_by_origin(stats, origin)
    total = sum(by_origin.values()) or 1.0
    by_owner: dict[str, float] = defaultdict(float)
    for where, own_s in by_origin.items():
        by_owner[_owner(where)] += own_s
    lines = [f"worker profile (cProfile, {total:.1f} s process CPU; inflates call-heavy code):"]
    for name, own_s in sorted(by_owner.items(), key=lambda kv: -kv[1])[:8]:
        lines.append(f"  {own_s / total:6.1%}  {name}")
    lines.append("  ours, by file:")
    ours = [(w, s) for w, s in by_origin.items() if w.startswith("ours: ")]
    for where, own_s in sorted(ours, key=lambda kv: -kv[1])[:top]:
        lines.append(f"  {own_s / total:6.1%}  {where[6:]}")
    lines.append("  top functions by own CPU (calls):")
    return lines + top_functions(stats, total, origin, top)

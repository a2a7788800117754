"""Latency histograms on the wire: log-spaced buckets that merge by adding counts.

A p95 does not merge: the highest of several small windows' p95s sits near their maximum, and
a mean of them says little either. Runtime workers therefore also report each window's TTFT
samples as a sparse histogram — ``((bucket, count), ...)`` sorted by bucket — which the streams
add up over a load window and read any quantile from. Bucket ``i`` holds values in
``(2^((i−1)/8), 2^(i/8)]`` ms: eight buckets per doubling, so a quantile read at the bucket's
geometric middle is within ±4.4 % of the sample it stands for.

The buckets hold any positive quantity, not only milliseconds: the runtime reports its prompt
lengths (tokens) the same way, and :func:`moments` gives the mean and squared coefficient of
variation gearbox's queueing estimate needs (the M/G/c correction, :mod:`gearbox.cost`).

A request the runtime refused for want of room never gets a first token: its TTFT is beyond
every bucket (right-censored). :func:`censored_quantile_ms` reads a quantile with such samples
counted above all others; when the quantile falls among them it is only known to lie past the
largest sample, and says so.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

__all__ = [
    "Histogram",
    "censored_quantile_ms",
    "histogram",
    "merge",
    "moments",
    "points",
    "quantile_ms",
    "total",
]

_PER_DOUBLING = 8
_FLOOR_MS = 1e-3  # values at or below it share the lowest bucket (0 ms would have no log)

Histogram = tuple[tuple[int, int], ...]  # (bucket, count), sorted by bucket, counts > 0


def _bucket(value_ms: float) -> int:
    return math.ceil(_PER_DOUBLING * math.log2(max(value_ms, _FLOOR_MS)))


def histogram(values_ms: Iterable[float]) -> Histogram:
    """The sparse histogram of ``values_ms``."""
    counts: dict[int, int] = {}
    for value in values_ms:
        bucket = _bucket(value)
        counts[bucket] = counts.get(bucket, 0) + 1
    return tuple(sorted(counts.items()))


def merge(a: Histogram, b: Histogram) -> Histogram:
    """The histogram of both sample sets; entries with a count below 1 are dropped, so a
    malformed report's histogram comes out well-formed."""
    counts: dict[int, int] = {}
    for bucket, count in (*a, *b):
        if count > 0:
            counts[bucket] = counts.get(bucket, 0) + count
    return tuple(sorted(counts.items()))


def total(h: Histogram) -> int:
    """Samples in ``h``."""
    return sum(count for _, count in h)


def _middle(bucket: int) -> float:
    return float(2 ** ((bucket - 0.5) / _PER_DOUBLING))


def quantile_ms(h: Histogram, q: float) -> float | None:
    """The ``q`` quantile by nearest rank, at its bucket's geometric middle; None when empty.
    (Any unit: the histogram's values come back in the unit they went in.)"""
    return _at_rank(h, max(1, math.ceil(q * total(h))))


def _at_rank(h: Histogram, rank: int) -> float | None:
    """The ``rank``-th smallest sample (from 1), at its bucket's geometric middle; None past
    the last."""
    seen = 0
    for bucket, count in h:
        seen += count
        if seen >= rank:
            return _middle(bucket)
    return None


def censored_quantile_ms(h: Histogram, q: float, beyond: int) -> tuple[float | None, bool]:
    """The ``q`` quantile by nearest rank of ``h``'s samples plus ``beyond`` samples larger
    than any of them (module docstring), and whether it is only a lower bound: when its rank
    falls among those ``beyond``, the largest sample's middle (None without samples) — the
    quantile lies past it. With ``beyond`` 0 this is :func:`quantile_ms`."""
    rank = max(1, math.ceil(q * (total(h) + max(0, beyond))))
    value = _at_rank(h, rank)
    if value is None:
        return (_middle(h[-1][0]) if h else None), beyond > 0
    return value, False


def points(h: Histogram) -> tuple[tuple[float, int], ...]:
    """``h`` as (value at the bucket's geometric middle, count) pairs, ascending: a form a
    reader can use without knowing the bucket scheme (gearbox's snapshot)."""
    return tuple((_middle(b), c) for b, c in h)


def moments(h: Histogram) -> tuple[float, float] | None:
    """(mean, squared coefficient of variation Var/mean²) at the buckets' geometric middles;
    None when empty. The ±4.4 % bucket width adds at most ~0.2 % to the variation."""
    n = total(h)
    if n == 0:
        return None
    mean = sum(c * _middle(b) for b, c in h) / n
    mean_sq = sum(c * _middle(b) ** 2 for b, c in h) / n
    return mean, max(0.0, mean_sq / (mean * mean) - 1.0)

"""Windowed load: kernel-launch rates per GPU and serving load per deployment (pure).

Both fold reports into :mod:`streams.windows` hopping windows on event time. Serving reports
come from one or more runtime workers (sources) per deployment; each source's window yields its
rates, and the deployment's load is their sum (rates, queue, sequences, KV) or maximum (p95s).

The window's TTFT p95 counts the requests refused for want of room (``capacity_refusals``) as
samples beyond every bucket: they never got a first token, and leaving them out would make a
plan that sheds its excess look faster than one that serves it. When over 5 % of the window's
requests were so refused, the p95 is among them and only a lower bound is known
(:func:`flexpipe.latency.censored_quantile_ms`); the aggregate says so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from flexpipe.latency import (
    Histogram,
    censored_quantile_ms,
    merge,
    moments,
    points,
    quantile_ms,
    total,
)
from flexpipe.schemas import KernelLaunches, ServingLoad
from streams.state import Dedupe, is_duplicate
from streams.windows import HoppingWindow, Panes, add, aggregate

__all__ = [
    "LaunchSums",
    "LaunchWindow",
    "LoadSums",
    "ServingAggregate",
    "ServingWindows",
    "fold_launches",
    "fold_serving",
    "launch_rate",
    "serving_aggregate",
]


@dataclass(frozen=True, slots=True)
class LaunchSums:
    """Kernel launches and the time they were counted over."""

    launches: int = 0
    covered_s: float = 0.0


class _LaunchMonoid:
    def empty(self) -> LaunchSums:
        return LaunchSums()

    def combine(self, a: LaunchSums, b: LaunchSums) -> LaunchSums:
        return LaunchSums(a.launches + b.launches, a.covered_s + b.covered_s)


LAUNCHES = _LaunchMonoid()


@dataclass(frozen=True, slots=True)
class LaunchWindow:
    """One GPU's launch counts over a hopping window."""

    panes: Panes[LaunchSums] = field(default_factory=Panes)
    dedupe: Dedupe = field(default_factory=Dedupe)
    late: int = 0  # reports older than the window could hold


def fold_launches(
    state: LaunchWindow,
    window: HoppingWindow,
    report: KernelLaunches,
    source: str,
    seq: int,
    event_time_ms: int,
) -> tuple[LaunchWindow, bool]:
    """Fold one launch report; returns (state, applied)."""
    if is_duplicate(state.dedupe, source, seq, event_time_ms):
        return state, False
    launches, interval_s = report.launches, report.interval_s
    panes = state.panes.panes
    if panes:
        # NOTE: the common case inlined (this runs for five of every six telemetry events): the
        # report lands in the newest pane, which is the only one that changes. Same values as
        # add() + LAUNCHES.combine below: the pane's sums plus max(0, launches) and
        # max(0.0, interval_s), in that order (tests/streams/test_load.py compares the two).
        index, last = panes[-1]
        if math.floor(event_time_ms / 1000.0 / window.step_s) == index:
            sums = LaunchSums(
                last.launches + (launches if launches > 0 else 0),
                last.covered_s + (interval_s if interval_s > 0.0 else 0.0),
            )
            return LaunchWindow(
                Panes((*panes[:-1], (index, sums))),
                Dedupe(source, seq, event_time_ms),
                state.late,
            ), True
    sums = LaunchSums(max(0, launches), max(0.0, interval_s))
    result = add(window, state.panes, event_time_ms / 1000.0, sums, LAUNCHES)
    dedupe = Dedupe(source, seq, event_time_ms)
    if result.late:
        return replace(state, dedupe=dedupe, late=state.late + 1), False
    return LaunchWindow(result.state, dedupe, state.late), True


def launch_rate(state: LaunchWindow, window: HoppingWindow, now_s: float) -> float:
    """Launches per second over the window ending at ``now_s`` (0 without reports)."""
    sums = aggregate(window, state.panes, now_s, LAUNCHES)
    return sums.launches / sums.covered_s if sums.covered_s > 0 else 0.0


@dataclass(frozen=True, slots=True)
class LoadSums:
    """Sums over serving reports of one source, plus its latest gauges (by event time)."""

    reports: int = 0
    covered_s: float = 0.0  # sum of the reports' own window lengths
    arrivals: int = 0
    capacity_refusals: int = 0  # requests refused for want of room: TTFTs beyond every bucket
    prefill_tokens: float = 0.0  # rate × window, summed
    decode_tokens: float = 0.0
    prompt_tokens: float = 0.0  # mean prompt tokens × arrivals, summed
    output_tokens: float = 0.0
    ttft_p95_ms: float = 0.0  # maximum seen
    tbt_p95_ms: float = 0.0
    gauge_time_ms: int = -1  # event time of the gauges below
    queue_len: int = 0
    active_sequences: int = 0
    kv_bytes: int = 0
    ttft_histogram: Histogram = ()  # every TTFT sample of the reports (flexpipe.latency)
    prompt_histogram: Histogram = ()  # every arrival's prompt tokens, same buckets


class _LoadMonoid:
    def empty(self) -> LoadSums:
        return LoadSums()

    def combine(self, a: LoadSums, b: LoadSums) -> LoadSums:
        latest = max(a, b, key=lambda s: (s.gauge_time_ms, s.queue_len, s.active_sequences))
        return LoadSums(
            reports=a.reports + b.reports,
            covered_s=a.covered_s + b.covered_s,
            arrivals=a.arrivals + b.arrivals,
            capacity_refusals=a.capacity_refusals + b.capacity_refusals,
            prefill_tokens=a.prefill_tokens + b.prefill_tokens,
            decode_tokens=a.decode_tokens + b.decode_tokens,
            prompt_tokens=a.prompt_tokens + b.prompt_tokens,
            output_tokens=a.output_tokens + b.output_tokens,
            ttft_p95_ms=max(a.ttft_p95_ms, b.ttft_p95_ms),
            tbt_p95_ms=max(a.tbt_p95_ms, b.tbt_p95_ms),
            gauge_time_ms=latest.gauge_time_ms,
            queue_len=latest.queue_len,
            active_sequences=latest.active_sequences,
            kv_bytes=latest.kv_bytes,
            ttft_histogram=merge(a.ttft_histogram, b.ttft_histogram),
            prompt_histogram=merge(a.prompt_histogram, b.prompt_histogram),
        )


LOADS = _LoadMonoid()


def _sums(report: ServingLoad, event_time_ms: int) -> LoadSums:
    window_s = max(0.0, report.window_s)
    arrivals = max(0, report.arrivals)
    return LoadSums(
        reports=1,
        covered_s=window_s,
        arrivals=arrivals,
        capacity_refusals=max(0, report.capacity_refusals),
        prefill_tokens=max(0.0, report.prefill_tokens_per_s) * window_s,
        decode_tokens=max(0.0, report.decode_tokens_per_s) * window_s,
        prompt_tokens=max(0.0, report.mean_prompt_tokens) * arrivals,
        output_tokens=max(0.0, report.mean_output_tokens) * arrivals,
        ttft_p95_ms=max(0.0, report.ttft_p95_ms or 0.0),
        tbt_p95_ms=max(0.0, report.tbt_p95_ms or 0.0),
        gauge_time_ms=event_time_ms,
        queue_len=max(0, report.queue_len),
        active_sequences=max(0, report.active_sequences),
        kv_bytes=max(0, report.kv_bytes),
        ttft_histogram=merge((), report.ttft_histogram),
        prompt_histogram=merge((), report.prompt_histogram),
    )


@dataclass(frozen=True, slots=True)
class SourceWindow:
    """One runtime worker's reports for a deployment."""

    source: str
    panes: Panes[LoadSums] = field(default_factory=Panes)
    dedupe: Dedupe = field(default_factory=Dedupe)


@dataclass(frozen=True, slots=True)
class ServingWindows:
    """A deployment's serving load: one window per reporting source, sorted by source."""

    sources: tuple[SourceWindow, ...] = ()
    late: int = 0


def fold_serving(
    state: ServingWindows,
    window: HoppingWindow,
    report: ServingLoad,
    source: str,
    seq: int,
    event_time_ms: int,
) -> tuple[ServingWindows, bool]:
    """Fold one serving report; returns (state, applied)."""
    by_source = {s.source: s for s in state.sources}
    mine = by_source.get(source) or SourceWindow(source)
    if is_duplicate(mine.dedupe, source, seq, event_time_ms):
        return state, False
    result = add(window, mine.panes, event_time_ms / 1000.0, _sums(report, event_time_ms), LOADS)
    dedupe = Dedupe(source, seq, event_time_ms)
    by_source[source] = SourceWindow(
        source, result.state if not result.late else mine.panes, dedupe
    )
    # NOTE: a source silent for a whole window holds only empty panes: drop it so the state
    # does not grow with every worker that ever reported.
    newest = max(w.panes.newest_pane or 0 for w in by_source.values())
    kept = tuple(
        w
        for _, w in sorted(by_source.items())
        if (w.panes.newest_pane or 0) > newest - 2 * window.num_panes
    )
    return ServingWindows(kept, state.late + int(result.late)), not result.late


@dataclass(frozen=True, slots=True)
class ServingAggregate:
    """A deployment's load over the window ending at ``now_s``."""

    reports: int
    arrival_rate_rps: float
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    mean_prompt_tokens: float  # 0 without arrivals
    mean_output_tokens: float
    queue_len: int
    active_sequences: int
    kv_bytes: int
    ttft_p95_ms: float  # highest of the reports' own p95s
    tbt_p95_ms: float
    # p95 of every TTFT sample in the window, capacity refusals counted beyond them all (0
    # without samples); a lower bound — the largest sample — when the p95 falls among refusals
    window_ttft_p95_ms: float
    num_ttft_samples: int
    num_ttft_refused: int = 0  # capacity refusals counted in window_ttft_p95_ms
    window_ttft_p95_censored: bool = False  # window_ttft_p95_ms is only a lower bound
    # prompt tokens over every arrival of the window (0 = no histogram reported): the tail and
    # the spread gearbox's TTFT estimate needs (gearbox.cost, M/G/c wait)
    p95_prompt_tokens: float = 0.0
    prompt_tokens_scv: float = 0.0  # squared coefficient of variation, Var / mean²
    prompt_lengths: tuple[tuple[float, int], ...] = ()  # (tokens, count), ascending


def serving_aggregate(
    state: ServingWindows, window: HoppingWindow, now_s: float
) -> ServingAggregate:
    """Sum of every source's rates and gauges over the window ending at ``now_s``."""
    parts = [aggregate(window, s.panes, now_s, LOADS) for s in state.sources]
    parts = [p for p in parts if p.reports]
    arrivals = sum(p.arrivals for p in parts)
    ttfts: Histogram = ()
    prompts: Histogram = ()
    for p in parts:
        ttfts = merge(ttfts, p.ttft_histogram)
        prompts = merge(prompts, p.prompt_histogram)
    spread = moments(prompts)
    refused = sum(p.capacity_refusals for p in parts)
    ttft_p95_ms, censored = censored_quantile_ms(ttfts, 0.95, refused)

    def rate(value: float, covered_s: float) -> float:
        return value / covered_s if covered_s > 0 else 0.0

    return ServingAggregate(
        reports=sum(p.reports for p in parts),
        arrival_rate_rps=sum(rate(p.arrivals, p.covered_s) for p in parts),
        prefill_tokens_per_s=sum(rate(p.prefill_tokens, p.covered_s) for p in parts),
        decode_tokens_per_s=sum(rate(p.decode_tokens, p.covered_s) for p in parts),
        mean_prompt_tokens=rate(sum(p.prompt_tokens for p in parts), arrivals),
        mean_output_tokens=rate(sum(p.output_tokens for p in parts), arrivals),
        queue_len=sum(p.queue_len for p in parts),
        active_sequences=sum(p.active_sequences for p in parts),
        kv_bytes=sum(p.kv_bytes for p in parts),
        ttft_p95_ms=max((p.ttft_p95_ms for p in parts), default=0.0),
        tbt_p95_ms=max((p.tbt_p95_ms for p in parts), default=0.0),
        window_ttft_p95_ms=ttft_p95_ms or 0.0,
        num_ttft_samples=total(ttfts),
        num_ttft_refused=refused,
        window_ttft_p95_censored=censored,
        p95_prompt_tokens=quantile_ms(prompts, 0.95) or 0.0,
        prompt_tokens_scv=spread[1] if spread is not None else 0.0,
        prompt_lengths=points(prompts),
    )

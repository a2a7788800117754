"""One system's run as plain, rounded, JSON-ready data (no wall-clock figures anywhere).

Definitions used in the report (stated once, here):

* per-minute quantiles — over the requests whose first token came out in that minute (TTFT) or
  the inter-token gaps of iterations ending in it (TBT); minutes with fewer than
  ``MIN_SAMPLES`` requests are left out of peaks and recoveries (too few to estimate a p95);
* steady p95 before an event — the median of the per-minute p95s over ``STEADY_S`` before it;
* peak p95 after a preemption — the highest per-minute p95 from the event to the next
  preemption (or the end of the run);
* time to recover — from the event to the first minute, at or after the peak, that starts
  ``RECOVER_MINUTES`` consecutive minutes within ``RECOVER_FACTOR`` × the steady p95;
* shift durations — from the runtime's persisted transition records: prepare (shadow load),
  switch (canary, KV hand-over, route-table swap) and cleanup (drain); "the shift" is the switch
  phase, during which both plans serve and KV moves (the article's 3–5 s / 8–15 s);
* post-preemption TTFT p95 — over the requests whose first token came out in the
  ``AFTER_S`` after the event, against the ``BEFORE_S`` before it; requests refused for want of
  room in a window count as TTFTs beyond every sample there (as :mod:`streams.load` counts
  them: a plan that sheds its excess must not look faster than one that serves it), and a p95
  that falls among them is a lower bound (``..._censored``);
* SLO goodput — prompt + output tokens of requests within both SLOs (see
  :mod:`bench.sim.metrics`) over the tokens offered (every arrival's prompt + requested output);
* estimator error — per decision tick, |gearbox's TTFT p95 estimate for the serving plan −
  the TTFT p95 observed in the ``ESTIMATE_WINDOW_S`` after the tick| / observed (minute
  granularity: the window starts at the tick's minute; refusals for want of room counted as
  above, see :func:`estimator_ticks`);
* flaps — executed voluntary shifts (not forced by lost GPUs) that start less than
  ``FLAP_WINDOW_S`` after the same deployment's previous executed shift; reversals — executed
  shifts straight back to the plan the previous one left, within the window. Decisions whose
  transition rolled back are counted apart (``rolled_back``).
"""

from __future__ import annotations

import math
import re
import statistics
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from bench.sim.des import DecisionLog, RunResult, TransitionLog
from bench.sim.metrics import (
    DeploymentMetrics,
    Histogram,
    censored_quantile_ms,
    merge,
    quantile_ms,
    weight,
)
from sim.spec import Scenario

MIN_SAMPLES = 20
STEADY_S = 1800.0
RECOVER_FACTOR = 1.2
RECOVER_MINUTES = 3
FLAP_WINDOW_S = 600.0
QUANTILES = (("p50", 0.50), ("p95", 0.95), ("p99", 0.99))
AFTER_S = 600.0  # post-preemption window of the TTFT p95 ratio
ESTIMATE_WINDOW_S = 300.0  # observed TTFT p95 an estimate at a decision tick is checked against
BEFORE_S = 3600.0  # and the window before it


def rnd(value: float | None, digits: int = 1) -> float | None:
    """Round for the results file (``None`` stays ``None``)."""
    return None if value is None else round(value, digits)


def quantiles(h: Histogram) -> dict[str, float | None]:
    """p50/p95/p99 of a histogram, in ms."""
    return {name: rnd(quantile_ms(h, q)) for name, q in QUANTILES}


def minute_p95(series: Mapping[int, Histogram]) -> dict[int, float]:
    """Per-minute p95 for minutes with enough samples."""
    out: dict[int, float] = {}
    for minute in sorted(series):
        h = series[minute]
        value = quantile_ms(h, 0.95)
        if weight(h) >= MIN_SAMPLES and value is not None:
            out[minute] = value
    return out


def _served_share(metrics: DeploymentMetrics, event_s: float, end_s: float) -> dict[str, Any]:
    """Arrivals and refusals from ``event_s`` to ``end_s`` (latencies only see the served)."""
    minutes = range(int(event_s // 60), math.ceil(end_s / 60))
    arrivals = sum(metrics.arrivals.get(m, 0) for m in minutes)
    rejected = sum(metrics.rejected.get(m, 0) for m in minutes)
    return {
        "arrivals": arrivals,
        "rejected": rejected,
        "rejected_share": rnd(rejected / arrivals, 4) if arrivals else None,
    }


def window_ttft_p95(
    metrics: DeploymentMetrics, start_s: float, end_s: float
) -> tuple[float | None, bool]:
    """TTFT p95 of the requests whose first token came out in ``[start_s, end_s)`` and of
    those refused for want of room then (beyond every sample), and whether it is only a lower
    bound (:func:`bench.sim.metrics.censored_quantile_ms`)."""
    samples, refused = _ttft_window(metrics, start_s, end_s)
    return censored_quantile_ms(samples, 0.95, refused)


def _ttft_window(metrics: DeploymentMetrics, start_s: float, end_s: float) -> tuple[Histogram, int]:
    """The window's TTFT samples, merged, and its capacity refusals."""
    return metrics.window(metrics.ttft, start_s, end_s), metrics.refused_in(start_s, end_s)


def _around(metrics: DeploymentMetrics, event_s: float) -> dict[str, Any]:
    """TTFT p95 over ``AFTER_S`` after an event and over ``BEFORE_S`` before it (a lower
    bound when ``..._censored``)."""
    after, after_censored = window_ttft_p95(metrics, event_s, event_s + AFTER_S)
    before, before_censored = window_ttft_p95(metrics, event_s - BEFORE_S, event_s)
    return {
        "ttft_p95_after_ms": rnd(after),
        "ttft_p95_after_censored": after_censored,
        "ttft_p95_before_ms": rnd(before),
        "ttft_p95_before_censored": before_censored,
    }


def event_response(
    p95: Mapping[int, float], event_s: float, end_s: float
) -> dict[str, float | None]:
    """Steady p95 before ``event_s``, peak in ``[event_s, end_s)``, and the time to recover."""
    first = int(event_s // 60)
    before = [v for m, v in p95.items() if (event_s - STEADY_S) / 60 <= m < first]
    steady = statistics.median(before) if before else None
    after = sorted((m, v) for m, v in p95.items() if first <= m < end_s / 60)
    if not after:
        return {"steady_p95_ms": rnd(steady), "peak_p95_ms": None, "recover_s": None}
    peak_minute, peak = max(after, key=lambda mv: (mv[1], -mv[0]))
    recover = None
    if steady is not None:
        calm = [m for m, v in after if m >= peak_minute and v <= RECOVER_FACTOR * steady]
        for m in calm:
            if all(m + k in calm for k in range(RECOVER_MINUTES)):
                recover = max(0.0, m * 60.0 - event_s)
                break
    return {
        "steady_p95_ms": rnd(steady),
        "peak_p95_ms": rnd(peak),
        "peak_at_s": float(peak_minute * 60),
        "recover_s": rnd(recover),
    }


def _phases(
    metrics: DeploymentMetrics, scenario: Scenario, name: str, duration_s: float
) -> dict[str, Any]:
    spec = next(d for d in scenario.deployments if d.name == name)
    out: dict[str, Any] = {}
    for phase in spec.workload.phases:
        if phase.start_s >= duration_s:
            continue
        end = min(phase.end_s, duration_s)
        ttft = metrics.window(metrics.ttft, phase.start_s, end)
        out[phase.name] = {
            "start_s": phase.start_s,
            "end_s": end,
            "requests": round(weight(ttft)),
            "ttft_ms": quantiles(ttft),
            "tbt_ms": quantiles(metrics.window(metrics.tbt, phase.start_s, end)),
        }
    return out


def _series(metrics: DeploymentMetrics, duration_s: float) -> dict[str, list[Any]]:
    minutes = list(range(int(duration_s // 60) + (1 if duration_s % 60 else 0)))
    out: dict[str, list[Any]] = {"minute": minutes}
    for label, series in (("ttft", metrics.ttft), ("tbt", metrics.tbt)):
        for q_name, q in QUANTILES:
            out[f"{label}_{q_name}_ms"] = [
                rnd(quantile_ms(series[m], q)) if m in series else None for m in minutes
            ]
    out["completions"] = [metrics.completions.get(m, 0) for m in minutes]
    out["rejected"] = [metrics.rejected.get(m, 0) for m in minutes]
    out["tokens"] = [metrics.tokens.get(m, 0) for m in minutes]
    return out


def deployment_summary(
    result: RunResult, scenario: Scenario, name: str, duration_s: float
) -> dict[str, Any]:
    """One deployment's latencies, counters and responses to each preemption."""
    metrics = result.metrics[name]
    p95 = minute_p95(metrics.ttft)
    starts = result.preemptions
    ends = [*starts[1:], duration_s][: len(starts)]
    offered = result.offered_tokens.get(name, 0)
    return {
        "arrivals": sum(metrics.arrivals.values()),
        "completions": sum(metrics.completions.values()),
        "tokens": sum(metrics.tokens.values()),
        "offered_tokens": offered,
        "goodput_tokens": metrics.goodput_tokens,
        "goodput_of_offered": rnd(metrics.goodput_tokens / offered, 4) if offered else None,
        "slo_ms": {"ttft": metrics.ttft_slo_s * 1000.0, "tbt": metrics.tbt_slo_s * 1000.0},
        "slo_missed": {"ttft": metrics.missed_ttft, "tbt": metrics.missed_tbt},
        "rejections": dict(sorted(metrics.rejections.items())),
        "unfinished": result.unfinished.get(name, 0),
        "replays": metrics.replays,
        "ttft_ms": quantiles(merge(metrics.ttft.values())),
        "ttft_chat_ms": quantiles(metrics.chat_ttft),
        "ttft_summarisation_ms": quantiles(metrics.summarisation_ttft),
        "tbt_ms": quantiles(merge(metrics.tbt.values())),
        "phases": _phases(metrics, scenario, name, duration_s),
        "preemptions": [
            {
                "t_s": t,
                **event_response(p95, t, end),
                **_served_share(metrics, t, end),
                **_around(metrics, t),
            }
            for t, end in zip(starts, ends, strict=True)
        ],
        "per_minute": _series(metrics, duration_s),
    }


def estimator_errors(result: RunResult) -> list[float]:
    """:func:`estimator_ticks`' errors, the ticks with an unknown error left out."""
    return [e for e in estimator_ticks(result) if e is not None]


def estimator_ticks(result: RunResult) -> list[float | None]:
    """Per decision tick and deployment: |estimated − observed| / observed TTFT p95, where the
    estimate is gearbox's for the serving plan at the tick and the observation the p95 of the
    requests whose first token came out in the ``ESTIMATE_WINDOW_S`` after it and of those
    refused for want of room then (:func:`window_ttft_p95`). Ticks with fewer than
    ``MIN_SAMPLES`` such requests are left out. ``None`` for a tick whose observed p95 is only a
    lower bound that the estimate reaches (its error is unknown: the summary counts these as
    ``censored``); an estimate below such a bound counts its distance to the bound (a lower
    bound of its error)."""
    out: list[float | None] = []
    for d in result.decisions:
        if d.est_ttft_p95_ms is None:
            continue
        metrics = result.metrics[d.deployment]
        end_s = d.t_s + ESTIMATE_WINDOW_S
        samples, refused = _ttft_window(metrics, d.t_s, end_s)  # (merged once: weighed below)
        observed, censored = censored_quantile_ms(samples, 0.95, refused)
        if observed is None or weight(samples) < MIN_SAMPLES:
            continue
        if censored and d.est_ttft_p95_ms >= observed:
            out.append(None)
            continue
        out.append(abs(d.est_ttft_p95_ms - observed) / observed)
    return out


def _error_summary(ticks: Sequence[float | None]) -> dict[str, Any]:
    censored = sum(1 for e in ticks if e is None)
    ordered = sorted(e for e in ticks if e is not None)
    if not ordered:
        return {"ticks": 0, "censored": censored, "median": None, "p95": None}
    return {
        "ticks": len(ordered),
        "censored": censored,
        "median": rnd(statistics.median(ordered), 3),
        "p95": rnd(ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)], 3),
    }


def tick_reason(d: DecisionLog) -> str:
    """The tick's reason, with gearbox's ``held_by_hysteresis`` split: held only while some
    candidate gains more than its switch cost (else ``gain_below_cost``, which hysteresis
    did not decide).

    NOTE: gearbox gives held_by_hysteresis for any positive gain; the split is made here until
    the decision reason itself is split (its wire type is being changed elsewhere).
    """
    if d.reason == "held_by_hysteresis" and not d.gain_over_cost:
        return "gain_below_cost"
    return d.reason


def flap_counts(shifts: Sequence[Mapping[str, Any]], window_s: float) -> dict[str, int]:
    """Churn among executed shifts (see the module docstring)."""
    last: dict[str, Mapping[str, Any]] = {}
    out = {"shifts": 0, "flaps": 0, "reversals": 0, "rolled_back": 0}
    for shift in shifts:
        if shift["outcome"] == "rolled_back":
            out["rolled_back"] += 1
        if shift["outcome"] != "done":
            continue
        out["shifts"] += 1
        previous = last.get(shift["deployment"])
        if previous is not None and shift["t_s"] - previous["t_s"] < window_s:
            out["flaps"] += 0 if shift["forced"] else 1
            out["reversals"] += shift["to_plan_id"] == previous["from_plan_id"]
        last[shift["deployment"]] = shift
    return out


def _failure(log: TransitionLog) -> str | None:
    failed = [r for r in log.records if r[2] == "failed"]
    return failed[-1][5] if failed else None


def failure_kinds(shifts: Sequence[Mapping[str, Any]]) -> dict[str, int]:
    """Why transitions rolled back: the last failure's text with ids and numbers blanked."""
    kinds: Counter[str] = Counter()
    for shift in shifts:
        if shift["outcome"] == "rolled_back" and shift["last_failure"]:
            text = re.sub(r"(xp|dp)-[0-9a-f]+", r"\1-…", shift["last_failure"])
            kinds[re.sub(r"GPU-sim-[\w-]+", "GPU-…", text)] += 1
    return dict(sorted(kinds.items()))


def _phase_s(log: TransitionLog, phase: str) -> float | None:
    done = [r for r in log.records if r[1] == phase and r[2] == "completed"]
    return rnd(done[-1][4] / 1000.0, 3) if done and done[-1][4] is not None else None


def shift_summary(
    transitions: Sequence[TransitionLog], decisions: Sequence[DecisionLog]
) -> list[dict[str, Any]]:
    """Every transition after the starting placement, with phase durations and KV moved."""
    by_seq = {(d.deployment, d.seq): d for d in decisions if d.seq is not None}
    out = []
    for log in transitions:
        decision = by_seq.get((log.deployment, log.seq))
        if decision is None or decision.trigger == "operator":
            continue
        outcome = "done" if any(r[1] == "done" for r in log.records) else "rolled_back"
        if not any(r[1] in ("done", "rolled_back") for r in log.records):
            outcome = "in_flight"
        out.append(
            {
                "deployment": log.deployment,
                "seq": log.seq,
                "t_s": rnd(decision.t_s, 2),
                "trigger": decision.trigger,
                "reason": decision.reason,
                "forced": decision.forced,
                "from_plan_id": decision.from_plan_id,
                "to_plan_id": decision.to_plan_id,
                "to_gpus": decision.to_gpus,
                "outcome": outcome,
                "last_failure": _failure(log),
                "prepare_s": _phase_s(log, "prepare"),
                "switch_s": _phase_s(log, "switch"),
                "cleanup_s": _phase_s(log, "cleanup"),
                "total_s": _phase_s(log, "done"),
                "kv_bytes_moved": log.kv_bytes_end - log.kv_bytes_start,
                "est_shift_s": rnd(decision.est_shift_s, 3),
                "est_kv_bytes": decision.est_kv_bytes,
            }
        )
    return out


def decision_delay_s(result: RunResult) -> float | None:
    """First preemption → the first decision tick that saw it (None without a gear loop).

    The tick runs ``decide`` for every deployment on the observed topology; whether it
    switches is in ``first_response``.
    """
    if not result.preemptions or not result.system.adaptive:
        return None
    first = result.preemptions[0]
    seen = [s for t, s in result.observed_s if t == first]
    ticks = [d.t_s for d in result.decisions if seen and d.t_s >= seen[0]]
    return rnd(min(ticks) - first, 2) if ticks else None


def first_response(
    shifts: Sequence[Mapping[str, Any]], event_s: float, end_s: float
) -> dict[str, Any]:
    """Per deployment, the first shift decided in ``[event_s, end_s)``: when, and when done."""
    out: dict[str, Any] = {}
    for shift in shifts:
        name = shift["deployment"]
        if not event_s <= shift["t_s"] < end_s or name in out:
            continue
        done_at = shift["t_s"] + shift["total_s"] if shift["total_s"] is not None else None
        out[name] = {
            "decided_after_s": rnd(shift["t_s"] - event_s, 2),
            "done_after_s": rnd(done_at - event_s, 2) if done_at is not None else None,
            "reason": shift["reason"],
            "outcome": shift["outcome"],
        }
    return out


def _first_response(
    shifts: Sequence[Mapping[str, Any]], preemptions: Sequence[float], duration_s: float
) -> dict[str, Any]:
    if not preemptions:
        return {}
    end = preemptions[1] if len(preemptions) > 1 else duration_s
    return first_response(shifts, preemptions[0], end)


def system_summary(result: RunResult, scenario: Scenario, duration_s: float) -> dict[str, Any]:
    """The whole system's run."""
    names = sorted(result.metrics)
    deployments = {n: deployment_summary(result, scenario, n, duration_s) for n in names}
    shifts = shift_summary(result.transitions, result.decisions)
    reasons: dict[str, int] = {}
    for d in result.decisions:
        reason = tick_reason(d)
        reasons[reason] = reasons.get(reason, 0) + 1
    util = {k: rnd(v, 4) for k, v in result.utilisation.summary().items()}
    gpus = result.utilisation.gpus_by_minute
    offered = sum(d["offered_tokens"] for d in deployments.values())
    good = sum(d["goodput_tokens"] for d in deployments.values())
    return {
        "label": result.system.label,
        "tokens": sum(d["tokens"] for d in deployments.values()),
        "offered_tokens": offered,
        "goodput_tokens": good,
        "goodput_of_offered": rnd(good / offered, 4) if offered else None,
        "rejections": sum(sum(d["rejections"].values()) for d in deployments.values()),
        "deployments": deployments,
        "utilisation": util,
        "gpus_by_minute": [gpus.get(m, None) for m in range(int(duration_s // 60))],
        "shifts": shifts,
        "decision_ticks": dict(sorted(reasons.items())),
        "flaps": flap_counts(shifts, FLAP_WINDOW_S),
        "rollback_causes": failure_kinds(shifts),
        "decision_delay_s": decision_delay_s(result),
        "first_response": _first_response(shifts, result.preemptions, duration_s),
        "observed_delays_s": [rnd(seen - t, 3) for t, seen in result.observed_s],
        "violations": result.violations,
        "estimator_error": _error_summary(estimator_ticks(result)),
    }

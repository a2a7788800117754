"""The comparison: headline figures, targets and the side-by-side table.

Headline latencies are the TTFT of the deployment serving the largest model (chat-70b in the
seed scenario) — the one the article's baseline (TP8 on block A) serves and the preemptions hit;
the other deployment's figures are in the table and the file. Every ratio compares systems of
the same run (same trace, seeds and cost model).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from bench.sim.summary import rnd

SYSTEM_ORDER = (
    "fixed",
    "static_rr",
    "flexpipe",
    "no_hysteresis",
    "replay_only",
    "no_pd_split",
    "oracle",
)
# Systems without a gear loop: no decision is expected of them after a preemption.
FIXED_PLANS = ("fixed", "static_rr", "oracle")

# The article's figures (DESIGN.md §0.1): baseline = fixed TP8 on block A.
ARTICLE: dict[str, Any] = {
    "throughput_ratio": 1.49,  # baseline total tokens ≈ 67 % of FlexPipe's
    "steady_p95_ms": 380.0,
    "fixed_peak_p95_ms": 2100.0,
    "flexpipe_peak_p95_ms": 850.0,
    "p95_peak_ratio": 850.0 / 380.0,
    "p95_peak_vs_fixed": 850.0 / 2100.0,
    "decision_delay_s": 40.0,
    "shift_s_7b": "3-5",
    "shift_s_70b": "8-15",
    "memory_utilisation_gain": 0.22,
    "compute_utilisation_gain": 0.18,
    "fixed_recovery": "10+ min after the GPUs return",
}


def _first_preemption(system: Mapping[str, Any], name: str) -> dict[str, Any]:
    events = system["deployments"][name]["preemptions"]
    return events[0] if events else {}


def _ratio(a: float | None, b: float | None, digits: int = 3) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return round(a / b, digits)


def _median_shift(
    system: Mapping[str, Any], deployment: str | None, *, cutover: bool = False
) -> float | None:
    """Median switch-phase duration of executed shifts (``cutover``: prepare + switch)."""
    values = [
        s["switch_s"] + ((s["prepare_s"] or 0.0) if cutover else 0.0)
        for s in system["shifts"]
        if s["switch_s"] is not None and s["outcome"] == "done" and s["deployment"] == deployment
    ]
    return rnd(statistics.median(values), 2) if values else None


def _shift_totals(system: Mapping[str, Any], deployment: str | None) -> list[float]:
    """Whole-transition durations (decision to done) of a deployment's executed shifts."""
    return [
        s["total_s"]
        for s in system["shifts"]
        if s["total_s"] is not None and s["outcome"] == "done" and s["deployment"] == deployment
    ]


def p95_of(values: Sequence[float]) -> float | None:
    """Nearest-rank p95 (``None`` when empty)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)]


def post_preemption_ratios(system: Mapping[str, Any], big: str) -> list[float]:
    """Per preemption: the large model's TTFT p95 in the 10 min after over the hour before."""
    out = []
    for event in system["deployments"][big]["preemptions"]:
        after, before = event.get("ttft_p95_after_ms"), event.get("ttft_p95_before_ms")
        if after is not None and before:
            out.append(after / before)
    return out


def goodput_rows(systems: Mapping[str, Any]) -> dict[str, Any]:
    """Per system: SLO goodput, tokens, rejections by reason and TTFT/TBT quantiles per
    deployment (the compact rows kept for every seed)."""
    rows: dict[str, Any] = {}
    for key, system in systems.items():
        rows[key] = {
            "goodput_of_offered": system["goodput_of_offered"],
            "goodput_tokens": system["goodput_tokens"],
            "offered_tokens": system["offered_tokens"],
            "tokens": system["tokens"],
            "deployments": {
                name: {
                    "goodput_of_offered": dep["goodput_of_offered"],
                    "tokens": dep["tokens"],
                    "rejections": dep["rejections"],
                    "slo_missed": dep["slo_missed"],
                    "ttft_ms": dep["ttft_ms"],
                    "tbt_ms": dep["tbt_ms"],
                }
                for name, dep in system["deployments"].items()
            },
        }
    return rows


def headline(
    systems: Mapping[str, Any], big: str, small: str | None, spread: float = 0.0
) -> dict[str, Any]:
    """The figures the last JSON line carries (all from this run); ``big``/``small`` name the
    deployments of the 70B- and 7B-class models; ``spread`` is the ground truth's (a
    configured constant, reported as the world's setting, not as a measurement)."""
    fixed, flex = systems["fixed"], systems["flexpipe"]
    name = big
    flex_event, fixed_event = _first_preemption(flex, name), _first_preemption(fixed, name)
    flex_peak, steady = flex_event.get("peak_p95_ms"), flex_event.get("steady_p95_ms")
    fixed_util, flex_util = fixed["utilisation"], flex["utilisation"]
    by_dep = [d["goodput_of_offered"] for d in flex["deployments"].values()]
    ratios = post_preemption_ratios(flex, big)
    oracle = systems.get("oracle", {})
    oracle_ratios = post_preemption_ratios(oracle, big) if oracle else []
    return {
        "perturbation_spread": spread,
        "goodput_vs_oracle": _ratio(flex["goodput_tokens"], oracle.get("goodput_tokens"), 4),
        "oracle_goodput_of_offered": oracle.get("goodput_of_offered"),
        "goodput_of_offered": flex["goodput_of_offered"],
        "fixed_goodput_of_offered": fixed["goodput_of_offered"],
        "goodput_ratio_vs_fixed": _ratio(flex["goodput_tokens"], fixed["goodput_tokens"]),
        "goodput_of_offered_by_deployment_min": min(
            (v for v in by_dep if v is not None), default=None
        ),
        "post_preemption_ttft_p95_ratio": rnd(statistics.median(ratios), 3) if ratios else None,
        "oracle_post_preemption_ttft_p95_ratio": (
            rnd(statistics.median(oracle_ratios), 3) if oracle_ratios else None
        ),
        "shift_s_70b_p95": rnd(p95_of(_shift_totals(flex, big)), 2),
        "shift_s_7b_p95": rnd(p95_of(_shift_totals(flex, small)), 2),
        "estimator_error_p95": flex["estimator_error"]["p95"],
        "estimator_error_median": flex["estimator_error"]["median"],
        "estimator_censored_ticks": flex["estimator_error"].get("censored"),
        "throughput_ratio": _ratio(flex["tokens"], fixed["tokens"]),
        "p95_peak_ratio": _ratio(flex_peak, steady),
        "p95_peak_vs_fixed": _ratio(flex_peak, fixed_event.get("peak_p95_ms")),
        "decision_delay_s_modelled": flex["decision_delay_s"],
        "shift_s_7b": _median_shift(flex, small),
        "shift_s_70b": _median_shift(flex, big),
        "flaps_no_hysteresis": systems["no_hysteresis"]["flaps"]["flaps"],
        "flaps_flexpipe": flex["flaps"]["flaps"],
        "steady_p95_ms": steady,
        "peak_p95_ms": flex_peak,
        "fixed_peak_p95_ms": fixed_event.get("peak_p95_ms"),
        "memory_utilisation_gain": _gain(flex_util, fixed_util, "memory_utilisation"),
        "compute_utilisation_gain": _gain(flex_util, fixed_util, "compute_utilisation"),
        "rejections_flexpipe": flex["rejections"],
        "rejections_fixed": fixed["rejections"],
    }


def _gain(a: Mapping[str, Any], b: Mapping[str, Any], key: str) -> float | None:
    ratio = _ratio(a.get(key), b.get(key), 4)
    return None if ratio is None else round(ratio - 1.0, 4)


def _median(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return rnd(statistics.median(present), 4) if present else None


def _least(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return min(present) if present else None


def aggregate(
    runs: Sequence[tuple[Mapping[str, Any], Mapping[str, Any]]],
    big: str,
    small: str | None,
    spread: float,
) -> dict[str, Any]:
    """The headline over seeds from each seed's (headline, systems): medians, the worst seed,
    and quantities pooled over seeds (post-preemption ratios, whole-transition p95s)."""
    heads = [h for h, _ in runs]

    def col(key: str) -> list[float | None]:
        return [h.get(key) for h in heads]

    ratios = [r for _, sy in runs for r in post_preemption_ratios(sy["flexpipe"], big)]
    oracle_ratios = [
        r for _, sy in runs if "oracle" in sy for r in post_preemption_ratios(sy["oracle"], big)
    ]
    shifts_big = [v for _, sy in runs for v in _shift_totals(sy["flexpipe"], big)]
    shifts_small = [v for _, sy in runs for v in _shift_totals(sy["flexpipe"], small)]
    out: dict[str, Any] = {
        "seeds": len(runs),
        "perturbation_spread": spread,
        "goodput_of_offered": _median(col("goodput_of_offered")),
        "goodput_of_offered_min": _least(col("goodput_of_offered")),
        "fixed_goodput_of_offered": _median(col("fixed_goodput_of_offered")),
        "goodput_ratio_vs_fixed": _median(col("goodput_ratio_vs_fixed")),
        "goodput_ratio_vs_fixed_min": _least(col("goodput_ratio_vs_fixed")),
        "goodput_of_offered_by_deployment_min": _median(
            col("goodput_of_offered_by_deployment_min")
        ),
        "post_preemption_ttft_p95_ratio": _median(ratios),
        "oracle_post_preemption_ttft_p95_ratio": _median(oracle_ratios),
        "shift_s_70b_p95": rnd(p95_of(shifts_big), 2),
        "shift_s_7b_p95": rnd(p95_of(shifts_small), 2),
        "flaps_flexpipe": _median(col("flaps_flexpipe")),
        "flaps_no_hysteresis": _median(col("flaps_no_hysteresis")),
        "throughput_ratio": _median(col("throughput_ratio")),
        "decision_delay_s_modelled": _median(col("decision_delay_s_modelled")),
        "rejections_flexpipe": _median(col("rejections_flexpipe")),
        "rejections_fixed": _median(col("rejections_fixed")),
        "goodput_vs_oracle": _median(col("goodput_vs_oracle")),
        "goodput_vs_oracle_min": _least(col("goodput_vs_oracle")),
        "oracle_goodput_of_offered": _median(col("oracle_goodput_of_offered")),
        "estimator_error_p95": _median(col("estimator_error_p95")),
        "estimator_error_median": _median(col("estimator_error_median")),
        "estimator_censored_ticks": _median(col("estimator_censored_ticks")),
    }
    return out


def targets(head: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Issue 12's targets, each with its figure and whether it is met (``None``: not measured)."""

    def check(name: str, op: str, bound: float) -> dict[str, Any]:
        value = head.get(name)
        met = None
        if value is not None:
            met = value >= bound if op == ">=" else value <= bound
        return {"target": name, "value": value, "bound": f"{op} {bound}", "met": met}

    flex, no_h = head.get("flaps_flexpipe"), head.get("flaps_no_hysteresis")
    flaps_ok = None
    if flex is not None and no_h is not None:
        # NOTE: 0 ≥ 2 × 0 would pass with no flaps anywhere, which shows nothing about
        # hysteresis: the ablation must flap more than FlexPipe.
        flaps_ok = no_h >= 3 or (no_h >= 2 * flex and no_h > flex)
    share = check("goodput_of_offered", ">=", 0.93)
    oracle_share = head.get("oracle_goodput_of_offered")
    if oracle_share is not None and oracle_share < 0.93:
        # The exception: the bound is out of reach in this world; said, not moved.
        share["note"] = f"the oracle's own share is {oracle_share}, below the bound"
    after = check("post_preemption_ttft_p95_ratio", "<=", 2.0)
    oracle_after = head.get("oracle_post_preemption_ttft_p95_ratio")
    if oracle_after is not None and oracle_after > 2.0:
        # not an exception the issue grants: the target stays missed, with what the world allows
        after["note"] = f"the oracle's own ratio is {oracle_after}, above the bound"
    return [
        check("goodput_vs_oracle", ">=", 0.90),
        check("goodput_vs_oracle_min", ">=", 0.85),
        share,
        check("goodput_of_offered_by_deployment_min", ">=", 0.90),
        check("goodput_ratio_vs_fixed", ">=", 1.0),
        check("goodput_ratio_vs_fixed_min", ">=", 1.0),
        after,
        check("estimator_error_p95", "<=", 0.5),
        check("flaps_flexpipe", "<=", 1),
        {
            "target": "flaps_no_hysteresis >= 3 or >= 2 x flaps_flexpipe",
            "value": [no_h, flex],
            "bound": ">=",
            "met": flaps_ok,
        },
        check("shift_s_70b_p95", "<=", 15.0),
        check("shift_s_7b_p95", "<=", 5.0),
        {
            "target": "perturbation_spread = 0.3",
            "value": head.get("perturbation_spread"),
            "bound": "=",
            "met": head.get("perturbation_spread") == 0.3,
        },
    ]


# ---- the side-by-side table -----------------------------------------------------------------


def _fmt(value: Any, unit: str = "") -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        text = f"{value:,.2f}" if abs(value) < 100 else f"{value:,.0f}"
    else:
        text = f"{value:,}" if isinstance(value, int) else str(value)
    return f"{text}{unit}"


def _event(system: Mapping[str, Any], name: str, index: int, key: str) -> Any:
    events = system["deployments"].get(name, {}).get("preemptions", [])
    return events[index].get(key) if index < len(events) else None


Getter = Callable[[Mapping[str, Any]], Any]
Row = tuple[str, str, Getter]


def _run_rows(fixed_tokens: int) -> list[Row]:
    return [
        ("SLO goodput / offered", "—", lambda s: s["goodput_of_offered"]),
        ("total tokens (M)", "—", lambda s: round(s["tokens"] / 1e6, 2)),
        ("tokens / fixed", "1.49×", lambda s: _ratio(s["tokens"], fixed_tokens)),
        ("rejected requests", "—", lambda s: s["rejections"]),
    ]


def _deployment_rows(label: str, name: str, article: bool) -> list[Row]:
    def event(index: int, key: str) -> Getter:
        return lambda s: _event(s, name, index, key)

    def first_response(s: Mapping[str, Any]) -> str | None:
        done = s.get("first_response", {}).get(name)
        if not done:
            return None
        return f"{_fmt(done['decided_after_s'])} / {_fmt(done['done_after_s'])}"

    return [
        (f"{label} TTFT p95 steady (ms)", "380" if article else "—", event(0, "steady_p95_ms")),
        (f"{label} peak TTFT p95, 1st preempt (ms)", "2100 / <850" if article else "—",
         event(0, "peak_p95_ms")),
        (f"{label} recover, 1st preempt (s)", "600+ / —" if article else "—",
         event(0, "recover_s")),
        (f"{label} refused in 1st preempt window", "—", event(0, "rejected_share")),
        (f"{label} 1st shift decided / done (s)", "— / 40" if article else "—", first_response),
        (f"{label} peak TTFT p95, 2nd (ms)", "—", event(1, "peak_p95_ms")),
        (f"{label} peak TTFT p95, 3rd (ms)", "—", event(2, "peak_p95_ms")),
        (f"{label} TTFT p50/p95/p99 (ms)", "—",
         lambda s: _trio(s["deployments"][name]["ttft_ms"])),
        (f"{label} TBT p50/p95/p99 (ms)", "—",
         lambda s: _trio(s["deployments"][name]["tbt_ms"])),
        (f"{label} SLO goodput / offered", "—",
         lambda s: s["deployments"][name]["goodput_of_offered"]),
        (f"{label} TTFT p95 10 min after / hour before preempts (ms)", "—",
         lambda s: _around_text(s, name)),
        (f"{label} rejected by reason", "—",
         lambda s: _reasons(s["deployments"][name]["rejections"])),
    ]  # fmt: skip


def _shift_rows(big: str, small: str | None) -> list[Row]:
    def kv_gb(s: Mapping[str, Any]) -> float:
        return round(sum(x["kv_bytes_moved"] for x in s["shifts"]) / 1e9, 1)

    return [
        ("decision delay, modelled (s)", "40", lambda s: s["decision_delay_s"]),
        ("shifts done / rolled back", "—",
         lambda s: f"{s['flaps']['shifts']} / {s['flaps']['rolled_back']}"),
        ("switch phase 7B median (s)", "3–5", lambda s: _median_shift(s, small)),
        ("switch phase 70B median (s)", "8–15", lambda s: _median_shift(s, big)),
        ("prepare+switch 70B median (s)", "—", lambda s: _median_shift(s, big, cutover=True)),
        ("KV moved (GB)", "—", kv_gb),
        ("flaps (<10 min)", "—", lambda s: s["flaps"]["flaps"]),
        ("whole shift 70B median / p95 (s)", "—", lambda s: _totals_text(s, big)),
        ("whole shift 7B median / p95 (s)", "—", lambda s: _totals_text(s, small)),
        ("TTFT p95 estimate error median / p95", "—",
         lambda s: f"{_fmt(s['estimator_error']['median'])} / {_fmt(s['estimator_error']['p95'])}"),
    ]  # fmt: skip


def _utilisation_rows() -> list[Row]:
    def util(key: str) -> Getter:
        return lambda s: s["utilisation"][key]

    return [
        ("memory utilisation", "+22%", util("memory_utilisation")),
        ("compute utilisation (MFU)", "+18%", util("compute_utilisation")),
        ("busy fraction", "—", util("busy_fraction")),
        ("mean GPUs held", "—", util("mean_gpus_held")),
    ]


def _rows(systems: Mapping[str, Any], big: str, small: str | None) -> list[Row]:
    rows = _run_rows(systems["fixed"]["tokens"]) + _deployment_rows("70B", big, True)
    if small is not None:
        rows += _deployment_rows("7B", small, False)
    return rows + _shift_rows(big, small) + _utilisation_rows()


def _around_text(system: Mapping[str, Any], name: str) -> str:
    events = system["deployments"][name]["preemptions"]
    return " ".join(
        f"{_fmt(e.get('ttft_p95_after_ms'))}/{_fmt(e.get('ttft_p95_before_ms'))}" for e in events
    )


def _totals_text(system: Mapping[str, Any], deployment: str | None) -> str | None:
    totals = _shift_totals(system, deployment)
    if not totals:
        return None
    return f"{_fmt(statistics.median(totals))} / {_fmt(p95_of(totals))}"


def _reasons(counts: Mapping[str, int]) -> str:
    return " ".join(f"{k} {v:,}" for k, v in counts.items()) or "0"


def _trio(q: Mapping[str, Any]) -> str:
    return "/".join(_fmt(q.get(k)) for k in ("p50", "p95", "p99"))


def table(systems: Mapping[str, Any], big: str, small: str | None) -> str:
    """metric | article | one column per system (baselines, FlexPipe, ablations)."""
    keys = [k for k in SYSTEM_ORDER if k in systems]
    header = ["metric", "article", *(systems[k]["label"] for k in keys)]
    body = [
        [name, article, *(_fmt(get(systems[k])) for k in keys)]
        for name, article, get in _rows(systems, big, small)
    ]
    widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]
    lines = [" | ".join(c.ljust(w) for c, w in zip(header, widths, strict=True))]
    lines.append("-+-".join("-" * w for w in widths))
    lines += [" | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in body]
    return "\n".join(lines)


def targets_text(rows: Sequence[Mapping[str, Any]]) -> str:
    """One line per target: met / MISSED with the figure."""
    out = []
    for row in rows:
        state = {True: "met", False: "MISSED", None: "n/a"}[row["met"]]
        note = f" — {row['note']}" if "note" in row else ""
        out.append(f"  {state:6} {row['target']}: {row['value']} (target {row['bound']}){note}")
    return "\n".join(out)


def run_problems(systems: Mapping[str, Any], preemptions: Sequence[float]) -> list[str]:
    """What makes a run untrustworthy (not a missed article figure): a broken runtime
    invariant, a deployment that completed nothing, an adaptive system that never decided
    after a preemption, a system with more SLO goodput than the oracle (which is the limit:
    either the oracle missed a plan or something is wrong)."""
    problems = []
    limit = systems["oracle"]["goodput_tokens"] if "oracle" in systems else None
    for key, system in systems.items():
        problems += [f"{key}: {v}" for v in system.get("violations", [])]
        for name, dep in system["deployments"].items():
            if not dep["completions"]:
                problems.append(f"{key}: {name} completed no request")
        adaptive = key not in FIXED_PLANS
        if adaptive and preemptions and system["decision_delay_s"] is None:
            problems.append(f"{key}: no decision after the preemption at {preemptions[0]:g} s")
        if limit is not None and system["goodput_tokens"] > limit:
            problems.append(
                f"{key}: {system['goodput_tokens']:,} SLO goodput tokens, more than the "
                f"oracle's {limit:,}: the oracle is not the limit"
            )
    return problems

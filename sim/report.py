"""What `flexpipe up` saw: a gear timeline, latency over time, shifts and their phases.

Pure bookkeeping plus text rendering (the closing summary and ``report.md``); the orchestration in
:mod:`sim.up` and the live view in :mod:`sim.live` feed it, :mod:`sim.plot` draws
``timeline.png`` from it. Times are simulated seconds since the scenario's epoch.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from pathlib import Path

from flexpipe.schemas import TransitionPhase
from gearbox.decisions import DecisionReason
from sim.record import (
    BUCKET_S,
    LOSSES,
    PHASES,
    RunRecord,
    SeenDecision,
    Shift,
    hms,
    ms,
    plan_shape,
)
from sim.summary import Summary

STORY_WINDOW_S = 120.0  # latency before a cause and after its shift, for the recovery figures


def _sentence(text: str, prefix: str) -> str | None:
    i = text.find(prefix)
    if i < 0:
        return None
    j = text.find(". ", i)
    return text[i + len(prefix) : j if j >= 0 else len(text)].rstrip(".")


def short_explanation(text: str, width: int = 100) -> str:
    """What moved a decision, in one short line: its problems and its gain against its cost.

    NOTE: the explanation's first sentence only repeats deployment, reason and trigger, which the
    live line already shows; the full text goes into ``report.md``.
    """
    parts = []
    problems = _sentence(text, "Problems: ")
    if problems:
        items = problems.split("; ")
        parts.append(items[0] + (f" (+{len(items) - 1} more)" if len(items) > 1 else ""))
    gain = _sentence(text, "Gain ")
    if gain:
        parts.append("gain " + gain.split(";")[0])
    if not parts:
        rest = text.split(". ", 1)
        parts.append(rest[1] if len(rest) > 1 else text)
    line = "; ".join(parts)
    return line if len(line) <= width else line[: width - 1] + "…"


_HANDOVER = re.compile(r"migrated (\d+) \((\d+) B\), replayed (\d+), left to finish on old (\d+)")


def handover_text(detail: str) -> str:
    """The switch record's hand-over detail, short: KV migrated (GB), replayed, left on old."""
    m = _HANDOVER.search(detail)
    if m is None:
        return detail
    migrated, nbytes, replayed, left = (int(g) for g in m.groups())
    if not (migrated or replayed or left):
        return "no sequences to hand over"
    seqs = "sequence" if migrated == 1 else "sequences"
    parts = [f"KV of {migrated} {seqs} migrated ({nbytes / 1e9:.1f} GB)"] if migrated else []
    parts += [f"{replayed} replayed"] if replayed else []
    parts += [f"{left} finished on the old plan"] if left else []
    return ", ".join(parts)


def _handed_over(shift: Shift) -> bool:
    m = _HANDOVER.search(shift.kv_detail)
    return m is not None and any(int(g) for g in (m.group(1), m.group(3), m.group(4)))


def _phases(shift: Shift) -> str:
    parts = []
    for phase in PHASES:
        took = shift.phases_ms.get(phase.value)
        if took is None:
            continue
        text = f"{phase.value} {took / 1000:.1f} s"
        if phase is TransitionPhase.SWITCH and shift.kv_detail:
            text += f" ({handover_text(shift.kv_detail)})"
        parts.append(text)
    return ", ".join(parts) or "no completed phase"


def shift_story(record: RunRecord, shift: Shift, shapes: dict[str, str]) -> list[str]:
    """A shift told from its cause to its recovery, in two to four lines."""
    head = f"{shift.deployment} #{shift.seq}"
    total = shift.phases_ms.get("total")
    took = f" in {total / 1000:.1f} s" if total is not None else ""
    retries = f", {shift.attempts} attempts" if shift.attempts > 1 else ""
    plans = f"{shapes.get(shift.from_plan or '', 'nothing')} → {shift.to_shape}"
    body = [f"    {plans}: {shift.outcome}{took}{retries} — {_phases(shift)}"]
    if shift.failure:
        # NOTE: a retry or a rollback is only auditable with the runtime's reason beside it
        body.append(f"    last failure: {shift.failure}")
    seen = record.decision_of(shift)
    if seen is None:
        return [f"{head} at {hms(shift.start_s)}: the starting plan, loaded at start-up", *body]
    d, cause = seen.decision, record.cause_of(seen)
    if cause is None:
        why = f"{hms(seen.t_s)} {d.trigger} → {d.reason} seen {hms(seen.seen_s)}"
        return [f"{head}: {why}, started {hms(shift.start_s)}", *body]
    if cause.kind in LOSSES and not _handed_over(shift):
        # NOTE: the runtime fails a replica whose GPUs went; its sequences wait and replay on
        # the new plan, outside the switch's hand-over tally.
        body.append("    the replica on the lost GPUs died: its sequences replayed on the new plan")
    before = record.ttft_p95_ms(shift.deployment, cause.t_s - STORY_WINDOW_S, cause.t_s)
    after = record.ttft_p95_ms(shift.deployment, shift.end_s, shift.end_s + STORY_WINDOW_S)
    delay = seen.seen_s - cause.t_s
    return [
        f"{head}: {hms(cause.t_s)} {cause.label} → {d.reason} seen {hms(seen.seen_s)}"
        f" (+{delay:.1f} s), started {hms(shift.start_s)}",
        *body,
        f"    TTFT p95 {ms(before)} ms in the 2 min before, {ms(after)} ms in the 2 min after",
    ]


def _latency_table(record: RunRecord, deployments: list[str], duration_s: float) -> list[str]:
    series = {d: {t: (a, b) for t, a, b, _ in record.latency_series(d)} for d in deployments}
    lines = ["time    " + "".join(f"{d + ' TTFT/TBT':>24}" for d in deployments)]
    for b in range(math.ceil(duration_s / BUCKET_S)):
        t0 = b * BUCKET_S
        cells = [series[d].get(t0, (math.nan, math.nan)) for d in deployments]
        marks = [e.label for e in record.events if t0 <= e.t_s < t0 + BUCKET_S]
        row = "".join(f"{ms(a) + ' / ' + ms(c):>24}" for a, c in cells)
        lines.append(f"{hms(t0)[:5]}   {row}" + (f"   ◂ {'; '.join(marks)}" if marks else ""))
    return lines


def summary_lines(record: RunRecord, deployments: list[str], duration_s: float) -> list[str]:
    """The closing summary, as printed and as written into the report."""
    lines = ["", "== TTFT / TBT p95 (ms) per 2 simulated minutes (SimEngine: simulated latencies)"]
    lines += _latency_table(record, deployments, duration_s)
    lines += ["", "== shifts (simulated time; phase durations from the transition records)"]
    shapes = {rec.to_plan_id or "": plan_shape(rec.plan) for _, rec in record.transitions}
    for s in record.shifts():
        lines += shift_story(record, s, shapes)
    if not record.shifts():
        lines.append("none")
    holds = Counter[str]()
    for (_, reason), n in record.holds.items():
        holds[reason] += n
    lines += [
        "",
        f"== decisions: {len(record.changes())} changed a plan; holds by reason: "
        + (", ".join(f"{r} {n}" for r, n in holds.most_common()) or "none"),
        "",
        f"== throughput and admission (simulated; load from {hms(record.load_start_s)})",
    ]
    for dep in deployments:
        tokens = sum(s.output_tokens for s in record.served if s.deployment == dep)
        reasons = {r: n for (d, r), n in sorted(record.admissions.items()) if d == dep}
        lines.append(
            f"{dep:<12} {tokens / max(1.0, duration_s - record.load_start_s):8.0f} output tok/s  "
            + ", ".join(f"{r} {n}" for r, n in reasons.items())
        )
    return lines


def room_waits(record: RunRecord) -> list[str]:
    """Per on-demand deployment that waited for room: its first and last ``waiting_for_room``
    decision, how many, and the last one's explanation (why no GPU fitted it, what no rule
    could evict) — the holds the live view counts but does not print."""
    waits: dict[str, list[SeenDecision]] = {}
    for seen in record.decisions:
        if seen.decision.reason == DecisionReason.WAITING_FOR_ROOM:
            waits.setdefault(seen.decision.deployment, []).append(seen)
    return [
        f"| {dep} | {hms(ds[0].t_s)} | {hms(ds[-1].t_s)} | {len(ds)} |"
        f" {ds[-1].decision.explanation} |"
        for dep, ds in sorted(waits.items())
    ]


def write_report(
    record: RunRecord,
    deployments: list[str],
    duration_s: float,
    out_dir: Path,
    title: str,
    summary: Summary | None = None,
) -> tuple[Path, Path]:
    """Write ``report.md`` and ``timeline.png`` into ``out_dir``; the report's first lines say
    which of ``summary``'s invariants held."""
    from sim.plot import plot_timeline

    out_dir.mkdir(parents=True, exist_ok=True)
    png = out_dir / "timeline.png"
    plot_timeline(record, deployments, png, title)
    md = out_dir / "report.md"
    changes = [
        f"| {hms(s.t_s)} | {hms(s.seen_s)} | {s.decision.deployment} | {s.decision.reason} |"
        f" {s.decision.from_plan_id} → {s.decision.to_plan_id} | {s.decision.explanation} |"
        for s in record.changes()
    ]
    holds = [f"| {dep} | {reason} | {n} |" for (dep, reason), n in sorted(record.holds.items())]
    verdict = ["```", *summary.lines(), "```", ""] if summary is not None else []
    body = [
        f"# FlexPipe run: {title}",
        "",
        *verdict,
        "Everything below ran on the **simulated** cluster and engines (SimEngine) through a real",
        "Kafka broker, the faust stream worker and the runtime worker; times are simulated.",
        "",
        "![timeline](timeline.png)",
        "",
        "```",
        *summary_lines(record, deployments, duration_s),
        "```",
        "",
        "## Decisions that changed a plan",
        "",
        "| event time | seen | deployment | reason | plans | explanation |",
        "| --- | --- | --- | --- | --- | --- |",
        *changes,
        "",
        "## Holds (decisions that kept the plan), by reason",
        "",
        "| deployment | reason | decisions |",
        "| --- | --- | --- |",
        *holds,
        "",
        "## Waits for room (on-demand models no GPU fitted yet)",
        "",
        "| deployment | first | last | decisions | last explanation |",
        "| --- | --- | --- | --- | --- |",
        *(room_waits(record) or ["| none | | | | |"]),
        "",
    ]
    md.write_text("\n".join(body))
    return md, png

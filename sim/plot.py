"""``timeline.png`` for `flexpipe up`: latency, GPUs and shifts over simulated time (matplotlib).

Three panels share the time axis — TTFT p95, TBT p95 and GPUs serving, per deployment, with the
cluster events and the shifts marked — and a fourth draws every shift's phases to scale.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sim.record import PHASES, RunRecord, hms

PLOT_BUCKET_S = 60.0  # latency quantiles per simulated minute in the plot
PHASE_COLOURS = {"prepare": "tab:blue", "switch": "tab:orange", "cleanup": "tab:green"}
EVENT_COLOURS = {"preempt": "tab:red", "release": "tab:green", "xid": "tab:purple"}


def plot_timeline(record: RunRecord, deployments: list[str], path: Path, title: str) -> None:
    """Write the figure to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=(12, 10.5))
    grid = fig.add_gridspec(4, 1, height_ratios=[3, 2, 2, 2.4], hspace=0.45)
    ax_ttft = fig.add_subplot(grid[0])
    ax_tbt = fig.add_subplot(grid[1], sharex=ax_ttft)
    ax_gpus = fig.add_subplot(grid[2], sharex=ax_ttft)
    colours = {d: f"C{i}" for i, d in enumerate(deployments)}
    _latency(record, deployments, colours, ax_ttft, ax_tbt)
    _gpus(record, deployments, colours, ax_gpus)
    for ax in (ax_ttft, ax_tbt, ax_gpus):
        _markers(record, colours, ax)
    for e in record.events:
        ax_ttft.annotate(
            e.label, (e.t_s / 60, 0.98), xycoords=("data", "axes fraction"), fontsize=7,
            rotation=90, va="top", ha="right", color=EVENT_COLOURS.get(e.kind, "tab:red"),
        )  # fmt: skip
    ax_ttft.set_title(f"{title} — simulated cluster and engines")
    ax_gpus.set_xlabel(
        "simulated minutes (dashed: cluster events; dotted: shifts, coloured by deployment)"
    )
    _phase_panel(record, colours, fig.add_subplot(grid[3]))
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def _latency(
    record: RunRecord, deployments: list[str], colours: dict[str, str], ax_ttft: Any, ax_tbt: Any
) -> None:
    for dep in deployments:
        series = record.latency_series(dep, PLOT_BUCKET_S)
        xs = [(t + PLOT_BUCKET_S / 2) / 60 for t, *_ in series]
        ax_ttft.plot(xs, [s[1] for s in series], marker="o", ms=3, label=dep, color=colours[dep])
        ax_tbt.plot(xs, [s[2] for s in series], marker="o", ms=3, label=dep, color=colours[dep])
    ax_ttft.set_yscale("log")
    ax_ttft.set_ylabel("TTFT p95 (ms, log)")
    ax_tbt.set_ylabel("TBT p95 (ms)")
    ax_ttft.legend(loc="upper left", fontsize=8)


def _gpus(record: RunRecord, deployments: list[str], colours: dict[str, str], ax: Any) -> None:
    for dep in deployments:
        points = [(t / 60, n) for t, d, n in record.gpus if d == dep]
        if points:
            xs, ys = zip(*points, strict=True)
            ax.step(xs, ys, where="post", label=dep, color=colours[dep])
    from matplotlib.ticker import MaxNLocator

    ax.set_ylabel("GPUs serving")
    ax.set_ylim(bottom=0)
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    if record.gpus:
        ax.legend(loc="upper left", fontsize=8)


def _markers(record: RunRecord, colours: dict[str, str], ax: Any) -> None:
    for e in record.events:
        ax.axvline(e.t_s / 60, color=EVENT_COLOURS.get(e.kind, "tab:red"), alpha=0.5, ls="--")
    for s in record.shifts():
        ax.axvline(s.start_s / 60, color=colours.get(s.deployment, "grey"), alpha=0.6, ls=":")
    ax.grid(alpha=0.3)


def _phase_panel(record: RunRecord, colours: dict[str, str], ax: Any) -> None:
    """One row per shift: its phases to scale, in simulated seconds from its start."""
    shifts = record.shifts()
    for row, s in enumerate(shifts):
        offset = 0.0
        for phase in PHASES:
            took_s = s.phases_ms.get(phase.value, 0.0) / 1000
            if took_s > 0:
                ax.barh(row, took_s, left=offset, color=PHASE_COLOURS[phase.value], height=0.6)
                offset += took_s
        total_s = s.phases_ms.get("total", offset * 1000) / 1000
        note = f"{total_s:.1f} s" + ("" if s.outcome == "done" else f" {s.outcome}")
        ax.text(offset + 0.1, row, note, va="center", fontsize=7)
    labels = [f"{s.deployment} #{s.seq} {hms(s.start_s)[:5]} → {s.to_shape}" for s in shifts]
    ax.set_yticks(range(len(shifts)), labels, fontsize=7)
    for tick, s in zip(ax.get_yticklabels(), shifts, strict=True):
        tick.set_color(colours.get(s.deployment, "black"))
    ax.invert_yaxis()
    ax.set_xlabel("simulated seconds from the shift's start")
    from matplotlib.patches import Patch

    handles = [Patch(color=c, label=p) for p, c in PHASE_COLOURS.items()]
    ax.legend(handles=handles, loc="lower right", bbox_to_anchor=(1.0, 1.0), fontsize=7, ncols=3)
    ax.set_title(
        "shifts, to scale: prepare → switch (KV hand-over) → cleanup", fontsize=9, loc="left"
    )
    ax.grid(alpha=0.3, axis="x")

"""The PNG timeline: per-minute TTFT p95 of both deployments and GPUs held, per system."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # NOTE: headless, and the same bytes on every machine with this backend

import matplotlib.pyplot as plt

PLOTTED = (
    ("fixed", "tab:red"),
    ("static_rr", "tab:orange"),
    ("flexpipe", "tab:blue"),
    ("oracle", "tab:green"),
)


def _hours(minutes: Sequence[int]) -> list[float]:
    return [m / 60.0 for m in minutes]


def _latency_panel(
    ax: Any, systems: Mapping[str, Any], deployment: str, preemptions: Sequence[float]
) -> None:
    for key, colour in PLOTTED:
        if key not in systems:  # the oracle, under --no-oracle
            continue
        series = systems[key]["deployments"][deployment]["per_minute"]
        # NOTE: minutes without a completed request are gaps (NaN), not interpolated lines.
        values = [math.nan if v is None else v for v in series["ttft_p95_ms"]]
        label = systems[key]["label"]
        ax.plot(_hours(series["minute"]), values, color=colour, lw=0.9, label=label)
    for t in preemptions:
        ax.axvline(t / 3600.0, color="black", ls="--", lw=0.8)
    for shift in systems["flexpipe"]["shifts"]:
        if shift["deployment"] == deployment:
            done = shift["outcome"] == "done"
            marker, colour = ("v", "tab:blue") if done else ("x", "tab:gray")
            ax.plot(shift["t_s"] / 3600.0, 1.0, marker=marker, color=colour, ms=4)
    ax.set_yscale("log")
    ax.set_ylabel("TTFT p95 (ms)")
    ax.set_title(
        f"{deployment}: per-minute TTFT p95 "
        "(dashed: preemptions; FlexPipe shifts ▼ done, x rolled back)"
    )
    ax.legend(loc="upper left", fontsize=7)


def _gpu_panel(ax: Any, systems: Mapping[str, Any]) -> None:
    for key, colour in (*PLOTTED, ("no_hysteresis", "tab:gray")):
        if key not in systems:
            continue
        gpus = systems[key]["gpus_by_minute"]
        points = [(m, g) for m, g in enumerate(gpus) if g is not None]
        if points:
            ms, gs = zip(*points, strict=True)
            ax.step(_hours(ms), gs, where="post", color=colour, lw=0.9, label=systems[key]["label"])
    ax.set_ylabel("GPUs held")
    ax.set_xlabel("simulated hours")
    ax.legend(loc="upper left", fontsize=7)


def write_png(
    path: Path, systems: Mapping[str, Any], preemptions: Sequence[float], names: Sequence[str]
) -> None:
    """One TTFT-p95 panel per deployment in ``names`` (largest model first), then GPUs held."""
    fig, axes = plt.subplots(len(names) + 1, 1, figsize=(11, 3.2 * (len(names) + 1)), sharex=True)
    for ax, name in zip(axes, names, strict=False):
        _latency_panel(ax, systems, name, preemptions)
    _gpu_panel(axes[-1], systems)
    fig.tight_layout()
    # NOTE: no timestamp metadata, so equal runs give equal files.
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)

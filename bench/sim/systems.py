"""The systems compared in one run: two baselines, FlexPipe, three ablations.

All six get the same scenario, arrival trace, seeds, cost model (gearbox's, through the
runtime's timing) and runtime code (router rules, admission, VMM, transitions); they differ only
in what is listed here:

* ``fixed`` — the article's baseline: each deployment keeps the scenario's starting plan (chat-70b
  TP8 on block A). Replicas that lose a GPU stop; they restart in place when the GPUs return.
* ``static_rr`` — static replicas over all blocks (:func:`bench.sim.baselines.static_layout`),
  requests routed round-robin; same restart rule.
* ``flexpipe`` — the product's decision loop with its defaults (hysteresis 1.4, cooldown 120 s).
* ``no_hysteresis`` — (d): switch whenever gain > cost: no hysteresis margin, no cooldown, no
  downshift guard (see :func:`permissive`).
* ``replay_only`` — (e): hand-overs re-prefill, never migrate KV.
* ``no_pd_split`` — (f): no prefill/decode-disaggregated candidates (``max_pd_prefill_blocks=0``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from gearbox import DEFAULT_CONFIG, GearboxConfig


def permissive(config: GearboxConfig) -> GearboxConfig:
    """``config`` without any of gearbox's damping — FOR THE ABLATION ONLY: hysteresis 1.0, no
    cooldown, no downshift guard (its SLO margin, its lookback to the recent peak demand, its
    wait for observed demand and its memory of plans left under pressure: each holds a switch
    the bare gain would take) and estimates at each load window's own demand, not the smoothed
    one (``demand_smoothing_s`` 0: smoothing the demand also holds the switches a one-minute
    swing would take — in mixed-failures, seeds 7-11, it took this ablation's flaps from 1, 1,
    1, 1, 2 to 0, 0, 0, 1, 1).

    NOTE: ``GearboxConfig`` validates hysteresis to the article's 1.3–1.5 on purpose, so "no
    hysteresis" cannot be configured; this copies the validated config and overwrites the
    decision knobs without re-validating. The cost model is untouched, so decisions differ from
    FlexPipe's only in ``gain > cost × 1.0``, a zero cooldown and the guard. (Until 2026-12-03
    the ablation kept the guard, whose lookback and pressure memory had become FlexPipe's main
    damping: it then flapped no more than FlexPipe, so it measured nothing.)
    """
    made = dataclasses.replace(
        config, cooldown_s=0.0, reverse_cooldown_factor=1.0, demand_smoothing_s=0.0
    )
    object.__setattr__(made, "hysteresis", 1.0)
    object.__setattr__(made, "downshift_guard", False)
    return made


@dataclass(frozen=True, slots=True)
class Variant:
    """How a system's runtimes differ from the product defaults."""

    round_robin: bool = False  # static-RR baseline (bench.sim.baselines.RoundRobinRouter)
    replay_only: bool = False  # ablation (e): the executor's kv_policy REPLAY_ONLY


DEFAULT_VARIANT = Variant()


@dataclass(frozen=True, slots=True)
class SystemSpec:
    """One compared system."""

    key: str  # short id used in the results file
    label: str  # column title in the table
    adaptive: bool  # runs the gear loop
    static_layout: bool  # static replicas over all blocks (else the scenario's plans)
    config: GearboxConfig = DEFAULT_CONFIG
    variant: Variant = DEFAULT_VARIANT


SYSTEMS: tuple[SystemSpec, ...] = (
    SystemSpec("fixed", "fixed TP8@A", adaptive=False, static_layout=False),
    SystemSpec(
        "static_rr",
        "static-RR",
        adaptive=False,
        static_layout=True,
        variant=Variant(round_robin=True),
    ),
    SystemSpec("flexpipe", "FlexPipe", adaptive=True, static_layout=False),
    SystemSpec(
        "no_hysteresis",
        "(d) no hyst.",
        adaptive=True,
        static_layout=False,
        config=permissive(DEFAULT_CONFIG),
    ),
    SystemSpec(
        "replay_only",
        "(e) replay",
        adaptive=True,
        static_layout=False,
        variant=Variant(replay_only=True),
    ),
    SystemSpec(
        "no_pd_split",
        "(f) no PD",
        adaptive=True,
        static_layout=False,
        config=dataclasses.replace(DEFAULT_CONFIG, max_pd_prefill_blocks=0),
    ),
)

"""Fragment history and the decision state carried between ticks.

The history table records each block's size over time. A block is shrinking steadily when it
shrank at ``min_shrink_steps`` separate samples or more within the window, at least three times as
often as it grew, and is smaller than at the window's start — one preemption is an event, not a
trend. Such a block is not a long-term dependency: plans on it get their gain discounted by the
share of the block expected to remain after the gain horizon (extrapolating the least-squares
trend), floored at ``min_stability_factor``. Blocks that are stable or growing are not discounted.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from gearbox.blocks import AtomicBlock
from gearbox.config import GearboxConfig
from gearbox.correction import Corrections
from gearbox.serde import Serialisable

__all__ = [
    "BlockHistory",
    "BlockSample",
    "BlockSeries",
    "DemandSample",
    "FailedTarget",
    "GearState",
    "peak_demand_rps",
    "quarantined_plan_ids",
    "record_blocks",
    "record_demand",
    "record_failed_target",
    "stability_factor",
    "stability_factors",
]

_SHRINK_TO_GROWTH = 3  # a steady squeeze shrinks at least this many times per growth step


@dataclass(frozen=True, slots=True)
class BlockSample(Serialisable):
    """A block's size at one instant."""

    t_s: float
    num_gpus: int


@dataclass(frozen=True, slots=True)
class BlockSeries(Serialisable):
    """One block's samples, oldest first."""

    block_id: str
    samples: tuple[BlockSample, ...]


@dataclass(frozen=True, slots=True)
class BlockHistory(Serialisable):
    """The history table: one series per block id, sorted by id."""

    series: tuple[BlockSeries, ...] = ()

    def samples(self, block_id: str) -> tuple[BlockSample, ...]:
        """Samples of ``block_id`` (empty when unknown)."""
        for entry in self.series:
            if entry.block_id == block_id:
                return entry.samples
        return ()


@dataclass(frozen=True, slots=True)
class FailedTarget(Serialisable):
    """A target plan whose transition rolled back, and when the rollback was seen."""

    plan_id: str
    t_s: float


@dataclass(frozen=True, slots=True)
class DemandSample(Serialisable):
    """A deployment's demand (arrivals + backlog, requests/s) seen at one tick."""

    t_s: float
    demand_rps: float


@dataclass(frozen=True, slots=True)
class PressuredPlan(Serialisable):
    """A plan a voluntary switch left while it was observed over its SLOs, and when."""

    plan_id: str
    t_s: float


@dataclass(frozen=True, slots=True)
class GearState(Serialisable):
    """What ``decide`` carries from one tick to the next for one deployment."""

    blocks: tuple[AtomicBlock, ...] = ()  # last blocks, for stable block ids
    history: BlockHistory = BlockHistory()
    last_switch_s: float | None = None  # event time of the last switch decision
    last_from_plan_id: str | None = None  # plan left by the last switch (reverse detection)
    last_to_plan_id: str | None = None  # plan entered by the last switch
    failed: tuple[FailedTarget, ...] = ()  # recent rolled-back targets (quarantine), by plan id
    corrections: Corrections = field(default_factory=Corrections)  # gearbox.correction
    # the lookback's running maximum of demand (record_demand): the downshift guard's peak
    demand: tuple[DemandSample, ...] = ()
    # plans left under observed pressure within the lookback (record_pressured): the downshift
    # guard does not return to them
    pressured: tuple[PressuredPlan, ...] = ()
    # when this deployment's demand was first observed (its first tick): the downshift guard's
    # evidence (config downshift_min_evidence_s)
    observed_since_s: float | None = None


def record_failed_target(
    state: GearState, plan_id: str, now_s: float, config: GearboxConfig
) -> GearState:
    """Remember that the transition to ``plan_id`` rolled back at ``now_s``.

    ``decide`` will not propose that plan voluntarily for ``failed_target_quarantine_s``
    (a forced switch still may when nothing else is feasible). Entries past the quarantine are
    dropped; one entry per plan id, the latest time wins.
    """
    horizon = now_s - config.failed_target_quarantine_s
    kept = [f for f in state.failed if f.plan_id != plan_id and f.t_s > horizon]
    entries = sorted([*kept, FailedTarget(plan_id, now_s)], key=lambda f: (f.t_s, f.plan_id))
    return replace(state, failed=tuple(entries))


def quarantined_plan_ids(state: GearState, now_s: float, config: GearboxConfig) -> frozenset[str]:
    """Plan ids whose rollback is more recent than ``failed_target_quarantine_s``."""
    horizon = now_s - config.failed_target_quarantine_s
    return frozenset(f.plan_id for f in state.failed if f.t_s > horizon)


def record_pressured(
    state: GearState, plan_id: str, now_s: float, config: GearboxConfig
) -> GearState:
    """Remember that a voluntary switch left ``plan_id`` at ``now_s`` while it was observed
    over its SLOs; entries older than ``downshift_lookback_s`` are dropped, one per plan id."""
    horizon = now_s - config.downshift_lookback_s
    kept = [p for p in state.pressured if p.plan_id != plan_id and p.t_s > horizon]
    entries = sorted([*kept, PressuredPlan(plan_id, now_s)], key=lambda p: (p.t_s, p.plan_id))
    return replace(state, pressured=tuple(entries))


def pressured_since(
    state: GearState, plan_id: str, now_s: float, config: GearboxConfig
) -> float | None:
    """When a voluntary switch last left ``plan_id`` under observed pressure, within the last
    ``downshift_lookback_s`` (None: not within it)."""
    horizon = now_s - config.downshift_lookback_s
    times = [p.t_s for p in state.pressured if p.plan_id == plan_id and p.t_s > horizon]
    return max(times) if times else None


def record_demand(
    samples: Sequence[DemandSample], now_s: float, demand_rps: float, config: GearboxConfig
) -> tuple[DemandSample, ...]:
    """``samples`` with ``demand_rps`` seen at ``now_s``, kept as a running maximum over the
    last ``downshift_lookback_s``: each sample older than the lookback, or at most as high as
    a later one, is dropped (it can never be the peak again), so the first is the peak and the
    tuple stays short (at most one sample per tick, and only while demand keeps falling)."""
    horizon = now_s - config.downshift_lookback_s
    kept = tuple(s for s in samples if s.t_s > horizon and s.demand_rps > demand_rps)
    return (*kept, DemandSample(now_s, demand_rps))


def peak_demand_rps(samples: Sequence[DemandSample]) -> float:
    """The highest demand of the lookback (0 with none recorded)."""
    return samples[0].demand_rps if samples else 0.0


def record_blocks(
    history: BlockHistory, blocks: Sequence[AtomicBlock], now_s: float, config: GearboxConfig
) -> BlockHistory:
    """Append each block's size at ``now_s``; known blocks that vanished record 0 GPUs.

    A block whose size did not change since its last sample gets one only once that sample is
    ``history_window_s / max_history_samples`` old: the cap then spans the whole window however
    often decisions come (a deployment decided several times a second filled it in two minutes
    with copies of the same sizes, and wrote every block's copy to the gear-state table on every
    decision). Samples older than ``history_window_s`` or beyond ``max_history_samples`` are
    dropped, and series left empty disappear.
    """
    sizes = {b.block_id: b.num_gpus for b in blocks}
    known = {s.block_id: s for s in history.series}
    horizon = now_s - config.history_window_s
    spacing_s = config.history_window_s / config.max_history_samples
    series = []
    for block_id in sorted(set(known) | set(sizes)):
        entry = known.get(block_id)
        samples = entry.samples if entry is not None else ()
        size = sizes.get(block_id, 0)
        last = samples[-1] if samples else None
        # NOTE: a millisecond short: ticks one spacing apart may differ by a hair less (floats)
        if last is None or last.num_gpus != size or now_s - last.t_s >= spacing_s - 1e-3:
            samples = (*samples, BlockSample(now_s, size))
        elif entry is not None and samples[0].t_s >= horizon and last.t_s <= now_s:
            series.append(entry)  # NOTE: unchanged: the same object (cheap to diff and store)
            continue
        kept = tuple(s for s in samples if s.t_s >= horizon)[-config.max_history_samples :]
        if any(s.num_gpus for s in kept):
            series.append(BlockSeries(block_id, kept))
    return replace(history, series=tuple(series))


def _slope_per_s(samples: Sequence[BlockSample]) -> float:
    n = len(samples)
    mean_t = sum(s.t_s for s in samples) / n
    mean_y = sum(s.num_gpus for s in samples) / n
    var_t = sum((s.t_s - mean_t) ** 2 for s in samples)
    if var_t == 0:
        return 0.0
    return sum((s.t_s - mean_t) * (s.num_gpus - mean_y) for s in samples) / var_t


def stability_factor(history: BlockHistory, block_id: str, config: GearboxConfig) -> float:
    """1.0 for a stable block; < 1 for one shrinking steadily (see module docstring)."""
    return _factor(history.samples(block_id), config)


def stability_factors(
    history: BlockHistory, blocks: Sequence[AtomicBlock], config: GearboxConfig
) -> Mapping[str, float]:
    """Stability factor of every block in ``blocks``."""
    by_id = {entry.block_id: entry.samples for entry in history.series}
    return {b.block_id: _factor(by_id.get(b.block_id, ()), config) for b in blocks}


def _factor(samples: Sequence[BlockSample], config: GearboxConfig) -> float:
    current = samples[-1].num_gpus if samples else 0
    # NOTE: checked before the steps are counted: most blocks are not smaller than at the
    # window's start, and counting every block's steps was a tenth of a forced decision's CPU
    if current == 0 or current >= samples[0].num_gpus:
        return 1.0
    steps = [b.num_gpus - a.num_gpus for a, b in itertools.pairwise(samples)]
    shrinks = sum(1 for d in steps if d < 0)
    growths = sum(1 for d in steps if d > 0)
    if shrinks < config.min_shrink_steps or shrinks < _SHRINK_TO_GROWTH * growths:
        return 1.0
    projected = current + _slope_per_s(samples) * config.gain_horizon_s
    return max(config.min_stability_factor, min(1.0, projected / current))

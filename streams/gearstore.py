"""A deployment's :class:`~gearbox.history.GearState` in two tables: the block history apart, as a
base and the difference from it.

At 1,000 GPUs the block history is ≈ 1 MB of JSON (up to ``max_history_samples`` per block:
a sample when a block's size changed, else one per spacing, :func:`gearbox.history.record_blocks`)
and decisions append to it, while the rest of the state (blocks, last switch, quarantine, TTFT
corrections) is small. Writing the whole state on
every decision whose blocks moved cost ≈ 25 ms of the event loop's time per write. So:

* ``gear_state[name]`` holds a :class:`GearRecord`: the state with an empty history, the epoch of
  the history base it builds on, and the history as a difference from that base (per series: how
  many samples it dropped from the base's front, and the samples it appended);
* ``block_history[name]`` holds a :class:`HistoryBase`: the whole history at one epoch. It is
  rewritten (the next epoch) once the difference holds a tenth as many samples as the base, so a
  write costs about a tenth of the whole history, and one write in ~25 costs the whole once.

Both are keyed by the deployment's name, so they share a partition number in their changelogs
and move together on a rebalance. Reading back applies the difference to the base: exactly the
history that was stored. The base is written before the record that names its epoch; a worker
that died between the two comes back with the new base's history (the newer one) and the older
record's blocks and switch — as a crash between any two table writes leaves them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

from gearbox.history import BlockHistory, BlockSample, BlockSeries, GearState
from streams import codec
from streams.ports import TableName, Tables

__all__ = ["GearRecord", "GearStore", "HistoryBase", "SeriesDelta", "apply_delta", "diff"]

log = logging.getLogger(__name__)

REBASE_RATIO = 10  # a new base once the difference holds a tenth as many samples as the base
MIN_DELTA_SAMPLES = 512  # ... and at least this many (small histories are cheap either way)

Samples = tuple[BlockSample, ...]


@dataclass(frozen=True, slots=True)
class SeriesDelta:
    """One series of the history: the base's series of ``block_id`` less its first ``dropped``
    samples, then ``added``."""

    block_id: str
    dropped: int
    added: Samples


@dataclass(frozen=True, slots=True)
class GearRecord:
    """``gear_state``'s value: the state without its history, and the history as a difference
    from the base of ``epoch`` (epoch 0: the empty history, never written)."""

    state: GearState
    epoch: int = 0
    series: tuple[SeriesDelta, ...] = ()


@dataclass(frozen=True, slots=True)
class HistoryBase:
    """``block_history``'s value: the whole history at ``epoch``."""

    epoch: int
    history: BlockHistory


def _series_delta(old: Samples, new: Samples) -> tuple[int, Samples]:
    """``(k, added)`` with ``new == old[k:] + added``, the overlap as long as possible."""
    if new:
        first_t = new[0].t_s
        for k, sample in enumerate(old):
            if sample.t_s != first_t:
                continue
            m = len(old) - k
            # NOTE: the history's samples are the base's objects, so the comparison is by
            # identity nearly everywhere (tuple equality checks that first)
            if m <= len(new) and old[k:] == new[:m]:
                return k, new[m:]
    return len(old), new


def diff(base: dict[str, Samples], history: BlockHistory) -> tuple[SeriesDelta, ...]:
    """``history`` as a difference from ``base`` (block id → samples)."""
    out = []
    for entry in history.series:
        dropped, added = _series_delta(base.get(entry.block_id, ()), entry.samples)
        out.append(SeriesDelta(entry.block_id, dropped, added))
    return tuple(out)


def apply_delta(base: dict[str, Samples], series: tuple[SeriesDelta, ...]) -> BlockHistory:
    """Inverse of :func:`diff`; ``ValueError`` when ``series`` does not fit ``base``."""
    out = []
    for d in series:
        old = base.get(d.block_id, ())
        if d.dropped > len(old):
            raise ValueError(f"{d.block_id}: drops {d.dropped} of {len(old)} samples")
        out.append(BlockSeries(d.block_id, old[d.dropped :] + d.added))
    return BlockHistory(tuple(out))


@dataclass(slots=True)
class _Base:
    epoch: int
    series: dict[str, Samples]
    samples: int  # how many samples the base holds


def _base(epoch: int, history: BlockHistory) -> _Base:
    series = {s.block_id: s.samples for s in history.series}
    return _Base(epoch, series, sum(len(s) for s in series.values()))


class GearStore:
    """Reads and writes deployments' gear states over the ``gear_state`` and ``block_history``
    tables, keeping each deployment's history base in memory once read or written."""

    def __init__(self, tables: Tables) -> None:
        self.tables = tables
        self._bases: dict[str, _Base] = {}

    def forget(self) -> None:
        """Drop the bases held (after a rebalance)."""
        self._bases.clear()

    def load(self, name: str) -> GearState | None:
        """The stored state of ``name``, or None; ``ValueError`` when a record is unreadable."""
        raw = self.tables.get(TableName.GEAR_STATE, name.encode())
        if raw is None:
            return None
        record = codec.loads(GearRecord, raw)
        base = self._read_base(name)
        if base.epoch != record.epoch:
            # NOTE: died between the base's write and its record's (see the module docstring)
            log.warning(
                "%s: block history base %d, gear state names %d: the base's history kept",
                name,
                base.epoch,
                record.epoch,
            )
            history = BlockHistory(tuple(BlockSeries(k, v) for k, v in sorted(base.series.items())))
        else:
            history = apply_delta(base.series, record.series)
        self._bases[name] = base
        return replace(record.state, history=history)

    def _read_base(self, name: str) -> _Base:
        raw = self.tables.get(TableName.BLOCK_HISTORY, name.encode())
        if raw is None:
            return _Base(0, {}, 0)
        try:
            stored = codec.loads(HistoryBase, raw)
        except ValueError as exc:
            log.warning("%s: block history unreadable, starting afresh: %s", name, exc)
            return _Base(0, {}, 0)
        return _base(stored.epoch, stored.history)

    def store(self, name: str, gear: GearState) -> None:
        """Write ``gear``: its history's difference from the base, or a new base first."""
        base = self._bases.get(name)
        if base is None:
            base = self._read_base(name)
        series = diff(base.series, gear.history)
        added = sum(len(d.added) for d in series)
        if added >= max(MIN_DELTA_SAMPLES, base.samples // REBASE_RATIO):
            base = _base(base.epoch + 1, gear.history)
            value = codec.dumps(HistoryBase(base.epoch, gear.history))
            self.tables.set(TableName.BLOCK_HISTORY, name.encode(), value)
            series = diff(base.series, gear.history)
        self._bases[name] = base
        record = GearRecord(replace(gear, history=BlockHistory()), base.epoch, series)
        self.tables.set(TableName.GEAR_STATE, name.encode(), codec.dumps(record))

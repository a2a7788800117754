"""Decision-offset bookkeeping of the runtime worker."""

from __future__ import annotations

from aiokafka import TopicPartition


class OffsetTracker:
    """Commits a partition's offset only past decisions that reached an outcome."""

    def __init__(self) -> None:
        self._refs: dict[int, tuple[TopicPartition, int]] = {}
        self._open: dict[TopicPartition, dict[int, bool]] = {}
        self._next_ref = 0

    def add(self, tp: TopicPartition, offset: int) -> int:
        """Track a consumed message; returns its ref."""
        self._next_ref += 1
        self._refs[self._next_ref] = (tp, offset)
        self._open.setdefault(tp, {})[offset] = False
        return self._next_ref

    def done(self, ref: int | None) -> None:
        """The message reached an outcome."""
        if ref is not None and ref in self._refs:
            tp, offset = self._refs.pop(ref)
            self._open[tp][offset] = True

    def commits(self) -> dict[TopicPartition, int]:
        """Next offset to commit per partition whose done prefix grew (then forgotten)."""
        out = {}
        for tp, offsets in self._open.items():
            last = None
            for offset in sorted(offsets):
                if not offsets[offset]:
                    break
                last = offset
                del offsets[offset]
            if last is not None:
                out[tp] = last + 1
        return out

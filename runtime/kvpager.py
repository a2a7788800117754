"""KV pages held through the VMM ledger: the :class:`runtime.engine.paging.KvPager` a serving
core gives each replica's paged engine.

A sequence's first pages are committed by the serving core when it admits the request (so the
watermark and 429s apply to them); the engine then grows them here, page by page, as it
generates, and gives them back when it preempts the sequence. Growth is not held to the
watermark — it is what admitted sequences need — only to the GPU's memory: a refused extension
makes the engine preempt its youngest sequence, never crash.
"""

from __future__ import annotations

from runtime.timing import ReplicaTiming
from runtime.vmm.manager import ReservationManager

__all__ = ["VmmPager"]

_MAX_DROPPED = 4096


class VmmPager:
    """One replica's KV pages in the VMM ledger, under the request ids the serving core uses."""

    def __init__(self, vmm: ReservationManager, replica_id: str, timing: ReplicaTiming) -> None:
        self._vmm = vmm
        self._replica_id = replica_id
        self._per_token = {u: b for u, b in timing.kv_bytes_per_token_per_gpu.items() if b > 0}
        self._covered: dict[str, int] = {}  # tokens each sequence's commits hold (a cache)
        # CoveringPager: bumped when every cached figure is dropped; the sequences whose one
        # figure was dropped since the engine last cleared the list
        self.epoch = 0
        self.dropped: list[str] = []

    def hold(self, seq_id: str, tokens: int) -> bool:
        """Commit what the sequence lacks for ``tokens`` tokens; False when the VMM refuses."""
        vmm, rid = self._vmm, self._replica_id
        # NOTE: the cache spares the ledger a look-up per sequence and decode run; it is only
        # trusted while the sequence still holds its commit (the core may have released it).
        if tokens <= self._covered.get(seq_id, -1) and vmm.holds(rid, seq_id):
            return True
        covered = vmm.extend_to(rid, seq_id, self._per_token, tokens)
        if covered is None:
            return False
        self._covered[seq_id] = covered
        return True

    def covered(self, seq_id: str) -> int:
        """Tokens for which ``hold`` answers True from the cache alone (−1: none)."""
        if not self._vmm.holds(self._replica_id, seq_id):
            return -1
        return self._covered.get(seq_id, -1)

    def release(self, seq_id: str) -> None:
        """Give back every page the sequence holds; idempotent."""
        self.forget(seq_id)
        self._vmm.release(self._replica_id, seq_id)

    def forget(self, seq_id: str) -> None:
        """Drop what is known of the sequence (the core released its commit itself)."""
        if self._covered.pop(seq_id, None) is not None:
            if len(self.dropped) >= _MAX_DROPPED:  # (no engine reads them: drop them all)
                self.forget_all()
            else:
                self.dropped.append(seq_id)

    def forget_all(self) -> None:
        """Drop everything known (the replica's reservation is gone)."""
        self._covered.clear()
        self.dropped.clear()
        self.epoch += 1

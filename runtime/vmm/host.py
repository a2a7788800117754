"""Host VMM backend: real anonymous address-space reservations plus commit accounting.

Each reservation is an ``mmap`` of ``PROT_NONE`` pages with ``MAP_NORESERVE``: the kernel hands
out address space without backing memory or swap, as ``cuMemAddressReserve`` does on a GPU.
Commits are accounted against a byte limit standing for the device's physical memory (the
simulated GPU's capacity), rounded to the same 2 MiB granularity CUDA uses, so the throttle and
rejection paths behave as they would on a GPU.
"""

from __future__ import annotations

import itertools
import mmap
from collections.abc import Iterable
from dataclasses import dataclass, field

from runtime.vmm.base import (
    DEFAULT_GRANULARITY_BYTES,
    Commit,
    CommitError,
    RangeAllocator,
    Reservation,
    round_up,
)

_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)  # Linux value; the module omits it
_PROT_NONE = 0


@dataclass
class _Held:
    reservation: Reservation
    mapping: mmap.mmap | None
    ranges: RangeAllocator
    commits: dict[str, Commit] = field(default_factory=dict)


class HostReservationBackend:
    """VMM accounting for one (simulated) device on the host."""

    def __init__(
        self,
        device: str,
        limit_bytes: int,
        *,
        granularity_bytes: int = DEFAULT_GRANULARITY_BYTES,
        map_address_space: bool = True,
    ) -> None:
        self.device = device
        self.granularity_bytes = granularity_bytes
        self.last_error: CommitError | None = None
        self._limit_bytes = limit_bytes
        self._map = map_address_space  # False for property tests that make thousands of ranges
        self._committed = 0
        self._held: dict[str, _Held] = {}
        self._ids = itertools.count(1)

    def reserve(self, plan_id: str, size_bytes: int) -> Reservation | None:
        """Reserve ``size_bytes`` of address space (no backing) for ``plan_id``."""
        size = round_up(size_bytes, self.granularity_bytes)
        mapping = None
        if self._map:
            try:
                mapping = mmap.mmap(
                    -1,
                    size,
                    flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE,
                    prot=_PROT_NONE,
                )
            except (OSError, ValueError, OverflowError):
                self.last_error = CommitError.ADDRESS_SPACE
                return None
        rid = f"{self.device}/host-{next(self._ids)}"
        resv = Reservation(rid, plan_id, self.device, size, 0)
        self._held[rid] = _Held(resv, mapping, RangeAllocator(size))
        return resv

    def commit(self, reservation: Reservation, request_id: str, size_bytes: int) -> Commit | None:
        """Account ``size_bytes`` of pages for ``request_id``; ``None`` past the limit."""
        held = self._held.get(reservation.reservation_id)
        if held is None:
            self.last_error = CommitError.UNKNOWN_RESERVATION
            return None
        commits = held.commits
        if request_id in commits:
            self.last_error = CommitError.DUPLICATE_COMMIT
            return None
        # (round_up inlined: a simulated engine commits here for every run of KV pages)
        granularity = self.granularity_bytes
        size = -(-size_bytes // granularity) * granularity
        if size < granularity:
            size = granularity
        committed = self._committed + size
        if committed > self._limit_bytes:
            self.last_error = CommitError.OUT_OF_MEMORY
            return None
        offset = held.ranges.allocate(size)
        if offset is None:
            self.last_error = CommitError.RESERVATION_FULL
            return None
        commit = Commit(reservation.reservation_id, request_id, offset, size)
        commits[request_id] = commit
        self._committed = committed
        return commit

    def release_commit(self, commit: Commit) -> None:
        """Return the pages; unknown or already released commits are ignored."""
        held = self._held.get(commit.reservation_id)
        if held is not None:
            self._free(held, commit)

    def release_commits(self, commits: Iterable[Commit]) -> None:
        """``release_commit`` of each commit, in order."""
        # NOTE: one call for all of a request's chunks on this device (a simulated engine's
        # sequence holds one per run of KV pages it grew by), the reservation looked up once.
        held: _Held | None = None
        for commit in commits:
            if held is None or held.reservation.reservation_id != commit.reservation_id:
                held = self._held.get(commit.reservation_id)
                if held is None:
                    continue
            self._free(held, commit)

    def _free(self, held: _Held, commit: Commit) -> None:
        """Return a commit's pages to its reservation's ranges, when it is still held there."""
        _, request_id, offset, size, _ = commit  # (one unpack, not 3 lookups)
        commits = held.commits
        known = commits.get(request_id)
        if known is not commit and known != commit:  # (identity first: the usual case)
            return
        del commits[request_id]
        held.ranges.free(offset, size)
        self._committed -= size

    def unreserve(self, reservation: Reservation) -> None:
        """Release all commits and unmap the address range; idempotent."""
        held = self._held.pop(reservation.reservation_id, None)
        if held is None:
            return
        self._committed -= sum(c.size_bytes for c in held.commits.values())
        if held.mapping is not None:
            held.mapping.close()

    def committed_bytes(self) -> int:
        """Bytes committed on this device."""
        return self._committed

    def capacity_bytes(self) -> int:
        """The device's byte limit."""
        return self._limit_bytes

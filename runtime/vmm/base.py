"""The reservation backend interface and the address-range bookkeeping both backends share.

A backend serves one device (a GPU, or a simulated one). ``reserve`` takes address space for a
plan without backing it; ``commit`` backs a range of it with physical pages for one request and
returns ``None`` when it cannot — the caller rejects that request (HTTP 429), the worker never
crashes. ``release_commit`` and ``unreserve`` are idempotent, so compensation can run twice after
a retry or a restart.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import NamedTuple, Protocol

MIB = 1024**2
DEFAULT_GRANULARITY_BYTES = 2 * MIB  # CUDA's minimum VMM granularity on current GPUs


class CommitError(StrEnum):
    """Why the last reserve or commit failed (kept on the backend for diagnostics)."""

    OUT_OF_MEMORY = "out_of_memory"  # the device has no physical pages left
    RESERVATION_FULL = "reservation_full"  # the plan's address range has no free span
    UNKNOWN_RESERVATION = "unknown_reservation"  # released or never made
    DUPLICATE_COMMIT = "duplicate_commit"  # the request already holds pages here
    DRIVER_ERROR = "driver_error"  # the driver returned an error code
    ADDRESS_SPACE = "address_space"  # the OS/driver refused the address reservation


@dataclass(frozen=True, slots=True)
class Reservation:
    """Address space reserved for one plan on one device."""

    reservation_id: str
    plan_id: str
    device: str
    size_bytes: int  # rounded up to the backend's granularity
    base_address: int  # start of the range (0 where the backend has no real address)


class Commit(NamedTuple):
    """Physical pages backing part of a reservation for one request."""

    # NOTE: a named tuple, not a frozen dataclass: as immutable, and made ~8x faster (a
    # simulated engine commits one per GPU for every run of KV pages a sequence grows by).

    reservation_id: str
    request_id: str
    offset_bytes: int  # from the reservation's base
    size_bytes: int  # rounded up to the granularity
    handle: int = 0  # backend's physical allocation handle (CUDA), 0 otherwise


class ReservationBackend(Protocol):
    """One device's VMM: reserve address space, commit pages, release both."""

    device: str
    granularity_bytes: int
    last_error: CommitError | None

    def reserve(self, plan_id: str, size_bytes: int) -> Reservation | None:
        """Reserve address space for ``plan_id``; ``None`` (and ``last_error``) on failure."""
        ...

    def commit(self, reservation: Reservation, request_id: str, size_bytes: int) -> Commit | None:
        """Back ``size_bytes`` of the reservation with pages; ``None`` when it cannot."""
        ...

    def release_commit(self, commit: Commit) -> None:
        """Return a commit's pages; a second call is a no-op."""
        ...

    def release_commits(self, commits: Iterable[Commit]) -> None:
        """``release_commit`` of each commit, in order (a request's chunks on the device)."""
        ...

    def unreserve(self, reservation: Reservation) -> None:
        """Release every commit of the reservation and its address space; idempotent."""
        ...

    def committed_bytes(self) -> int:
        """Physical bytes committed on the device through this backend."""
        ...

    def capacity_bytes(self) -> int:
        """Physical bytes the backend may commit on the device in all."""
        ...


def round_up(size_bytes: int, granularity_bytes: int) -> int:
    """``size_bytes`` rounded up to a multiple of the granularity (at least one granule)."""
    granules = max(1, -(-size_bytes // granularity_bytes))
    return granules * granularity_bytes


class RangeAllocator:
    """First-fit allocator of offsets inside one reservation (free spans kept sorted, merged).

    A reservation's free list grows to a few hundred spans late in a long simulated run, and
    most of them are too small for a multi-page commit. The allocator keeps one hint — every
    span before index ``_hint_at`` is shorter than ``_hint_size`` bytes — so a request of at
    least that size starts its scan there; the offset is the same first fit.
    """

    def __init__(self, size_bytes: int) -> None:
        self._free: list[tuple[int, int]] = [(0, size_bytes)] if size_bytes > 0 else []
        self._hint_size = 0  # every span before ``_hint_at`` is shorter than this
        self._hint_at = 0

    def allocate(self, size_bytes: int) -> int | None:
        """Offset of a free span of ``size_bytes``, or ``None`` when no span is large enough."""
        # NOTE: the scan carries no index (the found span's is looked up in C, spans being
        # distinct): a simulated engine allocates here once per GPU for every run of KV pages
        # a sequence grows by.
        spans = self._free
        hint_at = self._hint_at
        begin = hint_at if size_bytes >= self._hint_size else 0
        for span in itertools.islice(spans, begin, None) if begin else spans:
            start, length = span
            if length >= size_bytes:
                i = spans.index(span, begin)
                if length == size_bytes:
                    del spans[i]
                    if i < hint_at:
                        hint_at -= 1
                else:
                    spans[i] = (start + size_bytes, length - size_bytes)
                if i >= hint_at and i > 0:  # every span before i is shorter than this request
                    self._hint_size, hint_at = size_bytes, i
                self._hint_at = hint_at
                return start
        return None

    def free(self, offset: int, size_bytes: int) -> None:
        """Give a span back, merging it with its neighbours."""
        # NOTE: the spans are kept sorted and merged, so only the given span's neighbours can
        # touch it: merging with them alone is what a full merging pass would give, in O(log n)
        # (a simulated engine frees pages thousands of times a simulated minute). A merge
        # rewrites a neighbour in place; only a span with no free neighbour is inserted. A span
        # that grows to the hint's size before the hint moves the hint back to it.
        spans = self._free
        hint_at, hint_size = self._hint_at, self._hint_size
        i = bisect.bisect_left(spans, (offset, 0))
        end = offset + size_bytes
        follows = i < len(spans) and spans[i][0] == end
        if i > 0:
            prev_start, prev_length = spans[i - 1]
            if prev_start + prev_length == offset:
                if follows:
                    end += spans[i][1]
                    del spans[i]
                spans[i - 1] = (prev_start, end - prev_start)
                if i - 1 < hint_at:
                    if end - prev_start >= hint_size:
                        self._hint_at = i - 1
                    elif follows and i < hint_at:
                        self._hint_at = hint_at - 1
                return
        if follows:
            spans[i] = (offset, end + spans[i][1] - offset)
            if i < hint_at and spans[i][1] >= hint_size:
                self._hint_at = i
        else:
            spans.insert(i, (offset, size_bytes))
            if i < hint_at:
                self._hint_at = i if size_bytes >= hint_size else hint_at + 1

    @property
    def free_bytes(self) -> int:
        """Bytes not allocated."""
        return sum(length for _, length in self._free)

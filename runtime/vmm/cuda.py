"""CUDA VMM backend: ``cuMemAddressReserve`` per plan, ``cuMemCreate``/``cuMemMap`` per request.

Built on ``cuda-python``'s driver bindings (``from cuda.bindings import driver``). Every driver
call returns an error tuple; a non-success result — or any exception the bindings raise, such as
a missing driver library — becomes a failed reserve or a rejected commit (``None``), never an
exception out of this module, and partial work (a created handle, a mapping) is undone first.
Construct it with :func:`open_cuda_backend`, which returns ``None`` when no GPU is usable.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from runtime.vmm.base import Commit, CommitError, RangeAllocator, Reservation, round_up


@dataclass
class _Held:
    reservation: Reservation
    ranges: RangeAllocator
    commits: dict[str, Commit] = field(default_factory=dict)
    handles: dict[str, Any] = field(default_factory=dict)


class CudaReservationBackend:
    """VMM on one CUDA device; ``limit_bytes`` optionally caps commits below the device size."""

    def __init__(
        self, driver: Any, ordinal: int, device: str, granularity_bytes: int, limit_bytes: int
    ) -> None:
        self.device = device
        self.granularity_bytes = granularity_bytes
        self.last_error: CommitError | None = None
        self.last_driver_error: str | None = None  # name of the last non-success CUresult
        self._drv = driver
        self._ordinal = ordinal
        self._limit_bytes = limit_bytes
        self._committed = 0
        self._held: dict[str, _Held] = {}
        self._ids = itertools.count(1)

    # ---- driver plumbing ----------------------------------------------------------------------

    def _call(self, name: str, *args: Any) -> tuple[Any, ...] | None:
        """Call ``driver.<name>``; the result values on success, ``None`` on any failure."""
        try:
            result = getattr(self._drv, name)(*args)
        except Exception as exc:  # NOTE: the bindings raise for a missing driver too
            self.last_driver_error = f"{name}: {type(exc).__name__}"
            return None
        err, *values = result if isinstance(result, tuple) else (result,)
        if err != self._drv.CUresult.CUDA_SUCCESS:
            self.last_driver_error = f"{name}: {getattr(err, 'name', err)}"
            return None
        return tuple(values)

    def _ptr(self, address: int) -> Any:
        return self._drv.CUdeviceptr(address)

    # ---- ReservationBackend -------------------------------------------------------------------

    def reserve(self, plan_id: str, size_bytes: int) -> Reservation | None:
        """``cuMemAddressReserve`` of ``size_bytes`` rounded to the granularity."""
        size = round_up(size_bytes, self.granularity_bytes)
        out = self._call("cuMemAddressReserve", size, 0, 0, 0)
        if out is None:
            self.last_error = CommitError.ADDRESS_SPACE
            return None
        rid = f"{self.device}/cuda-{next(self._ids)}"
        resv = Reservation(rid, plan_id, self.device, size, int(out[0]))
        self._held[rid] = _Held(resv, RangeAllocator(size))
        return resv

    def commit(self, reservation: Reservation, request_id: str, size_bytes: int) -> Commit | None:
        """``cuMemCreate`` + ``cuMemMap`` + ``cuMemSetAccess``; ``None`` if any step fails."""
        held = self._held.get(reservation.reservation_id)
        if held is None or request_id in held.commits:
            self.last_error = (
                CommitError.UNKNOWN_RESERVATION if held is None else CommitError.DUPLICATE_COMMIT
            )
            return None
        size = round_up(size_bytes, self.granularity_bytes)
        if self._committed + size > self._limit_bytes:
            self.last_error = CommitError.OUT_OF_MEMORY
            return None
        offset = held.ranges.allocate(size)
        if offset is None:
            self.last_error = CommitError.RESERVATION_FULL
            return None
        handle = self._map_pages(reservation.base_address + offset, size)
        if handle is None:
            held.ranges.free(offset, size)
            return None
        commit = Commit(reservation.reservation_id, request_id, offset, size, _as_int(handle))
        held.commits[request_id] = commit
        held.handles[request_id] = handle
        self._committed += size
        return commit

    def _map_pages(self, address: int, size: int) -> Any | None:
        created = self._call("cuMemCreate", size, self._prop(), 0)
        if created is None:
            self.last_error = CommitError.OUT_OF_MEMORY
            return None
        handle = created[0]
        if self._call("cuMemMap", self._ptr(address), size, 0, handle, 0) is None:
            self._call("cuMemRelease", handle)
            self.last_error = CommitError.DRIVER_ERROR
            return None
        if self._call("cuMemSetAccess", self._ptr(address), size, [self._access()], 1) is None:
            self._call("cuMemUnmap", self._ptr(address), size)
            self._call("cuMemRelease", handle)
            self.last_error = CommitError.DRIVER_ERROR
            return None
        return handle

    def release_commit(self, commit: Commit) -> None:
        """``cuMemUnmap`` + ``cuMemRelease``; unknown commits are ignored."""
        held = self._held.get(commit.reservation_id)
        if held is None or held.commits.get(commit.request_id) != commit:
            return
        handle = held.handles.pop(commit.request_id)
        del held.commits[commit.request_id]
        address = held.reservation.base_address + commit.offset_bytes
        self._call("cuMemUnmap", self._ptr(address), commit.size_bytes)
        self._call("cuMemRelease", handle)
        held.ranges.free(commit.offset_bytes, commit.size_bytes)
        self._committed -= commit.size_bytes

    def release_commits(self, commits: Iterable[Commit]) -> None:
        """``release_commit`` of each commit, in order."""
        for commit in commits:
            self.release_commit(commit)

    def unreserve(self, reservation: Reservation) -> None:
        """Release every commit, then ``cuMemAddressFree``; idempotent."""
        held = self._held.get(reservation.reservation_id)
        if held is None:
            return
        for commit in list(held.commits.values()):
            self.release_commit(commit)
        del self._held[reservation.reservation_id]
        self._call("cuMemAddressFree", self._ptr(reservation.base_address), reservation.size_bytes)

    def committed_bytes(self) -> int:
        """Bytes committed through this backend."""
        return self._committed

    def capacity_bytes(self) -> int:
        """The commit cap (the device's memory unless configured lower)."""
        return self._limit_bytes

    # ---- descriptors ----------------------------------------------------------------------------

    def _prop(self) -> Any:
        return _allocation_prop(self._drv, self._ordinal)

    def _access(self) -> Any:
        desc = self._drv.CUmemAccessDesc()
        desc.location.type = self._drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        desc.location.id = self._ordinal
        desc.flags = self._drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        return desc


def _allocation_prop(driver: Any, ordinal: int) -> Any:
    prop = driver.CUmemAllocationProp()
    prop.type = driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = ordinal
    return prop


def _as_int(handle: Any) -> int:
    try:
        return int(handle)
    except (TypeError, ValueError):
        return 0


def _load_driver() -> Any | None:
    try:
        from cuda.bindings import driver
    except Exception:  # NOTE: a broken install means "no GPU" here
        return None
    return driver


def open_cuda_backend(
    ordinal: int = 0,
    *,
    device: str | None = None,
    limit_bytes: int | None = None,
    driver: Any | None = None,
) -> CudaReservationBackend | None:
    """Initialise the driver and device ``ordinal``; ``None`` when no usable GPU/driver."""
    drv = driver if driver is not None else _load_driver()
    if drv is None:
        return None
    probe = CudaReservationBackend(drv, ordinal, device or f"cuda:{ordinal}", 1, 0)
    if probe._call("cuInit", 0) is None:
        return None
    dev = probe._call("cuDeviceGet", ordinal)
    if dev is None:
        return None
    ctx = probe._call("cuDevicePrimaryCtxRetain", dev[0])
    if ctx is None or probe._call("cuCtxSetCurrent", ctx[0]) is None:
        return None
    flag = drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
    gran = probe._call("cuMemGetAllocationGranularity", _allocation_prop(drv, ordinal), flag)
    total = probe._call("cuDeviceTotalMem", dev[0])
    if gran is None or total is None:
        return None
    cap = int(total[0]) if limit_bytes is None else min(limit_bytes, int(total[0]))
    return CudaReservationBackend(drv, ordinal, device or f"cuda:{ordinal}", int(gran[0]), cap)


def _uuid_text(raw: Any) -> str:
    data = raw.encode("latin-1") if isinstance(raw, str) else bytes(raw)
    h = data.hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def local_gpu_ordinals(driver: Any | None = None) -> dict[str, int]:
    """NVML-style UUID (``GPU-xxxxxxxx-...``) → CUDA ordinal of each local GPU; empty without."""
    drv = driver if driver is not None else _load_driver()
    if drv is None:
        return {}
    probe = CudaReservationBackend(drv, 0, "probe", 1, 0)
    count = None if probe._call("cuInit", 0) is None else probe._call("cuDeviceGetCount")
    if count is None:
        return {}
    out = {}
    for ordinal in range(int(count[0])):
        dev = probe._call("cuDeviceGet", ordinal)
        uuid = probe._call("cuDeviceGetUuid", dev[0]) if dev is not None else None
        if uuid is not None:
            out[_uuid_text(uuid[0].bytes)] = ordinal
    return out

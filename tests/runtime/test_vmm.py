"""Unit: VMM reservations — host backend, manager, and the CUDA backend's error mapping."""

from __future__ import annotations

import enum
import itertools
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from runtime.vmm.base import MIB, Commit, CommitError, RangeAllocator, round_up
from runtime.vmm.cuda import CudaReservationBackend, local_gpu_ordinals, open_cuda_backend
from runtime.vmm.host import HostReservationBackend
from runtime.vmm.manager import ReservationManager, cuda_backend_factory

GIB = 1024**3


@pytest.mark.unit
def test_host_backend_reserves_address_space_and_accounts_commits() -> None:
    backend = HostReservationBackend("g0", 80 * GIB)
    resv = backend.reserve("plan-a", 80 * GIB)  # address space only: nothing committed
    assert resv is not None and backend.committed_bytes() == 0
    first = backend.commit(resv, "r1", 3 * MIB)
    assert first is not None and first.size_bytes == 4 * MIB  # 2 MiB granules
    assert backend.commit(resv, "r1", MIB) is None
    assert backend.last_error is CommitError.DUPLICATE_COMMIT
    assert backend.commit(resv, "big", 80 * GIB) is None  # past the device: rejected, no raise
    assert backend.last_error is CommitError.OUT_OF_MEMORY
    backend.release_commit(first)
    backend.release_commit(first)  # idempotent
    assert backend.committed_bytes() == 0
    backend.commit(resv, "r2", GIB)
    backend.unreserve(resv)
    backend.unreserve(resv)  # idempotent
    assert backend.committed_bytes() == 0
    assert backend.commit(resv, "r3", MIB) is None
    assert backend.last_error is CommitError.UNKNOWN_RESERVATION


@pytest.mark.unit
def test_host_reservation_caps_commits_at_its_address_range() -> None:
    backend = HostReservationBackend("g0", 80 * GIB)
    resv = backend.reserve("plan-a", 8 * MIB)
    assert resv is not None
    assert backend.commit(resv, "a", 8 * MIB) is not None
    assert backend.commit(resv, "b", 2 * MIB) is None
    assert backend.last_error is CommitError.RESERVATION_FULL


@pytest.mark.unit
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 64)), max_size=60))
def test_range_allocator_never_overlaps_and_merges_back(ops: list[tuple[bool, int]]) -> None:
    total = 256
    alloc = RangeAllocator(total)
    held: list[tuple[int, int]] = []
    for release, size in ops:
        if release and held:
            offset, length = held.pop(size % len(held))
            alloc.free(offset, length)
            continue
        got = alloc.allocate(size)
        if got is not None:
            held.append((got, size))
    spans = sorted(held)
    for (a, la), (b, _) in itertools.pairwise(spans):
        assert a + la <= b
    assert all(o >= 0 and o + n <= total for o, n in spans)
    assert alloc.free_bytes == total - sum(n for _, n in held)
    for offset, length in held:
        alloc.free(offset, length)
    assert alloc.allocate(total) == 0  # fully merged again


def _merged_by_full_pass(
    spans: list[tuple[int, int]], offset: int, size: int
) -> list[tuple[int, int]]:
    """The allocator's former ``free``: insert, then merge the whole list."""
    out = sorted([*spans, (offset, size)])
    merged: list[tuple[int, int]] = []
    for start, length in out:
        if merged and merged[-1][0] + merged[-1][1] == start:
            merged[-1] = (merged[-1][0], merged[-1][1] + length)
        else:
            merged.append((start, length))
    return merged


@pytest.mark.unit
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 64)), max_size=80))
def test_range_allocator_free_merges_as_a_full_pass_would(ops: list[tuple[bool, int]]) -> None:
    alloc = RangeAllocator(256)
    held: list[tuple[int, int]] = []
    for release, size in ops:
        if release and held:
            offset, length = held.pop(size % len(held))
            expected = _merged_by_full_pass(alloc._free, offset, length)
            alloc.free(offset, length)
            assert alloc._free == expected
            continue
        got = alloc.allocate(size)
        if got is not None:
            held.append((got, size))


@pytest.mark.unit
def test_round_up_to_granules() -> None:
    assert round_up(1, 2 * MIB) == 2 * MIB
    assert round_up(0, 2 * MIB) == 2 * MIB
    assert round_up(4 * MIB, 2 * MIB) == 4 * MIB


@pytest.mark.unit
def test_manager_commits_all_or_nothing_across_a_replica() -> None:
    small = {"g0": 80 * GIB, "g1": 4 * GIB}
    manager = ReservationManager(lambda uuid, cap: HostReservationBackend(uuid, small[uuid]))
    assert manager.reserve_replica("x", {u: (80 * GIB, c) for u, c in small.items()})
    assert not manager.commit("x", "r1", {"g0": 2 * GIB, "g1": 8 * GIB})  # g1 refuses
    assert manager.last_failure is not None and manager.last_failure.gpu_uuid == "g1"
    memory = manager.memory()
    assert memory["g0"].committed_bytes == 0 and memory["g1"].committed_bytes == 0
    assert manager.commit("x", "r2", {"g0": GIB, "g1": GIB})
    # one replica's GPUs, as admission reads them: the full ledger's figures; unknown GPUs left out
    assert manager.memory_of(["g1", "nope"]) == {"g1": manager.memory()["g1"]}
    manager.unreserve_replica("x")
    manager.unreserve_replica("x")
    assert all(m.committed_bytes == 0 for m in manager.memory().values())
    assert not manager.commit("x", "r3", {"g0": GIB})


# ---- CUDA backend against a fake driver module --------------------------------------------------


class CUresult(enum.Enum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_VALUE = 1
    CUDA_ERROR_OUT_OF_MEMORY = 2
    CUDA_ERROR_NO_DEVICE = 100


class FakeDriver:
    """Just enough of ``cuda.bindings.driver`` for the VMM calls, with injectable failures."""

    CUresult = CUresult
    CUmemAllocationType = SimpleNamespace(CU_MEM_ALLOCATION_TYPE_PINNED=1)
    CUmemLocationType = SimpleNamespace(CU_MEM_LOCATION_TYPE_DEVICE=1)
    CUmemAccess_flags = SimpleNamespace(CU_MEM_ACCESS_FLAGS_PROT_READWRITE=3)
    CUmemAllocationGranularity_flags = SimpleNamespace(CU_MEM_ALLOC_GRANULARITY_MINIMUM=0)

    def __init__(self, device_bytes: int = 8 * GIB) -> None:
        self.fail: dict[str, CUresult] = {}
        self.raise_on: set[str] = set()
        self.calls: list[str] = []
        self.device_bytes = device_bytes
        self.created = 0
        self.handles = itertools.count(1)
        self.live_handles: set[int] = set()

    class CUdeviceptr:
        def __init__(self, address: int = 0) -> None:
            self.address = address

        def __int__(self) -> int:
            return self.address

    @staticmethod
    def CUmemAllocationProp() -> Any:
        return SimpleNamespace(type=None, location=SimpleNamespace(type=None, id=None))

    @staticmethod
    def CUmemAccessDesc() -> Any:
        return SimpleNamespace(flags=None, location=SimpleNamespace(type=None, id=None))

    def _result(self, name: str, *values: Any) -> tuple[Any, ...]:
        self.calls.append(name)
        if name in self.raise_on:
            raise RuntimeError(f"{name} exploded")
        return (self.fail.get(name, CUresult.CUDA_SUCCESS), *values)

    def __getattr__(self, name: str) -> Any:
        if not name.startswith("cu"):
            raise AttributeError(name)
        return lambda *args: self._call(name, *args)

    def _call(self, name: str, *args: Any) -> tuple[Any, ...]:
        if name == "cuMemCreate":
            size = args[0]
            if name not in self.fail and self.created + size > self.device_bytes:
                self.calls.append(name)
                return (CUresult.CUDA_ERROR_OUT_OF_MEMORY, None)
            handle = next(self.handles)
            out = self._result(name, handle)
            if out[0] is CUresult.CUDA_SUCCESS:
                self.created += size
                self.live_handles.add(handle)
            return out
        if name == "cuMemRelease":
            self.live_handles.discard(args[0])
            return self._result(name)
        if name == "cuDeviceGetUuid":
            ordinal = args[0]
            return self._result(
                name, SimpleNamespace(bytes=bytes(range(ordinal * 16, ordinal * 16 + 16)))
            )
        values = {
            "cuDeviceGetCount": (2,),
            "cuDeviceGet": (args[0] if args else 0,),
            "cuDevicePrimaryCtxRetain": ("ctx",),
            "cuMemGetAllocationGranularity": (2 * MIB,),
            "cuDeviceTotalMem": (self.device_bytes,),
            "cuMemAddressReserve": (self.CUdeviceptr(0x7F0000000000),),
        }.get(name, ())
        return self._result(name, *values)


@pytest.mark.unit
def test_cuda_backend_maps_the_driver_calls() -> None:
    drv = FakeDriver()
    backend = open_cuda_backend(0, device="GPU-0", driver=drv)
    assert backend is not None and backend.granularity_bytes == 2 * MIB
    resv = backend.reserve("plan-a", 4 * GIB)
    assert resv is not None and resv.base_address == 0x7F0000000000
    commit = backend.commit(resv, "r1", 3 * MIB)
    assert commit is not None and commit.size_bytes == 4 * MIB
    assert drv.calls[-3:] == ["cuMemCreate", "cuMemMap", "cuMemSetAccess"]
    backend.release_commit(commit)
    assert drv.calls[-2:] == ["cuMemUnmap", "cuMemRelease"] and not drv.live_handles
    chunks = [backend.commit(resv, f"r1#{n}", MIB) for n in range(2)]
    backend.release_commits([c for c in chunks if c is not None])  # each unmapped, released
    assert drv.calls[-4:] == ["cuMemUnmap", "cuMemRelease"] * 2 and not drv.live_handles
    assert backend.committed_bytes() == 0
    backend.commit(resv, "r2", MIB)
    backend.unreserve(resv)
    assert drv.calls[-1] == "cuMemAddressFree" and not drv.live_handles
    backend.unreserve(resv)  # idempotent: no second free
    assert drv.calls.count("cuMemAddressFree") == 1


@pytest.mark.unit
@pytest.mark.parametrize(
    ("failing", "raises", "cleanup"),
    [
        ("cuMemCreate", False, []),
        ("cuMemMap", False, ["cuMemRelease"]),
        ("cuMemSetAccess", False, ["cuMemUnmap", "cuMemRelease"]),
        ("cuMemMap", True, ["cuMemRelease"]),
    ],
)
def test_cuda_driver_errors_become_rejected_commits_never_exceptions(
    failing: str, raises: bool, cleanup: list[str]
) -> None:
    drv = FakeDriver()
    backend = open_cuda_backend(0, driver=drv)
    assert backend is not None
    resv = backend.reserve("plan-a", GIB)
    assert resv is not None
    if raises:
        drv.raise_on.add(failing)
    else:
        drv.fail[failing] = CUresult.CUDA_ERROR_OUT_OF_MEMORY
    before = len(drv.calls)
    assert backend.commit(resv, "r1", MIB) is None
    if cleanup:  # partial work undone, in reverse order
        assert drv.calls[before:][-len(cleanup) :] == cleanup
    assert not drv.live_handles and backend.committed_bytes() == 0
    assert backend.last_driver_error is not None and failing in backend.last_driver_error
    drv.fail.clear()
    drv.raise_on.clear()
    assert backend.commit(resv, "r1", MIB) is not None  # the address span was given back


@pytest.mark.unit
def test_cuda_device_out_of_memory_is_a_rejection() -> None:
    drv = FakeDriver(device_bytes=16 * MIB)
    backend = open_cuda_backend(0, driver=drv, limit_bytes=GIB)
    assert backend is not None and backend.capacity_bytes() == 16 * MIB
    resv = backend.reserve("plan-a", GIB)
    assert resv is not None
    assert backend.commit(resv, "r1", 32 * MIB) is None
    assert backend.last_error is CommitError.OUT_OF_MEMORY


@pytest.mark.unit
@pytest.mark.parametrize("failing", ["cuInit", "cuDeviceGet", "cuMemGetAllocationGranularity"])
def test_no_usable_gpu_means_no_backend(failing: str) -> None:
    drv = FakeDriver()
    drv.fail[failing] = CUresult.CUDA_ERROR_NO_DEVICE
    assert open_cuda_backend(0, driver=drv) is None
    drv = FakeDriver()
    drv.raise_on.add("cuInit")  # a missing libcuda raises inside the bindings
    assert open_cuda_backend(0, driver=drv) is None


@pytest.mark.unit
def test_reserve_failure_is_reported_not_raised() -> None:
    drv = FakeDriver()
    backend = open_cuda_backend(0, driver=drv)
    assert isinstance(backend, CudaReservationBackend)
    drv.fail["cuMemAddressReserve"] = CUresult.CUDA_ERROR_OUT_OF_MEMORY
    assert backend.reserve("plan-a", GIB) is None
    assert backend.last_error is CommitError.ADDRESS_SPACE


@pytest.mark.unit
def test_local_gpus_get_cuda_vmm_and_others_host_accounting() -> None:
    drv = FakeDriver()
    ordinals = local_gpu_ordinals(drv)
    assert ordinals == {
        "GPU-00010203-0405-0607-0809-0a0b0c0d0e0f": 0,
        "GPU-10111213-1415-1617-1819-1a1b1c1d1e1f": 1,
    }
    manager = ReservationManager(cuda_backend_factory(ordinals, driver=drv))
    local, simulated = "GPU-10111213-1415-1617-1819-1a1b1c1d1e1f", "GPU-sim-A-node-a1-0"
    assert isinstance(manager.backend(local, GIB), CudaReservationBackend)
    assert isinstance(manager.backend(simulated, GIB), HostReservationBackend)
    drv.fail["cuInit"] = CUresult.CUDA_ERROR_NO_DEVICE
    assert local_gpu_ordinals(drv) == {}


@pytest.mark.gpu
def test_cuda_vmm_on_a_real_gpu() -> None:
    backend = open_cuda_backend(0)
    if backend is None:
        pytest.skip("no NVIDIA GPU/driver on this machine")
    resv = backend.reserve("plan-gpu-test", 4 * GIB)
    assert resv is not None and resv.base_address != 0
    commit = backend.commit(resv, "r1", 64 * MIB)
    assert commit is not None and backend.committed_bytes() == commit.size_bytes
    too_big = backend.commit(resv, "huge", backend.capacity_bytes() * 2)
    assert too_big is None  # refused with an error code, the process lives on
    backend.release_commit(commit)
    backend.unreserve(resv)
    assert backend.committed_bytes() == 0


@pytest.mark.unit
def test_a_request_extends_its_pages_all_or_nothing_and_gives_them_all_back() -> None:
    manager = ReservationManager(lambda uuid, cap: HostReservationBackend(uuid, cap))
    assert manager.reserve_replica("rep", {"g0": (10 * GIB, 10 * GIB), "g1": (GIB, GIB)})
    assert manager.extend("rep", "r1", {"g0": 3 * MIB, "g1": MIB})  # no commit yet: the first
    assert manager.extend("rep", "r1", {"g0": 2 * MIB})
    assert manager.held_bytes("rep", "r1") == {"g0": 6 * MIB, "g1": 2 * MIB}
    assert not manager.extend("rep", "r1", {"g0": MIB, "g1": 2 * GIB})  # g1 has no room
    assert manager.held_bytes("rep", "r1") == {"g0": 6 * MIB, "g1": 2 * MIB}  # g0's undone
    manager.release("rep", "r1")
    assert not manager.holds("rep", "r1") and manager.held_bytes("rep", "r1") == {}
    assert {u: m.committed_bytes for u, m in manager.memory().items()} == {"g0": 0, "g1": 0}


def _extend_to_by_hand(
    manager: ReservationManager, request: str, per_token: dict[str, int], tokens: int
) -> int | None:
    """What the pager did before ``extend_to``: read held bytes, extend by the lack, read again."""
    held = manager.held_bytes("rep", request)
    lack = {
        u: per * tokens - held.get(u, 0)
        for u, per in per_token.items()
        if per * tokens > held.get(u, 0)
    }
    if lack and not manager.extend("rep", request, lack):
        return None
    held = manager.held_bytes("rep", request)
    return min((held.get(u, 0) // per for u, per in per_token.items()), default=tokens)


@pytest.mark.unit
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["a", "b", "c"]),
            st.integers(0, 400),
            st.booleans(),  # release the request afterwards
            st.sampled_from([("g0", "g1"), ("g0",), ("g1",)]),  # GPUs asked (uneven chunks)
        ),
        max_size=40,
    )
)
def test_extend_to_commits_what_extending_by_the_lack_commits(
    steps: list[tuple[str, int, bool, tuple[str, ...]]],
) -> None:
    # The fused ledger operation a pager grows KV pages with: the same outcome, held bytes,
    # committed bytes and failing GPU as reading held_bytes around an extend, step by step.
    per_token = {"g0": 300 * 1024, "g1": 40 * 1024}
    sizes = {"g0": (64 * MIB, 64 * MIB), "g1": (12 * MIB, 12 * MIB)}
    fused, by_hand = (
        ReservationManager(lambda u, cap: HostReservationBackend(u, cap, map_address_space=False))
        for _ in range(2)
    )
    for manager in (fused, by_hand):
        assert manager.reserve_replica("rep", sizes)
    for request, tokens, release, gpus in steps:
        asked = {u: per_token[u] for u in gpus}
        got = fused.extend_to("rep", request, asked, tokens)
        assert got == _extend_to_by_hand(by_hand, request, asked, tokens)
        assert fused.held_bytes("rep", request) == by_hand.held_bytes("rep", request)
        assert fused.memory() == by_hand.memory()
        assert fused.last_failure == by_hand.last_failure
        if release:
            fused.release("rep", request)
            by_hand.release("rep", request)


@pytest.mark.unit
def test_admission_sees_other_replicas_holding_at_least_their_floor() -> None:
    gib = 1024**3
    vmm = ReservationManager(lambda u, cap: HostReservationBackend(u, cap, map_address_space=False))
    for rid in ("x", "y"):
        assert vmm.reserve_replica(rid, {"g": (100 * gib, 100 * gib)})
        assert vmm.commit(rid, "weights", {"g": 10 * gib})
    assert vmm.memory_for("x", {"g": gib}) == vmm.memory_of(["g"])  # no floors: the ledger
    vmm.set_floor("y", {"g": 30 * gib})
    # y holds 10 GiB committed but 30 guaranteed: x's admission sees 40
    assert vmm.memory_for("x", {"g": gib})["g"].committed_bytes == 40 * gib
    # y's own request inside its floor adds nothing to what the GPU holds for it
    assert vmm.memory_for("y", {"g": 5 * gib})["g"].committed_bytes == 10 * gib + 30 * gib - 5 * gib
    assert vmm.commit("y", "r", {"g": 25 * gib})  # past its floor: its commits count as they are
    assert vmm.memory_for("x", {"g": gib})["g"].committed_bytes == 45 * gib
    vmm.unreserve_replica("y")
    assert vmm.memory_for("x", {"g": gib})["g"].committed_bytes == 10 * gib


_FLOOR_OPS = st.lists(
    st.tuples(
        st.sampled_from(("commit", "extend", "release", "unreserve")),
        st.sampled_from(("x", "y", "z")),
        st.sampled_from(("r1", "r2", "r3")),
        st.integers(1, 12),
    ),
    max_size=40,
)


@given(_FLOOR_OPS)
def test_floored_admission_matches_the_ledger_after_any_history(ops: list[Any]) -> None:
    """memory_for reads each replica's use from a running per-GPU total: after any mix of
    commits, extensions, releases and unreservations it equals the sum over the requests."""
    gib = 1024**3
    vmm = ReservationManager(lambda u, cap: HostReservationBackend(u, cap, map_address_space=False))
    gpus = ("g0", "g1")
    floors = {"x": 6 * gib, "y": 3 * gib}
    requests: set[tuple[str, str]] = set()

    def reserve(rid: str) -> None:
        if not vmm.has_reservation(rid):
            assert vmm.reserve_replica(rid, {g: (80 * gib, 80 * gib) for g in gpus})
            if rid in floors:
                vmm.set_floor(rid, dict.fromkeys(gpus, floors[rid]))

    for op, rid, req, size in ops:
        reserve(rid)
        if op in ("commit", "extend"):
            more = {"g0": size * gib, "g1": gib} if op == "commit" else {"g0": size * gib}
            if getattr(vmm, op)(rid, req, more):
                requests.add((rid, req))
        elif op == "release":
            vmm.release(rid, req)
            requests.discard((rid, req))
        elif op == "unreserve":
            vmm.unreserve_replica(rid)
            requests = {k for k in requests if k[0] != rid}
        for me in ("x", "y", "z"):
            if not vmm.has_reservation(me):
                continue
            seen = vmm.memory_for(me, dict.fromkeys(gpus, gib))
            for g in gpus:
                use = dict.fromkeys((r for r in floors if vmm.has_reservation(r)), 0)
                for r, q in requests:
                    use[r] = use.get(r, 0) + vmm.held_bytes(r, q).get(g, 0)
                floor = {r: floors[r] for r in floors if vmm.has_reservation(r)}
                others = sum(max(b, floor.get(r, 0)) for r, b in use.items() if r != me)
                mine = max(use.get(me, 0) + gib, floor.get(me, 0))
                assert seen[g].committed_bytes == others + mine - gib


class _PlainFirstFit:
    """The allocator without its hint: first fit by a scan from the first span."""

    def __init__(self, size: int) -> None:
        self.free: list[tuple[int, int]] = [(0, size)]

    def allocate(self, size: int) -> int | None:
        for i, (start, length) in enumerate(self.free):
            if length >= size:
                if length == size:
                    del self.free[i]
                else:
                    self.free[i] = (start + size, length - size)
                return start
        return None

    def release(self, offset: int, size: int) -> None:
        self.free = _merged_by_full_pass(self.free, offset, size)


@pytest.mark.unit
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(1, 24)), max_size=200))
def test_range_allocator_hint_gives_the_plain_first_fit(ops: list[tuple[int, int]]) -> None:
    alloc, plain = RangeAllocator(256), _PlainFirstFit(256)
    held: list[tuple[int, int]] = []
    for action, size in ops:
        if action == 0 and held:
            offset, length = held.pop(size % len(held))
            alloc.free(offset, length)
            plain.release(offset, length)
        else:
            got = alloc.allocate(size)
            assert got == plain.allocate(size)
            if got is not None:
                held.append((got, size))
        assert alloc._free == plain.free
        hint = alloc._hint_at
        assert all(length < alloc._hint_size for _, length in alloc._free[:hint])


@pytest.mark.unit
@given(
    st.lists(st.tuples(st.booleans(), st.integers(1, 9)), max_size=40),  # (second resv, MiB)
    st.lists(st.integers(0, 60), max_size=60),  # commits to give back (repeats: twice)
)
def test_release_commits_is_release_commit_of_each(
    sizes: list[tuple[bool, int]], picks: list[int]
) -> None:
    # The one-call release a manager gives a request's chunks on a GPU: the same pages, free
    # spans (so the same later offsets) and committed bytes as releasing them one by one.
    ledgers: list[tuple[HostReservationBackend, list[Any], list[Commit]]] = []
    for _ in range(2):
        backend = HostReservationBackend("g", 64 * MIB, map_address_space=False)
        resvs = [backend.reserve("p", 32 * MIB), backend.reserve("q", 32 * MIB)]
        made: list[Commit | None] = []
        for n, (second, mib) in enumerate(sizes):
            resv = resvs[second]
            assert resv is not None
            made.append(backend.commit(resv, f"r{n}", mib * MIB))
        picked = [made[p] for p in picks if p < len(made)]
        ledgers.append((backend, resvs, [c for c in picked if c is not None]))
    (fused, fused_resvs, given_back), (plain, plain_resvs, one_by_one) = ledgers
    fused.release_commits(given_back)
    for commit in one_by_one:
        plain.release_commit(commit)
    assert fused.committed_bytes() == plain.committed_bytes()
    for a, b in zip(fused_resvs, plain_resvs, strict=True):
        assert a is not None and b is not None
        for n in range(4):  # the free spans left: the same first fits
            got, want = fused.commit(a, f"again{n}", 3 * MIB), plain.commit(b, f"again{n}", 3 * MIB)
            assert (got and got.offset_bytes) == (want and want.offset_bytes)


@pytest.mark.unit
def test_a_floor_set_after_commits_counts_them() -> None:
    # Per-replica use is kept only on GPUs that had a floor: one set late reads the ledger.
    vmm = ReservationManager(lambda u, cap: HostReservationBackend(u, cap, map_address_space=False))
    for rid in ("x", "y"):
        assert vmm.reserve_replica(rid, {"g": (100 * GIB, 100 * GIB)})
        assert vmm.commit(rid, "weights", {"g": 10 * GIB})
    assert vmm.extend_to("y", "r", {"g": GIB}, 7) == 7
    assert vmm.extend_to("y", "r", {"g": GIB}, 9) == 9
    vmm.set_floor("x", {"g": 30 * GIB})
    assert vmm.memory_for("y", {"g": GIB})["g"].committed_bytes == 30 * GIB + 19 * GIB
    vmm.release("y", "r")
    assert vmm.memory_for("y", {"g": GIB})["g"].committed_bytes == 30 * GIB + 10 * GIB

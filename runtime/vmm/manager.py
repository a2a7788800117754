"""Reservation manager: one backend per GPU, reservations per replica, commits per request.

A replica reserves address space on each of its GPUs (prepare) and commits its weight shard;
each request then commits its KV pages on every GPU of the replica at once — all or nothing, so
a request never holds pages on half a pipeline — and may extend them as it generates tokens
(paged KV, :mod:`runtime.engine.paging`). The manager's ledger is what the watermark throttle
reads.

Replicas of several deployments may share a GPU (on-demand models). A replica may be given a
*floor* per GPU — its weights and the KV its placement counted on: admission then sees every
other replica on the GPU as holding at least its floor (:meth:`ReservationManager.memory_for`),
so a busy neighbour's KV never takes the room a quiet model's next requests were placed with.
Extensions of admitted sequences are bounded by the GPU's memory only, as before.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from runtime.throttle import GpuMemory
from runtime.vmm.base import Commit, CommitError, Reservation, ReservationBackend
from runtime.vmm.cuda import open_cuda_backend
from runtime.vmm.host import HostReservationBackend

BackendFactory = Callable[[str, int], ReservationBackend | None]  # (gpu uuid, capacity bytes)
WEIGHTS_REQUEST = "__weights__"  # request id under which a replica's weight shard is committed
_NOTHING: Mapping[str, int] = MappingProxyType({})  # what a request without commits holds


def host_backend_factory(gpu_uuid: str, capacity_bytes: int) -> ReservationBackend:
    """Host accounting backend standing for a (simulated) GPU of ``capacity_bytes``."""
    return HostReservationBackend(gpu_uuid, capacity_bytes)


def cuda_backend_factory(
    ordinals: Mapping[str, int],
    fallback: BackendFactory = host_backend_factory,
    driver: Any | None = None,
) -> BackendFactory:
    """CUDA VMM for the local GPUs (by UUID); ``fallback`` for any other (simulated) GPU.

    A local GPU whose backend cannot be opened gets ``None``: its reservations are refused,
    which fails the transition's prepare rather than faking memory that is not there.
    """

    def make(gpu_uuid: str, capacity_bytes: int) -> ReservationBackend | None:
        if gpu_uuid in ordinals:
            return open_cuda_backend(
                ordinals[gpu_uuid], device=gpu_uuid, limit_bytes=capacity_bytes, driver=driver
            )
        return fallback(gpu_uuid, capacity_bytes)

    return make


@dataclass(frozen=True, slots=True)
class CommitFailure:
    """Which GPU refused a commit and why."""

    gpu_uuid: str
    error: CommitError | None


def replica_floor(weights_bytes: int, kv_bytes: int, capacity_bytes: int, watermark: float) -> int:
    """The floor an on-demand replica gets on one GPU: its weights and the KV its placement
    counted on, at most the watermark's share of the GPU.

    NOTE: placement cuts the batch of a model that nearly fills its card (gearbox.residency);
    a floor past the watermark would refuse every request of the replica it guarantees.
    """
    return min(weights_bytes + kv_bytes, int(watermark * capacity_bytes))


def floored_memory(
    total_bytes: int,
    used: Mapping[str, int],
    floors: Mapping[str, int],
    replica_id: str,
    need_bytes: int,
) -> GpuMemory:
    """One GPU as an admission of ``need_bytes`` for ``replica_id`` sees it when replicas there
    have floors (``used``: per replica, the bytes it has committed): every other replica holds
    at least its floor, and the replica's own floor already covers what it commits below it.
    """
    held = {**dict.fromkeys(floors, 0), **used}
    others = sum(max(c, floors.get(r, 0)) for r, c in held.items() if r != replica_id)
    mine = max(held.get(replica_id, 0) + need_bytes, floors.get(replica_id, 0))
    return GpuMemory(total_bytes, others + mine - need_bytes)


class ReservationManager:
    """Per-GPU VMM backends behind one ledger (no policy: callers decide what to reserve)."""

    def __init__(self, factory: BackendFactory = host_backend_factory) -> None:
        self._factory = factory
        self._backends: dict[str, ReservationBackend] = {}
        self._reservations: dict[str, dict[str, Reservation]] = {}  # replica → gpu → resv
        # (replica, request) → gpu → its commits: the first, then one per extension
        self._commits: dict[tuple[str, str], dict[str, list[Commit]]] = {}
        # (replica, request) → gpu → the bytes of its commits there (``held_bytes``, kept as
        # they change: a simulated engine asks once per page it grows)
        self._totals: dict[tuple[str, str], dict[str, int]] = {}
        # (replica, request) → the most commits it holds on one GPU: an extension's chunk id
        self._chunks: dict[tuple[str, str], int] = {}
        self._floors: dict[str, dict[str, int]] = {}  # gpu → replica → bytes it is guaranteed
        # gpu → replica → the bytes of its commits there (the sum of ``_totals``), so a floored
        # admission reads its neighbours' use per replica, not per request. NOTE: kept only for
        # GPUs that ever had a floor (the only ones ``memory_for`` reads it for): most commits
        # are on GPUs without one, and a KV page extension should not pay for it.
        self._by_gpu: dict[str, dict[str, int]] = {}
        self.last_failure: CommitFailure | None = None

    def backend(self, gpu_uuid: str, capacity_bytes: int) -> ReservationBackend | None:
        """The GPU's backend, created on first use."""
        if gpu_uuid not in self._backends:
            made = self._factory(gpu_uuid, capacity_bytes)
            if made is None:
                return None
            self._backends[gpu_uuid] = made
        return self._backends[gpu_uuid]

    def reserve_replica(self, replica_id: str, sizes: Mapping[str, tuple[int, int]]) -> bool:
        """Reserve ``size`` on each GPU (``sizes``: gpu → (reserve bytes, capacity bytes)).

        All or nothing: a refusal on one GPU releases what the others reserved.
        """
        if replica_id in self._reservations:
            return True
        held: dict[str, Reservation] = {}
        for uuid in sorted(sizes):
            size, capacity = sizes[uuid]
            backend = self.backend(uuid, capacity)
            resv = backend.reserve(replica_id, size) if backend is not None else None
            if resv is None or backend is None:
                self.last_failure = CommitFailure(uuid, backend.last_error if backend else None)
                for gpu, done in held.items():
                    self._backends[gpu].unreserve(done)
                return False
            held[uuid] = resv
        self._reservations[replica_id] = held
        return True

    def commit(self, replica_id: str, request_id: str, bytes_per_gpu: Mapping[str, int]) -> bool:
        """Commit pages for ``request_id`` on each GPU; all or nothing. False = reject."""
        resv = self._reservations.get(replica_id)
        key = (replica_id, request_id)
        if resv is None or key in self._commits:
            return resv is not None
        done = self._commit_all(resv, request_id, bytes_per_gpu)
        if done is None:
            return False
        self._commits[key] = {u: [c] for u, c in done}
        self._totals[key] = {u: c.size_bytes for u, c in done}
        self._chunks[key] = 1 if done else 0
        by_gpu = self._by_gpu
        for uuid, c in done:
            mine = by_gpu.get(uuid)
            if mine is not None:
                mine[replica_id] = mine.get(replica_id, 0) + c.size_bytes
        return True

    def extend(self, replica_id: str, request_id: str, bytes_per_gpu: Mapping[str, int]) -> bool:
        """Commit ``bytes_per_gpu`` more for a request (its first commit when it holds none);
        all or nothing. False = the pages are not there (the caller preempts, never crashes)."""
        key = (replica_id, request_id)
        held = self._commits.get(key)
        resv = self._reservations.get(replica_id)
        if held is None or resv is None:
            return self.commit(replica_id, request_id, bytes_per_gpu)
        return self._extend(key, held, resv, bytes_per_gpu)

    def _extend(
        self,
        key: tuple[str, str],
        held: dict[str, list[Commit]],
        resv: dict[str, Reservation],
        bytes_per_gpu: Mapping[str, int],
    ) -> bool:
        """``extend`` of a request that holds commits on a reserved replica."""
        replica_id, request_id = key
        # NOTE: a backend keeps one commit per request id; an extension is the n-th chunk (n:
        # the most chunks the request holds on one GPU, so the id is new on every GPU).
        chunks = self._chunks[key]
        done = self._commit_all(resv, f"{request_id}#{chunks}", bytes_per_gpu)
        if done is None:
            return False
        totals = self._totals[key]
        by_gpu = self._by_gpu
        for uuid, c in done:
            size = c.size_bytes
            mine = held.get(uuid)
            if mine is None:
                mine = held[uuid] = []
            mine.append(c)
            if len(mine) > chunks:
                chunks = len(mine)
            totals[uuid] = totals.get(uuid, 0) + size
            replicas = by_gpu.get(uuid)
            if replicas is not None:
                replicas[replica_id] = replicas.get(replica_id, 0) + size
        self._chunks[key] = chunks
        return True

    def extend_to(
        self, replica_id: str, request_id: str, bytes_per_token: Mapping[str, int], tokens: int
    ) -> int | None:
        """Hold KV for ``tokens`` tokens of a request, ``bytes_per_token`` on each GPU (every
        figure > 0): commit what it lacks on each GPU as one extension (its first commit when it
        holds none), all or nothing. Returns the tokens its commits then cover on every GPU
        (rounded up by the backends, often more than ``tokens``), or None when refused (nothing
        is committed: the caller preempts).

        One ledger operation for a replica's run of pages: the same backend commits, in the
        same order and under the same ids, as ``extend`` with the lacking bytes — without the
        caller reading ``held_bytes`` before and after it.
        """
        key = (replica_id, request_id)
        totals: Mapping[str, int] | None = self._totals.get(key)
        lack: dict[str, int] = {}
        if totals is None:  # no commit yet: the first one is all of it
            for uuid, per in bytes_per_token.items():
                if per * tokens > 0:
                    lack[uuid] = per * tokens
            if lack:
                if not self.commit(replica_id, request_id, lack):
                    return None
                totals = self._totals[key]
            else:
                totals = _NOTHING
        else:
            for uuid, per in bytes_per_token.items():
                short = per * tokens - totals.get(uuid, 0)
                if short > 0:
                    lack[uuid] = short
            if lack:
                # (``extend`` inlined: the request holds commits, so ``_commits`` has its key)
                resv = self._reservations.get(replica_id)
                if resv is None or not self._extend(key, self._commits[key], resv, lack):
                    return None
        # (``min`` over a generator, unrolled: one call per run of pages a sequence grows by)
        covered = tokens
        first = True
        for uuid, per in bytes_per_token.items():
            have = totals.get(uuid, 0) // per
            if first or have < covered:
                covered, first = have, False
        return covered

    def _commit_all(
        self, resv: dict[str, Reservation], request_id: str, bytes_per_gpu: Mapping[str, int]
    ) -> list[tuple[str, Commit]] | None:
        """Commit ``bytes_per_gpu`` on each GPU in uuid order, all or none (a failure releases
        what was done and sets ``last_failure``); the commits by GPU, in that order."""
        done: list[tuple[str, Commit]] = []
        backends = self._backends
        # NOTE: a single GPU's commit, the usual KV page extension, needs no sorting
        for uuid in sorted(bytes_per_gpu) if len(bytes_per_gpu) > 1 else bytes_per_gpu:
            backend = backends.get(uuid)
            at = resv.get(uuid)
            commit = None
            if backend is not None and at is not None:
                commit = backend.commit(at, request_id, bytes_per_gpu[uuid])
            if commit is None:
                self.last_failure = CommitFailure(uuid, backend.last_error if backend else None)
                for gpu, c in done:
                    backends[gpu].release_commit(c)
                return None
            done.append((uuid, commit))
        return done

    def held_bytes(self, replica_id: str, request_id: str) -> dict[str, int]:
        """Bytes committed for the request on each GPU (rounded up by the backends)."""
        return dict(self._totals.get((replica_id, request_id), ()))

    def holds(self, replica_id: str, request_id: str) -> bool:
        """True when the request has pages committed on the replica."""
        return (replica_id, request_id) in self._commits

    def release(self, replica_id: str, request_id: str) -> None:
        """Return a request's pages on a replica; idempotent."""
        key = (replica_id, request_id)
        by_gpu = self._by_gpu
        for uuid, size in self._totals.pop(key, _NOTHING).items():
            replicas = by_gpu.get(uuid)
            if replicas is None:
                continue
            left = replicas[replica_id] - size
            if left:
                replicas[replica_id] = left
            else:
                del replicas[replica_id]
        self._chunks.pop(key, None)
        held = self._commits.pop(key, None)
        if held is None:
            return
        backends = self._backends
        for uuid, commits in held.items():
            backends[uuid].release_commits(commits)

    def set_floor(self, replica_id: str, bytes_per_gpu: Mapping[str, int]) -> None:
        """Guarantee the replica ``bytes_per_gpu`` on its GPUs against the others' admissions
        (see the module docstring); dropped with its reservation."""
        for uuid, size in bytes_per_gpu.items():
            self._floors.setdefault(uuid, {})[replica_id] = size
            if uuid not in self._by_gpu:
                self._by_gpu[uuid] = self._used_on(uuid)

    def _used_on(self, gpu_uuid: str) -> dict[str, int]:
        """Per replica, the bytes of its commits on the GPU (``_by_gpu`` from the ledger)."""
        used: dict[str, int] = {}
        for (replica_id, _), totals in self._totals.items():
            size = totals.get(gpu_uuid)
            if size:
                used[replica_id] = used.get(replica_id, 0) + size
        return used

    def memory_for(self, replica_id: str, need: Mapping[str, int]) -> dict[str, GpuMemory]:
        """:meth:`memory_of` the GPUs of ``need`` as an admission of ``need`` for the replica
        sees it: on a GPU with floors, every other replica holds at least its floor, and the
        replica's own floor already covers what it commits below it. The fill after ``need``
        is then ``(committed + need) / total`` as ever (:func:`runtime.throttle.check_watermark`).
        """
        memory = self.memory_of(need)
        for uuid, mem in memory.items():
            floors = self._floors.get(uuid)
            if floors:
                used = self._by_gpu.get(uuid, {})
                memory[uuid] = floored_memory(mem.total_bytes, used, floors, replica_id, need[uuid])
        return memory

    def unreserve_replica(self, replica_id: str) -> None:
        """Release every commit and reservation of the replica, and its floors; idempotent."""
        for floors in self._floors.values():
            floors.pop(replica_id, None)
        for key in [k for k in self._commits if k[0] == replica_id]:
            self.release(*key)
        for uuid, resv in self._reservations.pop(replica_id, {}).items():
            self._backends[uuid].unreserve(resv)

    def has_reservation(self, replica_id: str) -> bool:
        """True while the replica holds address space."""
        return replica_id in self._reservations

    def memory(self) -> dict[str, GpuMemory]:
        """The ledger per GPU: capacity and committed bytes."""
        return {
            uuid: GpuMemory(b.capacity_bytes(), b.committed_bytes())
            for uuid, b in self._backends.items()
        }

    def memory_of(self, gpu_uuids: Iterable[str]) -> dict[str, GpuMemory]:
        """:meth:`memory` of these GPUs only (those the ledger has a backend for).

        NOTE: admission checks one replica's GPUs per request; the whole ledger is every GPU of
        every deployment on the host.
        """
        backends = self._backends
        return {
            uuid: GpuMemory(b.capacity_bytes(), b.committed_bytes())
            for uuid in gpu_uuids
            if (b := backends.get(uuid)) is not None
        }

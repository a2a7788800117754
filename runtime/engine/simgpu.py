"""Simulated GPUs for the SimEngine: a memory ledger per GPU and injectable faults.

Several SimEngines (an old and a new plan during a shift, or two deployments) share one pool, so
they compete for the same simulated memory. Nothing here is hardware: it is the simulated
cluster's GPU state as the runtime's engines see it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass
class _SimGpu:
    total_bytes: int
    used_bytes: int = 0
    lost: bool = False  # preempted, failed or isolated: its processes are gone


class SimGpuPool:
    """Simulated GPU memory and fault state, shared by every SimEngine of a worker."""

    def __init__(self) -> None:
        self._gpus: dict[str, _SimGpu] = {}
        self._failing_loads: set[str] = set()
        self._failing_transfers: set[str] = set()
        self.oom_events = 0  # allocations refused at the memory limit (the throttle prevents them)
        self.version = 0  # bumped on every preemption or restore: engines re-check GPUs then

    def ensure(self, gpu_uuid: str, total_bytes: int) -> None:
        """Register a GPU with its memory size (first registration wins)."""
        self._gpus.setdefault(gpu_uuid, _SimGpu(total_bytes))

    def allocate(self, gpu_uuid: str, num_bytes: int) -> bool:
        """Take ``num_bytes``; False (and an OOM event) past the GPU's memory or on a lost GPU."""
        gpu = self._gpus.get(gpu_uuid)
        if gpu is None or gpu.lost:
            return False
        if gpu.used_bytes + num_bytes > gpu.total_bytes:
            self.oom_events += 1
            return False
        gpu.used_bytes += num_bytes
        return True

    def free(self, gpu_uuid: str, num_bytes: int) -> None:
        """Give bytes back (a lost GPU was already emptied)."""
        gpu = self._gpus.get(gpu_uuid)
        if gpu is not None:
            gpu.used_bytes = max(0, gpu.used_bytes - num_bytes)

    def used_bytes(self, gpu_uuid: str) -> int:
        """Bytes in use on the GPU."""
        gpu = self._gpus.get(gpu_uuid)
        return gpu.used_bytes if gpu else 0

    def total_bytes(self, gpu_uuid: str) -> int:
        """The GPU's memory size (0 when unknown)."""
        gpu = self._gpus.get(gpu_uuid)
        return gpu.total_bytes if gpu else 0

    def is_lost(self, gpu_uuid: str) -> bool:
        """True after a preemption or failure, until restored."""
        gpu = self._gpus.get(gpu_uuid)
        return gpu is not None and gpu.lost

    # ---- fault injection ----------------------------------------------------------------------

    def preempt(self, gpu_uuids: Iterable[str]) -> None:
        """Another tenant takes the GPUs: our processes on them die and their memory is gone."""
        for uuid in gpu_uuids:
            gpu = self._gpus.setdefault(uuid, _SimGpu(0))
            gpu.lost, gpu.used_bytes = True, 0
        self.version += 1

    def restore(self, gpu_uuids: Iterable[str]) -> None:
        """The GPUs come back empty."""
        for uuid in gpu_uuids:
            if uuid in self._gpus:
                self._gpus[uuid].lost = False
        self.version += 1

    def fail_loads(self, gpu_uuids: Iterable[str], failing: bool = True) -> None:
        """Make weight loads onto these GPUs fail (or succeed again)."""
        (self._failing_loads.update if failing else self._failing_loads.difference_update)(
            gpu_uuids
        )

    def fail_transfers(self, gpu_uuids: Iterable[str], failing: bool = True) -> None:
        """Make KV imports onto these GPUs fail (or succeed again)."""
        (self._failing_transfers.update if failing else self._failing_transfers.difference_update)(
            gpu_uuids
        )

    def load_fails(self, gpu_uuid: str) -> bool:
        """True when a load onto the GPU is set to fail."""
        return gpu_uuid in self._failing_loads or self.is_lost(gpu_uuid)

    def transfer_fails(self, gpu_uuid: str) -> bool:
        """True when a KV import onto the GPU is set to fail."""
        return gpu_uuid in self._failing_transfers or self.is_lost(gpu_uuid)

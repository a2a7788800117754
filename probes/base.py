"""Adapter protocols for the node agent's telemetry sources.

Each hardware path (NVML, eBPF) and the simulated backend implements one of these; the agent
(:mod:`probes.agent`) only schedules, filters deltas and publishes. Backends hold no policy.
"""

from __future__ import annotations

from typing import Protocol

from flexpipe.schemas import ClusterEvent, GpuSample, KernelLaunches


class GpuSampler(Protocol):
    """Reads every GPU on a node (NVML or simulated)."""

    name: str

    def sample(self, now_s: float) -> list[GpuSample]:
        """Full state of every GPU at ``now_s``; unsupported fields are None, never an exception."""
        ...

    def poll_events(self, now_s: float) -> list[ClusterEvent]:
        """Cluster events observed since the last call (XID errors, GPUs lost or back)."""
        ...

    def close(self) -> None:
        """Release the backend's handles; idempotent."""
        ...


class LaunchCounter(Protocol):
    """Counts CUDA kernel launches per process and maps them to GPUs (eBPF or simulated)."""

    name: str

    def drain(self, now_s: float) -> list[KernelLaunches]:
        """Launch counts per GPU since the previous drain; resets the counters."""
        ...

    def close(self) -> None:
        """Detach probes and free maps; idempotent."""
        ...

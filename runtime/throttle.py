"""Pre-OOM throttling: a watermark on committed memory per GPU.

A replica whose GPUs would pass the watermark (default 85 % of total memory) after committing a
request's KV stops taking that request; the router tries another replica, and when none passes
the request is rejected with HTTP 429 rather than risking an out-of-memory on the GPU. Pure
functions over the memory ledger the VMM keeps.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

DEFAULT_WATERMARK = 0.85  # the multi-model article's pre-OOM signal


class ThrottleReason(StrEnum):
    """Outcome of a watermark check."""

    UNDER_WATERMARK = "under_watermark"
    THROTTLED_WATERMARK = "throttled_watermark"
    UNKNOWN_GPU = "unknown_gpu"  # no memory figure for a GPU: refuse rather than guess


@dataclass(frozen=True, slots=True)
class GpuMemory:
    """One GPU's memory as the reservation ledger sees it."""

    total_bytes: int
    committed_bytes: int  # weights + KV pages committed through the VMM

    @property
    def fill(self) -> float:
        """Committed share of total memory."""
        return self.committed_bytes / self.total_bytes if self.total_bytes > 0 else 1.0


@dataclass(frozen=True, slots=True)
class ThrottleVerdict:
    """Whether a request may be committed on a replica, and which GPU said no."""

    allowed: bool
    reason: ThrottleReason
    gpu_uuid: str | None = None  # the GPU that crossed (or is unknown)
    fill_after: float = 0.0  # the highest fill the request would leave behind


def check_watermark(
    memory: Mapping[str, GpuMemory], request_bytes: Mapping[str, int], watermark: float
) -> ThrottleVerdict:
    """Allow only if every GPU stays at or below ``watermark`` after adding its request bytes."""
    worst_fill, worst_gpu = 0.0, None
    for uuid in sorted(request_bytes):
        gpu = memory.get(uuid)
        if gpu is None:
            return ThrottleVerdict(False, ThrottleReason.UNKNOWN_GPU, uuid, 1.0)
        fill = GpuMemory(gpu.total_bytes, gpu.committed_bytes + request_bytes[uuid]).fill
        if fill > worst_fill or worst_gpu is None:
            worst_fill, worst_gpu = fill, uuid
        if fill > watermark:
            return ThrottleVerdict(False, ThrottleReason.THROTTLED_WATERMARK, uuid, fill)
    return ThrottleVerdict(True, ThrottleReason.UNDER_WATERMARK, worst_gpu, worst_fill)


def is_throttled(
    memory: Mapping[str, GpuMemory], gpu_uuids: tuple[str, ...], watermark: float
) -> bool:
    """True when any of the GPUs already sits at or above the watermark (admission stops)."""
    return any(uuid not in memory or memory[uuid].fill >= watermark for uuid in gpu_uuids)

"""Unit: the pre-OOM watermark."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from runtime.throttle import GpuMemory, ThrottleReason, check_watermark, is_throttled

pytestmark = pytest.mark.unit

GIB = 1024**3
gpus = st.dictionaries(
    st.sampled_from(["g0", "g1", "g2", "g3"]),
    st.integers(1, 80).flatmap(
        lambda total: st.tuples(st.just(total * GIB), st.integers(0, total * GIB))
    ),
    min_size=1,
)


@given(gpus, st.integers(0, 100 * GIB), st.floats(0.05, 1.0))
def test_admits_exactly_when_every_gpu_stays_under_the_mark(
    sizes: dict[str, tuple[int, int]], request_bytes: int, watermark: float
) -> None:
    memory = {u: GpuMemory(total, used) for u, (total, used) in sizes.items()}
    need = dict.fromkeys(memory, request_bytes)
    verdict = check_watermark(memory, need, watermark)
    fills = [(m.committed_bytes + request_bytes) / m.total_bytes for m in memory.values()]
    assert verdict.allowed == all(f <= watermark for f in fills)
    if not verdict.allowed:
        assert verdict.reason is ThrottleReason.THROTTLED_WATERMARK
        assert verdict.fill_after > watermark


@given(gpus, st.integers(0, 100 * GIB), st.integers(0, 100 * GIB), st.floats(0.05, 1.0))
def test_smaller_requests_are_never_refused_when_larger_pass(
    sizes: dict[str, tuple[int, int]], a: int, b: int, watermark: float
) -> None:
    memory = {u: GpuMemory(total, used) for u, (total, used) in sizes.items()}
    small, large = sorted((a, b))
    if check_watermark(memory, dict.fromkeys(memory, large), watermark).allowed:
        assert check_watermark(memory, dict.fromkeys(memory, small), watermark).allowed


def test_unknown_gpu_is_refused_not_guessed() -> None:
    verdict = check_watermark({"g0": GpuMemory(GIB, 0)}, {"g9": 1}, 0.85)
    assert not verdict.allowed
    assert verdict.reason is ThrottleReason.UNKNOWN_GPU


def test_a_gpu_at_the_mark_stops_admission() -> None:
    memory = {"g0": GpuMemory(100, 85), "g1": GpuMemory(100, 10)}
    assert is_throttled(memory, ("g0", "g1"), 0.85)
    assert not is_throttled(memory, ("g1",), 0.85)

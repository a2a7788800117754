"""Delta filter: publish on change past a threshold, on first sight, and on heartbeat."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from flexpipe.schemas import GpuProcess, GpuSample, SampleReason
from probes.delta import _BY_THRESHOLD, _EXACT, DeltaFilter, DeltaThresholds, _with_reason, moved
from tests.fixtures.scenarios.builders import make_sample

pytestmark = pytest.mark.unit

MIB = 2**20


def primed(**fields: Any) -> DeltaFilter:
    """A filter that has already published the default sample (with ``fields``) at t=0."""
    f = DeltaFilter()
    assert [s.reason for s in f.filter([make_sample(**fields)], 0.0)] == [SampleReason.INITIAL]
    return f


def test_first_sample_of_each_gpu_is_initial() -> None:
    f = DeltaFilter()
    out = f.filter([make_sample(), make_sample(gpu_uuid="GPU-2")], 0.0)
    assert [(s.gpu_uuid, s.reason) for s in out] == [
        ("GPU-sim-A-node-a1-0", SampleReason.INITIAL),
        ("GPU-2", SampleReason.INITIAL),
    ]


@pytest.mark.parametrize(
    ("field", "below", "at_threshold"),
    [
        ("memory_used_bytes", 20 * 2**30 + 255 * MIB, 20 * 2**30 + 256 * MIB),
        ("sm_util_pct", 44.0, 45.0),
        ("mem_util_pct", 26.0, 25.0),
        ("temperature_c", 56.0, 57.0),
        ("power_w", 309.0, 310.0),
        ("pcie_rx_bytes_per_s", 9e8, 1.2e9),
    ],
)
def test_numeric_fields_publish_only_past_their_threshold(
    field: str, below: float, at_threshold: float
) -> None:
    f = primed()
    assert f.filter([make_sample(**{field: below})], 1.0) == []
    (out,) = f.filter([make_sample(**{field: at_threshold})], 2.0)
    assert out.reason is SampleReason.DELTA and getattr(out, field) == at_threshold


@pytest.mark.parametrize(
    "change",
    [
        {"healthy": False},
        {"xid_errors": (79,)},
        {"ecc_uncorrected": 1},
        {"mig_mode": True},
        {"processes": (GpuProcess(4107, 20 * 2**30), GpuProcess(9000, 0))},
        {"processes": (GpuProcess(5000, 20 * 2**30),)},
        {"power_w": None},
    ],
)
def test_any_change_of_state_fields_is_a_delta(change: dict[str, Any]) -> None:
    f = primed()
    (out,) = f.filter([make_sample(**change)], 1.0)
    assert out.reason is SampleReason.DELTA


def test_reordered_process_list_is_not_a_delta() -> None:
    procs = (GpuProcess(1, 10), GpuProcess(2, 10))
    f = primed(processes=procs)
    assert f.filter([make_sample(processes=procs[::-1])], 1.0) == []


def test_heartbeat_after_fifteen_seconds_of_quiet() -> None:
    f = primed()
    quiet = [f.filter([make_sample(sm_util_pct=41.0)], float(t)) for t in range(1, 15)]
    assert quiet == [[]] * 14
    (beat,) = f.filter([make_sample(sm_util_pct=41.0)], 15.0)
    assert beat.reason is SampleReason.HEARTBEAT and beat.sm_util_pct == 41.0
    assert f.filter([make_sample()], 16.0) == []  # compared with the heartbeat just sent
    (beat2,) = f.filter([make_sample()], 30.0)
    assert beat2.reason is SampleReason.HEARTBEAT


def test_drift_is_measured_from_the_last_published_sample() -> None:
    f = primed()
    assert f.filter([make_sample(sm_util_pct=43.0)], 1.0) == []
    assert f.filter([make_sample(sm_util_pct=46.0)], 2.0) != []  # 40 -> 46 adds up


def test_custom_thresholds_and_heartbeat() -> None:
    f = DeltaFilter(DeltaThresholds(util_pct=1.0), heartbeat_s=5.0)
    f.filter([make_sample()], 0.0)
    assert f.filter([make_sample(sm_util_pct=41.0)], 1.0)[0].reason is SampleReason.DELTA
    assert f.filter([make_sample(sm_util_pct=41.0)], 6.0)[0].reason is SampleReason.HEARTBEAT
    with pytest.raises(ValueError):
        DeltaFilter(heartbeat_s=0)


def test_forget_makes_the_next_sample_initial() -> None:
    f = primed()
    f.forget("GPU-sim-A-node-a1-0")
    assert f.filter([make_sample()], 1.0)[0].reason is SampleReason.INITIAL
    f.forget()
    assert f.filter([make_sample()], 2.0)[0].reason is SampleReason.INITIAL


def test_reason_is_replaced_field_for_field_like_dataclasses_replace() -> None:
    sample = make_sample(
        sm_util_pct=41.0,
        processes=(GpuProcess(7, 1),),
        xid_errors=(13,),
        nvlink_active_links=18,
        mig_mode=False,
    )
    for reason in SampleReason:
        assert _with_reason(sample, reason) == dataclasses.replace(sample, reason=reason)


_NUMERIC = {  # each field compared by threshold in probes.delta.moved, and that threshold
    "sm_util_pct": "util_pct",
    "mem_util_pct": "util_pct",
    "temperature_c": "temperature_c",
    "power_w": "power_w",
    "nvlink_tx_bytes_per_s": "link_bytes_per_s",
    "nvlink_rx_bytes_per_s": "link_bytes_per_s",
    "pcie_tx_bytes_per_s": "link_bytes_per_s",
    "pcie_rx_bytes_per_s": "link_bytes_per_s",
}


@pytest.mark.parametrize("field", sorted(_NUMERIC))
def test_every_numeric_field_by_its_own_threshold_and_a_null_either_way(field: str) -> None:
    th = DeltaThresholds()
    limit = getattr(th, _NUMERIC[field])
    base = make_sample(**{field: 10.0})
    for value, expected in ((10.0 + limit * 0.99, False), (10.0 - limit, True), (None, True)):
        assert moved(base, make_sample(**{field: value}), th) is expected, (field, value)
    empty = make_sample(**{field: None})
    assert moved(empty, base, th) and not moved(empty, make_sample(**{field: None}), th)


def test_every_sample_field_is_compared_or_left_out_on_purpose() -> None:
    """A field added to GpuSample needs a place in moved()'s tables (or in ``not_compared``)."""
    not_compared = {  # identity, the reason itself, and figures that follow compared ones
        "gpu_uuid", "node", "name", "reason", "gpu_class", "domain", "index",
        "memory_free_bytes", "memory_reserved_bytes",
    }  # fmt: skip
    compared = [*_EXACT, *(name for name, _ in _BY_THRESHOLD), "processes"]
    assert len(compared) == len(set(compared)) and not not_compared & set(compared)
    assert set(compared) | not_compared == {f.name for f in dataclasses.fields(GpuSample)}
    thresholds = {f.name for f in dataclasses.fields(DeltaThresholds)}
    assert {limit for _, limit in _BY_THRESHOLD} == thresholds

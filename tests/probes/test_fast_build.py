"""The agent's fast paths build and encode exactly what the plain ones do."""

from __future__ import annotations

import dataclasses

import pytest

from flexpipe import envelope
from flexpipe.errors import ValidationError
from flexpipe.schemas import GpuProcess, GpuSample, SampleReason, gpu_sample


def _fields() -> dict[str, object]:
    return {
        "gpu_uuid": "GPU-1",
        "node": "node-a1",
        "name": "NVIDIA H100 80GB HBM3",
        "reason": SampleReason.DELTA,
        "memory_total_bytes": 80 << 30,
        "memory_used_bytes": 10 << 30,
        "memory_free_bytes": 70 << 30,
        "sm_util_pct": 40.0,
        "xid_errors": (79,),
        "processes": (GpuProcess(7, 1 << 30),),
    }


def test_gpu_sample_is_a_frozen_gpu_sample_equal_to_the_plain_constructor() -> None:
    plain, fast = GpuSample(**_fields()), gpu_sample(**_fields())  # type: ignore[arg-type]
    assert type(fast) is GpuSample
    assert fast == plain and hash(fast) == hash(plain)
    assert dataclasses.astuple(fast) == dataclasses.astuple(plain)  # defaults filled alike
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast.reason = SampleReason.HEARTBEAT  # type: ignore[misc]
    positional = gpu_sample("GPU-1", "node-a1", "H100", SampleReason.DELTA, 1, 2, 3)
    assert positional.memory_free_bytes == 3 and positional.healthy is True
    with pytest.raises(TypeError):
        gpu_sample(gpu_uuid="GPU-1")  # type: ignore[call-arg]


def test_gpu_sample_round_trips_through_the_envelope() -> None:
    fast = gpu_sample(**_fields())  # type: ignore[arg-type]
    raw = envelope.payload_encoder(GpuSample)(fast, 5, "node-a1/nvml", 9)
    assert raw == envelope.encode(
        envelope.make(GpuSample(**_fields()), event_time_ms=5, source="node-a1/nvml", seq=9)  # type: ignore[arg-type]
    )
    back = envelope.decode(raw)
    assert back.payload == fast and back.seq == 9 and back.source == "node-a1/nvml"


def test_payload_encoder_refuses_an_unknown_payload_type() -> None:
    with pytest.raises(ValidationError):
        envelope.payload_encoder(object)


def test_payload_encoder_writes_other_kinds_as_encode_does() -> None:
    from flexpipe.schemas import ClusterEvent, ClusterEventType

    event = ClusterEvent(ClusterEventType.XID, "node-a1", ("GPU-1",), xid=79, detail="XID 79")
    raw = envelope.payload_encoder(ClusterEvent)(event, 1, "node-a1/nvml", 2)
    assert raw == envelope.encode(
        envelope.make(event, event_time_ms=1, source="node-a1/nvml", seq=2)
    )

"""Envelope round trips, and no input ever raises anything but the project's ValidationError."""

from __future__ import annotations

import contextlib
import json
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flexpipe import envelope
from flexpipe.errors import ValidationError
from flexpipe.schemas import GpuSample, Kind, SampleReason
from tests.flexpipe.strategies import envelopes

pytestmark = pytest.mark.unit


def make_sample(**overrides: Any) -> GpuSample:
    fields: dict[str, Any] = {
        "gpu_uuid": "GPU-1",
        "node": "n1",
        "name": "NVIDIA H100 80GB HBM3",
        "reason": SampleReason.DELTA,
        "memory_total_bytes": 80 << 30,
        "memory_used_bytes": 10 << 30,
        "memory_free_bytes": 70 << 30,
    }
    return GpuSample(**(fields | overrides))


def sample_doc() -> dict[str, Any]:
    env = envelope.make(make_sample(), event_time_ms=1, source="s", seq=1)
    doc: dict[str, Any] = orjson.loads(envelope.encode(env))
    return doc


@settings(max_examples=300)
@given(envelopes())
def test_round_trip_is_identity(env: envelope.Envelope[Any]) -> None:
    raw = envelope.encode(env)
    back = envelope.decode(raw)
    assert back == env
    assert envelope.encode(back) == raw


@settings(max_examples=300)
@given(st.binary(max_size=300))
def test_random_bytes_only_raise_validation_error(raw: bytes) -> None:
    with contextlib.suppress(ValidationError):
        envelope.decode(raw)


_ANY_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=12), inner),
    max_leaves=30,
)


@settings(max_examples=300)
@given(_ANY_JSON)
def test_random_json_only_raises_validation_error(doc: Any) -> None:
    # stdlib json: it writes integers of any size, as a hostile producer might.
    with pytest.raises(ValidationError):
        envelope.decode(json.dumps(doc).encode())


@settings(max_examples=300)
@given(envelopes(), st.data())
def test_mutated_envelopes_decode_or_raise_validation_error(
    env: envelope.Envelope[Any], data: st.DataObject
) -> None:
    doc = orjson.loads(envelope.encode(env))
    target = data.draw(st.sampled_from(["root", "payload"]))
    node = doc if target == "root" else doc["payload"]
    key = data.draw(st.sampled_from(sorted(node)))
    node[key] = data.draw(_ANY_JSON)
    try:
        envelope.decode(json.dumps(doc).encode())
    except ValidationError as exc:
        assert exc.field.split(".")[0] in {"", "kind", "v", target if target != "root" else key}


def test_unknown_version_names_the_field() -> None:
    doc = orjson.loads(
        envelope.encode(envelope.make(make_sample(), event_time_ms=1, source="s", seq=1))
    )
    doc["v"] = 2
    with pytest.raises(ValidationError) as err:
        envelope.decode(orjson.dumps(doc))
    assert err.value.field == "v"
    assert "unsupported schema version 2" in err.value.reason


def test_unknown_kind_names_the_field() -> None:
    doc = orjson.loads(
        envelope.encode(envelope.make(make_sample(), event_time_ms=1, source="s", seq=1))
    )
    doc["kind"] = "gpu.bogus"
    with pytest.raises(ValidationError) as err:
        envelope.decode(orjson.dumps(doc))
    assert err.value.field == "kind"
    assert "gpu.bogus" in err.value.reason


def test_bad_payload_field_is_named_with_its_path() -> None:
    doc = orjson.loads(
        envelope.encode(envelope.make(make_sample(), event_time_ms=1, source="s", seq=1))
    )
    doc["payload"]["processes"] = [{"pid": "seven"}]
    with pytest.raises(ValidationError) as err:
        envelope.decode(orjson.dumps(doc))
    assert err.value.field == "payload.processes.0.pid"


def test_strings_are_not_coerced_to_numbers() -> None:
    doc = orjson.loads(
        envelope.encode(envelope.make(make_sample(), event_time_ms=1, source="s", seq=1))
    )
    doc["payload"]["memory_free_bytes"] = "70"
    with pytest.raises(ValidationError, match="memory_free_bytes"):
        envelope.decode(orjson.dumps(doc))


def test_unknown_payload_field_is_rejected() -> None:
    doc = orjson.loads(
        envelope.encode(envelope.make(make_sample(), event_time_ms=1, source="s", seq=1))
    )
    doc["payload"]["surprise"] = 1
    with pytest.raises(ValidationError, match="surprise"):
        envelope.decode(orjson.dumps(doc))


def test_null_message_is_a_validation_error() -> None:
    with pytest.raises(ValidationError, match="empty message"):
        envelope.decode(None)


def test_kind_follows_payload_type() -> None:
    env = envelope.make(make_sample(), event_time_ms=5, source="s", seq=1)
    assert env.kind is Kind.GPU_SAMPLE
    assert env.event_time_s == 0.005

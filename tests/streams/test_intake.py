"""Admission: every kind of bad input gets a reason; good input passes."""

from __future__ import annotations

import base64

import orjson
import pytest

from flexpipe import envelope
from flexpipe.schemas import (
    ControlAction,
    ControlCommand,
    GearTransition,
    PhaseStatus,
    TransitionPhase,
)
from streams.intake import Accepted, DeadLetterReason, Rejected, SourceTopic, admit, dead_letter
from tests.streams.builders import T0_MS, make_load, make_sample, raw

pytestmark = pytest.mark.unit

R = DeadLetterReason
NOW_S = T0_MS / 1000


def verdict(topic: SourceTopic, key: bytes | None, value: bytes | None) -> Accepted | Rejected:
    return admit(topic, key, value, NOW_S, NOW_S, 300.0, frozenset({"chat"}))


def reason(topic: SourceTopic, key: bytes | None, value: bytes | None) -> R:
    v = verdict(topic, key, value)
    assert isinstance(v, Rejected), v
    return v.reason


def test_valid_sample_is_accepted() -> None:
    assert isinstance(verdict(SourceTopic.GPU, b"gpu-0", raw(make_sample())), Accepted)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, R.EMPTY),
        (b"", R.EMPTY),
        (b"\xff\xfe garbage", R.NOT_JSON),
        (b'{"v": 2, "kind": "gpu.sample"}', R.UNSUPPORTED_VERSION),
        (b'{"v": 1, "kind": "gpu.teleport"}', R.UNKNOWN_KIND),
        (
            raw(make_sample()).replace(
                b'"memory_total_bytes":', b'"memory_total_bytes":"x",' + b'"z":'
            ),
            R.INVALID_FIELD,
        ),
    ],
)
def test_malformed_values(value: bytes | None, expected: R) -> None:
    assert reason(SourceTopic.GPU, b"gpu-0", value) is expected


def test_wrong_topic_wrong_key_future_and_unknown_deployment() -> None:
    assert reason(SourceTopic.GPU, b"chat", raw(make_load())) is R.WRONG_TOPIC
    assert reason(SourceTopic.GPU, b"gpu-9", raw(make_sample())) is R.KEY_MISMATCH
    assert reason(SourceTopic.GPU, None, raw(make_sample())) is R.KEY_MISMATCH
    future = raw(make_sample(), t_ms=T0_MS + 3_600_000)
    assert reason(SourceTopic.GPU, b"gpu-0", future) is R.FUTURE_EVENT_TIME
    assert reason(SourceTopic.SERVING, b"other", raw(make_load("other"))) is R.UNKNOWN_DEPLOYMENT
    cmd = ControlCommand("other", ControlAction.PIN)
    assert reason(SourceTopic.CONTROL, b"other", raw(cmd)) is R.UNKNOWN_DEPLOYMENT


def test_transition_records_pass_under_the_runtimes_key_and_no_other() -> None:
    # The runtime keys each transition record deployment/seq (its compacted topic keeps each
    # transition's last record); refusing that key once left the live stream blind to every switch.
    record = GearTransition(
        deployment="chat",
        transition_seq=3,
        decision_id="d-3",
        phase=TransitionPhase.DONE,
        status=PhaseStatus.COMPLETED,
        from_plan_id="a",
        to_plan_id="b",
    )
    value = envelope.encode(envelope.make(record, event_time_ms=T0_MS, source="rt", seq=1))
    assert isinstance(verdict(SourceTopic.TRANSITIONS, b"chat/3", value), Accepted)
    assert isinstance(verdict(SourceTopic.TRANSITIONS, b"chat", value), Accepted)
    assert reason(SourceTopic.TRANSITIONS, b"chat/4", value) is R.KEY_MISMATCH
    assert reason(SourceTopic.TRANSITIONS, b"other/3", value) is R.KEY_MISMATCH


def test_dead_letter_record_keeps_the_original_bytes() -> None:
    rejected = Rejected(R.NOT_JSON, "", "bad")
    record = orjson.loads(
        dead_letter(
            rejected,
            topic="t",
            partition=2,
            offset=7,
            key=b"k",
            value=b"\x00\x01",
            worker="w",
            wall_ms=5,
        )
    )
    assert record["reason"] == "not_json" and record["offset"] == 7
    assert base64.b64decode(record["value_b64"]) == b"\x00\x01"

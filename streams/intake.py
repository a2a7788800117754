"""Admission of raw messages: decode, check they belong on their topic, or dead-letter them.

Pure: :func:`admit` turns (topic, key, value, wall clock) into an :class:`Accepted` envelope or a
:class:`Rejected` verdict with a machine-readable :class:`DeadLetterReason`; :func:`dead_letter`
renders a rejection as the JSON object the dead-letter topic carries. Nothing here raises on
input — a stream never stops on what it reads.
"""

from __future__ import annotations

import base64
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import orjson

from flexpipe import envelope
from flexpipe.envelope import Envelope
from flexpipe.errors import ValidationError
from flexpipe.schemas import Kind, NodeSamples

__all__ = [
    "Accepted",
    "DeadLetterReason",
    "Rejected",
    "SourceTopic",
    "admit",
    "dead_letter",
]

MAX_DETAIL_CHARS = 500


class DeadLetterReason(StrEnum):
    """Why a message went to the dead-letter topic."""

    EMPTY = "empty"  # null value (a tombstone) or zero bytes
    NOT_JSON = "not_json"  # not UTF-8 JSON at all
    UNSUPPORTED_VERSION = "unsupported_version"
    UNKNOWN_KIND = "unknown_kind"
    INVALID_FIELD = "invalid_field"  # a payload or envelope field failed validation
    WRONG_TOPIC = "wrong_topic"  # a valid event of a kind this topic does not carry
    KEY_MISMATCH = "key_mismatch"  # the message key is not the payload's entity
    FUTURE_EVENT_TIME = "future_event_time"  # would drag the stream clock into the future
    UNKNOWN_DEPLOYMENT = "unknown_deployment"  # names a deployment this stream does not run
    INTERNAL_ERROR = "internal_error"  # folding it raised: a bug, but the stream goes on


class SourceTopic(StrEnum):
    """Logical input topics and the one kind each carries."""

    GPU = "gpu"
    LAUNCHES = "launches"
    NODE = "node"  # NodeSamples: one node's GPU samples and launch counts per message
    SERVING = "serving"
    CLUSTER = "cluster"
    TRANSITIONS = "transitions"
    CONTROL = "control"


_KIND: dict[SourceTopic, Kind] = {
    SourceTopic.GPU: Kind.GPU_SAMPLE,
    SourceTopic.LAUNCHES: Kind.KERNEL_LAUNCHES,
    SourceTopic.NODE: Kind.NODE_SAMPLES,
    SourceTopic.SERVING: Kind.SERVING_LOAD,
    SourceTopic.CLUSTER: Kind.CLUSTER_EVENT,
    SourceTopic.TRANSITIONS: Kind.GEAR_TRANSITION,
    SourceTopic.CONTROL: Kind.CONTROL_COMMAND,
}

# The payload field the message key must equal (keys pin an entity to one partition, so a
# mis-keyed message would fold into state another worker owns).
_KEY_OF: dict[SourceTopic, Callable[[Any], str]] = {
    SourceTopic.GPU: lambda p: p.gpu_uuid,
    SourceTopic.LAUNCHES: lambda p: p.gpu_uuid,
    SourceTopic.NODE: lambda p: p.node,
    SourceTopic.SERVING: lambda p: p.deployment,
    SourceTopic.CLUSTER: lambda p: p.node,
    SourceTopic.TRANSITIONS: lambda p: p.deployment,
    SourceTopic.CONTROL: lambda p: p.deployment,
}


def _other_keys(topic: SourceTopic, env: Any) -> tuple[bytes, ...]:
    """Keys besides the entity's a topic's records may carry: ``deployment/seq`` on the
    transitions topic.

    NOTE: the runtime keys every transition record ``deployment/seq`` so the compacted topic keeps
    the last record of each transition, which its recovery reads. This check once refused that
    key for every resident deployment: the live stream folded no transition (each one left flight
    only after ``streams.transition_timeout_s``) while the offline replay, fed directly, did.
    """
    if topic is SourceTopic.TRANSITIONS:
        payload = env.payload
        return (f"{payload.deployment}/{payload.transition_seq}".encode(),)
    return ()


@dataclass(frozen=True, slots=True)
class Accepted:
    """A message that may be folded."""

    env: Envelope[Any]


@dataclass(frozen=True, slots=True)
class Rejected:
    """A message for the dead-letter topic."""

    reason: DeadLetterReason
    field: str
    detail: str


def _reason(exc: ValidationError) -> DeadLetterReason:
    if exc.field == "v":
        return DeadLetterReason.UNSUPPORTED_VERSION
    if exc.field == "kind":
        return DeadLetterReason.UNKNOWN_KIND
    if exc.field == "" and "empty message" in exc.reason:
        return DeadLetterReason.EMPTY
    if exc.field == "":
        return DeadLetterReason.NOT_JSON
    return DeadLetterReason.INVALID_FIELD


def admit(
    topic: SourceTopic,
    key: bytes | None,
    value: bytes | None,
    wall_now_s: float,
    clock_s: float,
    max_future_skew_s: float,
    deployments: frozenset[str] | None = None,
) -> Accepted | Rejected:
    """Decode and check one message from ``topic``.

    Event times more than ``max_future_skew_s`` past both the wall clock and the stream clock
    are refused: one bad timestamp would otherwise mark every GPU's heartbeat as timed out.
    ``deployments`` (when given) is the set of names deployment-keyed topics may carry.
    """
    if not value:
        return Rejected(DeadLetterReason.EMPTY, "", "empty message (tombstone or zero bytes)")
    try:
        env = envelope.decode(value)
    except ValidationError as exc:
        return Rejected(_reason(exc), exc.field, exc.reason[:MAX_DETAIL_CHARS])
    expected = _KIND[topic]
    if env.kind is not expected:
        return Rejected(
            DeadLetterReason.WRONG_TOPIC, "kind", f"{env.kind.value} on the {topic.value} topic"
        )
    entity = _KEY_OF[topic](env.payload)
    if key is None or (key != entity.encode() and key not in _other_keys(topic, env)):
        shown = "none" if key is None else repr(key[:80])
        return Rejected(DeadLetterReason.KEY_MISMATCH, "key", f"key {shown} != {entity[:80]!r}")
    if topic is SourceTopic.NODE:
        stray = _stray_item(env.payload)
        if stray is not None:
            detail = f"names a node other than {entity[:80]!r}"
            return Rejected(DeadLetterReason.INVALID_FIELD, stray, detail)
    horizon_s = max(wall_now_s, clock_s) + max_future_skew_s
    if env.event_time_s > horizon_s:
        return Rejected(
            DeadLetterReason.FUTURE_EVENT_TIME,
            "event_time_ms",
            f"{env.event_time_ms} is more than {max_future_skew_s:.0f} s ahead of the clocks",
        )
    if deployments is not None and topic in _DEPLOYMENT_TOPICS and entity not in deployments:
        return Rejected(
            DeadLetterReason.UNKNOWN_DEPLOYMENT, "payload.deployment", f"{entity[:80]!r}"
        )
    return Accepted(env)


def _stray_item(batch: NodeSamples) -> str | None:
    """The path of the first item of a node batch that names another node (it would fold into
    state keyed to another node's partition), or None."""
    for i, sample in enumerate(batch.samples):
        if sample.node != batch.node:
            return f"payload.samples.{i}.node"
    for i, launches in enumerate(batch.launches):
        if launches.node != batch.node:
            return f"payload.launches.{i}.node"
    return None


_DEPLOYMENT_TOPICS = frozenset({SourceTopic.SERVING, SourceTopic.TRANSITIONS, SourceTopic.CONTROL})


def dead_letter(
    rejected: Rejected,
    *,
    topic: str,
    partition: int,
    offset: int,
    key: bytes | None,
    value: bytes | None,
    worker: str,
    wall_ms: int,
) -> bytes:
    """The dead-letter record: reason, field, where the message came from and its bytes."""

    def b64(raw: bytes | None) -> str | None:
        return None if raw is None else base64.b64encode(raw).decode("ascii")

    return orjson.dumps(
        {
            "reason": rejected.reason.value,
            "field": rejected.field,
            "detail": rejected.detail,
            "topic": topic,
            "partition": partition,
            "offset": offset,
            "key_b64": b64(key),
            "value_b64": b64(value),
            "worker": worker,
            "dead_lettered_at_ms": wall_ms,
        }
    )

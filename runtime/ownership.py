"""Sequence-ownership records: the journal's keys and values, and the in-flight set they spell.

Pure (no Kafka, no clock), so the runtime host's recovery can use it; the topic I/O is in
:mod:`runtime.journal`. Key ``<deployment>/<request id>``; value an envelope of kind
``runtime.ownership`` (:class:`flexpipe.schemas.OwnershipRecord`); a tombstone when the sequence
finishes.
"""

from __future__ import annotations

from collections.abc import Iterable

from flexpipe import envelope
from flexpipe.errors import ValidationError
from flexpipe.schemas import Kind, OwnershipRecord
from runtime.types import OwnershipEvent, OwnershipKind, Request


def ownership_key(deployment: str, request_id: str) -> bytes:
    """The compaction key of one sequence."""
    return f"{deployment}/{request_id}".encode()


def encode_event(
    deployment: str, event: OwnershipEvent, *, source: str, seq: int, now_ms: int
) -> tuple[bytes, bytes | None]:
    """(key, value) for an ownership event; a finished sequence is a tombstone (value None)."""
    req = event.request
    key = ownership_key(deployment, req.request_id)
    if event.kind is OwnershipKind.FINISHED:
        return key, None
    record = OwnershipRecord(
        deployment,
        req.request_id,
        event.replica_id,
        req.prompt_tokens,
        req.max_output_tokens,
        req.arrival_s,
        req.kind,
        req.sim_output_tokens,
    )
    env = envelope.make(record, event_time_ms=now_ms, source=source, seq=seq)
    return key, envelope.encode(env)


def decode_record(raw: bytes) -> OwnershipRecord:
    """Validate a journal value; raises :class:`ValidationError` naming the field."""
    env = envelope.decode(raw)
    if env.kind is not Kind.RUNTIME_OWNERSHIP:
        raise ValidationError("kind", f"expected {Kind.RUNTIME_OWNERSHIP.value}, got {env.kind}")
    record: OwnershipRecord = env.payload
    return record


def _request(record: OwnershipRecord) -> Request:
    return Request(
        record.request_id,
        record.prompt_tokens,
        record.max_output_tokens,
        record.arrival_s,
        record.kind,
        record.sim_output_tokens,
    )


def unfinished(
    entries: Iterable[tuple[bytes | None, bytes | None]], deployment: str
) -> list[Request]:
    """Admitted-but-unfinished requests of ``deployment`` from (key, value) pairs in log order.

    The last value per key wins; a tombstone means finished. Malformed values are skipped
    (the journal is advisory per record; one bad record must not stop a recovery).
    """
    latest: dict[bytes, bytes | None] = {}
    prefix = f"{deployment}/".encode()
    for key, value in entries:
        if key is not None and key.startswith(prefix):
            latest[key] = value
    out = []
    for value in latest.values():
        if value is None:
            continue
        try:
            out.append(_request(decode_record(value)))
        except ValidationError:
            continue
    return sorted(out, key=lambda r: (r.arrival_s, r.request_id))

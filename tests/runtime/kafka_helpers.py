"""Helpers for runtime integration tests: publish to and read from the real broker."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from flexpipe import envelope
from flexpipe.config import FlexPipeConfig
from flexpipe.errors import ValidationError
from flexpipe.kafka import make_producer
from flexpipe.schemas import GearTransition
from flexpipe.topics import Topic, topic_name
from runtime.journal import ownership_topic, read_to_end
from runtime.ownership import unfinished
from runtime.types import Request


async def publish(cfg: FlexPipeConfig, topic: Topic, payload: Any, key: str) -> None:
    """Publish one envelope and wait for the broker's ack."""
    producer = make_producer(cfg)
    await producer.start()
    try:
        env = envelope.make(payload, event_time_ms=int(time.time() * 1000), source="test", seq=1)
        await producer.send_and_wait(topic_name(cfg, topic), envelope.encode(env), key=key.encode())
    finally:
        await producer.stop()


async def transitions(cfg: FlexPipeConfig, deployment: str) -> list[GearTransition]:
    """Every transition record of ``deployment``, in per-key log order."""
    out = []
    for _, value in await read_to_end(cfg, topic_name(cfg, Topic.TRANSITIONS)):
        try:
            payload = envelope.decode(value).payload
        except ValidationError:
            continue
        if isinstance(payload, GearTransition) and payload.deployment == deployment:
            out.append(payload)
    return sorted(out, key=lambda r: r.transition_seq)  # stable: per-seq order is kept


async def journal_unfinished(cfg: FlexPipeConfig, deployment: str) -> list[Request]:
    """Sequences the ownership journal holds as admitted and not finished."""
    return unfinished(await read_to_end(cfg, ownership_topic(cfg)), deployment)


async def wait_for(
    check: Callable[[], Awaitable[bool]] | Callable[[], bool],
    timeout_s: float,
    what: str,
    poll_s: float = 0.05,
) -> None:
    """Poll ``check`` until it holds; fail naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = check()
        if not isinstance(result, bool):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(poll_s)

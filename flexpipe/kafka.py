"""Thin Kafka adapter: client settings from config, the broker address, topic creation."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import TopicAlreadyExistsError, for_code
from aiokafka.partitioner import murmur2

from flexpipe.config import FlexPipeConfig
from flexpipe.errors import FlexPipeError
from flexpipe.kafka_local import LocalKafka
from flexpipe.topics import CATALOG, topic_name


class NoBrokerError(FlexPipeError):
    """No broker is configured and the local one is not running."""


def partition_for(key: str, num_partitions: int) -> int:
    """The partition Kafka's default partitioner (murmur2, as aiokafka and Java) picks."""
    return (murmur2(key.encode()) & 0x7FFFFFFF) % num_partitions


def bootstrap_servers(cfg: FlexPipeConfig) -> str:
    """The configured broker, else the running local one; a clear error otherwise."""
    if cfg.kafka.bootstrap_servers:
        return cfg.kafka.bootstrap_servers
    status = LocalKafka(cfg.local_kafka).status()
    if status.running and status.bootstrap:
        return status.bootstrap
    raise NoBrokerError(
        "no Kafka broker: run `flexpipe kafka up`, or set kafka.bootstrap_servers "
        "(env FLEXPIPE_KAFKA__BOOTSTRAP_SERVERS)"
    )


def with_bootstrap(cfg: FlexPipeConfig, address: str) -> FlexPipeConfig:
    """The same config, pointed at ``address``."""
    return cfg.model_copy(
        update={"kafka": cfg.kafka.model_copy(update={"bootstrap_servers": address})}
    )


def client_kwargs(cfg: FlexPipeConfig) -> dict[str, Any]:
    """Connection and security settings shared by producers, consumers and admin clients."""
    k = cfg.kafka
    out: dict[str, Any] = {
        "bootstrap_servers": bootstrap_servers(cfg),
        "client_id": k.client_id,
        "request_timeout_ms": k.request_timeout_ms,
        "security_protocol": k.security_protocol,
    }
    if k.security_protocol.startswith("SASL"):
        out |= {
            "sasl_mechanism": k.sasl_mechanism,
            "sasl_plain_username": k.sasl_username,
            "sasl_plain_password": k.sasl_password,
        }
    if k.security_protocol.endswith("SSL"):
        ctx = ssl.create_default_context(cafile=k.ssl_cafile)
        if k.ssl_certfile:
            ctx.load_cert_chain(k.ssl_certfile, k.ssl_keyfile)
        out["ssl_context"] = ctx
    return out


def make_producer(cfg: FlexPipeConfig, **overrides: Any) -> AIOKafkaProducer:
    """A durable producer: idempotent, acks from all in-sync replicas, compressed batches."""
    kwargs = client_kwargs(cfg) | {
        "enable_idempotence": True,
        "acks": "all",
        "compression_type": "lz4",
        "linger_ms": 5,
        "max_batch_size": 256 * 1024,
    }
    return AIOKafkaProducer(**(kwargs | overrides))


def make_consumer(cfg: FlexPipeConfig, *topics: str, **overrides: Any) -> AIOKafkaConsumer:
    """A consumer of the given (already prefixed) topics."""
    kwargs = client_kwargs(cfg) | {"auto_offset_reset": "earliest", "enable_auto_commit": False}
    return AIOKafkaConsumer(*topics, **(kwargs | overrides))


@asynccontextmanager
async def running(client: AIOKafkaConsumer | AIOKafkaProducer) -> AsyncIterator[None]:
    """Start a client for the block and always stop it."""
    await client.start()
    # NOTE: aiokafka 0.14 raises CancelledError from stop() when a consumer stops before its
    # coordinator task got to run; one trip through the loop avoids it.
    await asyncio.sleep(0)
    try:
        yield
    finally:
        await client.stop()


TOPIC_VISIBLE_S = 30.0  # how long a created topic may take to appear in the broker's metadata


def catalog_topics(cfg: FlexPipeConfig) -> list[NewTopic]:
    """The catalog's topics as this config lays them out."""
    return [
        NewTopic(
            name=topic_name(cfg, spec.topic),
            num_partitions=spec.partitions or cfg.topics.partitions,
            replication_factor=cfg.topics.replication_factor,
            topic_configs=spec.configs(),
        )
        for spec in CATALOG
    ]


async def create_topics(cfg: FlexPipeConfig, extra: Sequence[NewTopic] = ()) -> list[str]:
    """Create every catalog topic (and ``extra``) that does not exist yet and wait until the
    broker's metadata lists each with its partitions; return the names this call created.

    Idempotent also right after a creation: a topic the controller already has but the metadata
    does not list yet comes back as "already exists" and is not counted as created.
    """
    wanted = [*catalog_topics(cfg), *extra]
    admin = AIOKafkaAdminClient(**client_kwargs(cfg))
    await admin.start()
    try:
        existing = set(await admin.list_topics())
        missing = [t for t in wanted if t.name not in existing]
        created = await _create(admin, missing) if missing else []
        await wait_topics_visible(admin, {t.name: t.num_partitions for t in wanted})
        return created
    finally:
        await admin.close()


async def _create(admin: AIOKafkaAdminClient, topics: list[NewTopic]) -> list[str]:
    # NOTE: aiokafka returns per-topic error codes instead of raising them.
    response = await admin.create_topics(topics)
    created = []
    for name, code, *rest in response.topic_errors:
        if code == 0:
            created.append(name)
        elif code != TopicAlreadyExistsError.errno:  # another process won the race: fine
            error = for_code(code).__name__
            detail = f": {rest[0]}" if rest and rest[0] else ""
            raise FlexPipeError(f"cannot create topic {name}: {error}{detail}")
    return created


async def wait_topics_visible(
    admin: AIOKafkaAdminClient, partitions: Mapping[str, int], timeout_s: float = TOPIC_VISIBLE_S
) -> None:
    """Wait until the broker's metadata lists every topic with at least its partitions.

    Raises :class:`FlexPipeError` naming the topics still missing after ``timeout_s``.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    delay_s = 0.05
    while True:
        described = await admin.describe_topics(list(partitions))
        seen = {t["topic"]: len(t["partitions"]) for t in described if t["error_code"] == 0}
        missing = sorted(n for n, p in partitions.items() if seen.get(n, 0) < p)
        if not missing:
            return
        if loop.time() >= deadline:
            raise FlexPipeError(
                f"topics not visible in the broker's metadata after {timeout_s:.0f} s: "
                + ", ".join(missing)
            )
        await asyncio.sleep(delay_s)
        delay_s = min(1.0, delay_s * 2)


async def delete_topics_with_prefix(cfg: FlexPipeConfig, prefix: str) -> list[str]:
    """Delete every topic whose name starts with ``prefix`` (a run's own, e.g.
    ``up1764612345.``); return the names deleted."""
    if not prefix.strip("."):
        raise FlexPipeError(f"refusing to delete topics under the empty prefix {prefix!r}")
    admin = AIOKafkaAdminClient(**client_kwargs(cfg))
    await admin.start()
    try:
        names = sorted(t for t in await admin.list_topics() if t.startswith(prefix))
        if names:
            # NOTE: aiokafka returns per-topic error codes instead of raising them.
            response = await admin.delete_topics(names)
            codes = response.topic_error_codes
            failed = [f"{n}: {for_code(c).__name__}" for n, c, *_ in codes if c]
            if failed:
                raise FlexPipeError("cannot delete topics: " + ", ".join(failed))
            await _wait_topics_gone(admin, prefix)
        return names
    finally:
        await admin.close()


async def _wait_topics_gone(
    admin: AIOKafkaAdminClient, prefix: str, timeout_s: float = TOPIC_VISIBLE_S
) -> None:
    # NOTE: a deletion is acknowledged before every metadata view drops the topics
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    delay_s = 0.05
    while left := [t for t in await admin.list_topics() if t.startswith(prefix)]:
        if loop.time() >= deadline:
            raise FlexPipeError(
                f"topics still listed {timeout_s:.0f} s after their deletion: " + ", ".join(left)
            )
        await asyncio.sleep(delay_s)
        delay_s = min(1.0, delay_s * 2)

"""Thin Kafka adapter: client settings from config, the broker address, topic creation."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import TopicAlreadyExistsError

from flexpipe.config import FlexPipeConfig
from flexpipe.errors import FlexPipeError
from flexpipe.kafka_local import LocalKafka
from flexpipe.topics import CATALOG, topic_name


class NoBrokerError(FlexPipeError):
    """No broker is configured and the local one is not running."""


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


async def create_topics(cfg: FlexPipeConfig) -> list[str]:
    """Create every catalog topic that does not exist yet; return the names created."""
    admin = AIOKafkaAdminClient(**client_kwargs(cfg))
    await admin.start()
    try:
        existing = set(await admin.list_topics())
        wanted = [
            NewTopic(
                name=topic_name(cfg, spec.topic),
                num_partitions=spec.partitions or cfg.topics.partitions,
                replication_factor=cfg.topics.replication_factor,
                topic_configs=spec.configs(),
            )
            for spec in CATALOG
            if topic_name(cfg, spec.topic) not in existing
        ]
        created = []
        for topic in wanted:
            try:
                await admin.create_topics([topic])
                created.append(topic.name)
            except TopicAlreadyExistsError:
                pass  # another process won the race: that is the idempotent outcome
        return created
    finally:
        await admin.close()

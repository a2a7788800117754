"""Shared fixtures: the real Kafka broker (started once per session, stopped at the end)."""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator

import pytest

from flexpipe.config import FlexPipeConfig, load_config
from flexpipe.kafka_local import LocalKafka

BROKER_ENV = "FLEXPIPE_KAFKA__BOOTSTRAP_SERVERS"
# Each pytest session gets its own broker run dir, so parallel sessions never share or wipe one.
BROKER_NAME = os.environ.get("PYTEST_KAFKA_RUN_NAME", f"pytest-{os.getpid()}")


@pytest.fixture(scope="session")
def kafka_broker() -> Iterator[str]:
    """A real broker: the configured one, else a fresh local KRaft broker for this session."""
    configured = os.environ.get(BROKER_ENV)
    if configured:
        yield configured
        return
    local = LocalKafka(load_config(env={}).local_kafka, name=BROKER_NAME)
    bootstrap = local.up(fresh=True)
    try:
        yield bootstrap
    finally:
        local.down()
        shutil.rmtree(local.run_dir, ignore_errors=True)


@pytest.fixture(scope="session")
def local_kafka(kafka_broker: str) -> LocalKafka | None:
    """The session's LocalKafka manager when we started it (tests that stop/restart it need it)."""
    if os.environ.get(BROKER_ENV):
        return None
    return LocalKafka(load_config(env={}).local_kafka, name=BROKER_NAME)


@pytest.fixture
def kafka_cfg(kafka_broker: str) -> FlexPipeConfig:
    """Config pointing at the session broker, with a unique topic prefix so tests never collide."""
    prefix = f"t{uuid.uuid4().hex[:8]}."
    return load_config(
        env={
            BROKER_ENV: kafka_broker,
            "FLEXPIPE_TOPICS__PREFIX": prefix,
            "FLEXPIPE_TOPICS__PARTITIONS": "3",
        }
    )

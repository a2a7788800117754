"""The local broker manager: status, restart on the same port, and down stops only its own pid."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

from flexpipe.config import LocalKafkaConfig
from flexpipe.kafka_local import LocalKafka, broker_ready

pytestmark = pytest.mark.integration


def test_down_refuses_a_foreign_pid(tmp_path: Path) -> None:
    local = LocalKafka(LocalKafkaConfig(cache_dir=str(tmp_path)), name="foreign")
    local.run_dir.mkdir(parents=True)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        local.pid_file.write_text(str(other.pid))
        assert local.status().running is False
        assert local.down() is False
        assert other.poll() is None, "down() must not kill a process it did not start"
    finally:
        other.kill()
        other.wait()


def test_session_broker_restarts_on_same_port(local_kafka: LocalKafka | None) -> None:
    if local_kafka is None:
        pytest.skip("a user-configured broker is in use; not ours to restart")
    before = local_kafka.status()
    assert before.running and before.bootstrap
    assert local_kafka.log.read_text().count("Kafka Server started") >= 1
    assert local_kafka.down() is True
    assert local_kafka.status().running is False
    assert asyncio.run(broker_ready(before.bootstrap, timeout_s=1.0)) is False
    assert local_kafka.up() == before.bootstrap
    assert asyncio.run(broker_ready(before.bootstrap))

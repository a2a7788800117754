"""Shared benchmark plumbing: a broker to run against and the final JSON line."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from flexpipe.config import FlexPipeConfig, load_config
from flexpipe.kafka_local import LocalKafka


@contextmanager
def bench_broker(name: str) -> Iterator[FlexPipeConfig]:
    """The configured broker, else a fresh local one for this benchmark, stopped after."""
    cfg = load_config()
    if cfg.kafka.bootstrap_servers:
        yield cfg
        return
    local = LocalKafka(cfg.local_kafka, name=f"bench-{name}")
    address = local.up(fresh=True)
    try:
        yield cfg.model_copy(
            update={"kafka": cfg.kafka.model_copy(update={"bootstrap_servers": address})}
        )
    finally:
        local.down()


def print_result(result: dict[str, Any]) -> None:
    """The machine-readable last line every benchmark prints."""
    print(json.dumps(result, sort_keys=True))

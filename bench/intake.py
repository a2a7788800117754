"""The stream worker's own per-event CPU: intake, folds and table writes, without Faust or Kafka.

``python -m bench.intake`` feeds :meth:`streams.processor.StreamProcessor.on_message` the
telemetry ``python -m bench.pipeline`` sends (a 1,000-GPU cluster's
:class:`~flexpipe.schemas.NodeSamples`, one sample per five launch reports, event time moving
1/6 s per round) and runs its housekeeping (sweep + flush) every ``flush_interval_s`` of event
time, as the worker's timer does. Tables are in-memory dicts, so the figures are the product's
own code: what :mod:`bench.pipeline` cannot separate from faust and aiokafka. CPU time
(``time.process_time``), so the figures hold on a busy machine.

Printed: ``events_per_cpu_s`` (GPU samples + launch reports folded per CPU-second),
``table_writes_per_1000_events`` (each one a changelog message in a worker), and, measured in
the same run, ``baseline_decode_events_per_cpu_s`` (envelope decoding alone, the floor of any
intake that validates) and ``calibration_ms``. ``--profile`` adds cProfile's top lines. The last
line is the JSON result. No goal of its own: :mod:`bench.pipeline` holds the issue's targets.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import pstats
import sys
import time
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry

from bench.calibrate import calibration_ms
from bench.common import print_result
from bench.pipeline import GPUS_PER_NODE, Cluster
from bench.worker_profile import origin, top_functions
from flexpipe import envelope
from flexpipe.config import DeploymentConfig, FlexPipeConfig
from streams.decider import Decider
from streams.deployments import resolve_deployments
from streams.intake import SourceTopic
from streams.metrics import StreamsMetrics
from streams.ports import Message, TableName
from streams.processor import ProcessorTopics, StreamProcessor

ROUNDS_PER_S = 6  # one sample and five launch reports per GPU per second of event time
T0_MS = 1_767_225_600_000


class MemoryTables:
    """Tables as dicts, counting writes (each one a changelog message in a worker)."""

    def __init__(self) -> None:
        self.data: dict[TableName, dict[bytes, bytes]] = defaultdict(dict)
        self.writes = 0

    def get(self, table: TableName, key: bytes) -> bytes | None:
        """The stored value, or None."""
        return self.data[table].get(key)

    def set(self, table: TableName, key: bytes, value: bytes) -> None:
        """Store (and count the write)."""
        self.data[table][key] = value
        self.writes += 1

    def keys(self, table: TableName) -> Iterable[bytes]:
        """Keys held."""
        return self.data[table].keys()


class _NoLog:
    async def last(self, deployment: str) -> None:
        return None


async def _discard(topic: str, key: bytes | None, value: bytes, *, wait: bool) -> None:
    return None


def make_processor(num_deployments: int) -> tuple[StreamProcessor, MemoryTables]:
    """A processor over in-memory tables, configured as :mod:`bench.pipeline`'s worker."""
    deployments = tuple(
        DeploymentConfig(name=f"dep-{d}", model="llama-2-7b", block=f"nv-node-{d}", tp=2)
        for d in range(num_deployments)
    )
    cfg = FlexPipeConfig.model_validate({"deployments": [d.model_dump() for d in deployments]})
    catalog, resolved = resolve_deployments(cfg)
    tables = MemoryTables()
    engine = StreamProcessor(
        cfg,
        catalog=catalog,
        deployments=resolved,
        tables=tables,
        send=_discard,
        decisions=lambda p: Decider(p, _NoLog(), lambda name: True, cfg.gearbox),
        topics=ProcessorTopics("decisions", "deadletter", "triggers"),
        metrics=StreamsMetrics(CollectorRegistry()),
        worker="bench-intake",
        wall=lambda: T0_MS / 1000.0,
    )
    return engine, tables


def messages(num_gpus: int, rounds: int) -> list[tuple[int, Message]]:
    """(event time, message) of ``rounds`` rounds of node batches, as bench.pipeline sends."""
    cluster = Cluster(num_gpus)
    out = []
    offset = 0
    for r in range(rounds):
        t_ms = T0_MS + r * 1000 // ROUNDS_PER_S
        for first in range(0, num_gpus, GPUS_PER_NODE):
            _, key, value = cluster.node_batch(first, r % ROUNDS_PER_S != 0, t_ms)
            out.append((t_ms, Message("node", 0, offset, key, value)))
            offset += 1
    return out


async def fold_all(engine: StreamProcessor, batch: list[tuple[int, Message]]) -> None:
    """Fold every message; sweep and flush every ``flush_interval_s`` of event time."""
    every_ms = round(engine.cfg.streams.flush_interval_s * 1000)
    next_flush = batch[0][0] + every_ms if batch else 0
    for t_ms, msg in batch:
        if t_ms >= next_flush:
            engine.sweep()
            engine.flush()
            next_flush = t_ms + every_ms
        await engine.on_message(SourceTopic.NODE, msg)
    engine.flush()


def profile_lines(profile: cProfile.Profile, top: int = 20) -> list[str]:
    """cProfile's top functions by own CPU."""
    stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    total = sum(v[2] for v in stats.values()) or 1.0
    lines = ["profile (cProfile, process CPU; inflates call-heavy code), own time:"]
    return lines + top_functions(stats, total, origin, top)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Warm the caches with a first pass, then time the folds of ``--rounds`` more rounds."""
    engine, tables = make_processor(args.deployments)
    warm = messages(args.gpus, ROUNDS_PER_S)
    asyncio.run(fold_all(engine, warm))
    measured = messages(args.gpus, args.rounds + ROUNDS_PER_S)[len(warm) :]
    events = args.gpus * args.rounds
    writes0 = tables.writes
    profile = cProfile.Profile(time.process_time) if args.profile else None
    cpu0 = time.process_time()
    if profile is not None:
        profile.enable()
    asyncio.run(fold_all(engine, measured))
    if profile is not None:
        profile.disable()
    cpu_s = time.process_time() - cpu0
    writes = tables.writes - writes0
    cpu0 = time.process_time()
    for _, msg in measured:
        envelope.decode(msg.value)
    decode_s = time.process_time() - cpu0
    if profile is not None:
        print("\n".join(profile_lines(profile)), file=sys.stderr)
    return {
        "events_per_cpu_s": round(events / cpu_s),
        "cpu_us_per_event": round(cpu_s / events * 1e6, 2),
        "table_writes_per_1000_events": round(writes * 1000 / events, 1),
        "baseline_decode_events_per_cpu_s": round(events / decode_s),
        "events": events,
        "messages": len(measured),
        "gpus": args.gpus,
        "profiled": bool(args.profile),
        "calibration_ms": calibration_ms(),
    }


def main() -> int:
    """Entry point of ``python -m bench.intake``."""
    parser = argparse.ArgumentParser(prog="python -m bench.intake", description=__doc__)
    parser.add_argument("--gpus", type=int, default=1000)
    parser.add_argument("--deployments", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=60, help="rounds of every GPU (1/6 s)")
    parser.add_argument("--profile", action="store_true", help="print cProfile's top lines")
    print_result(run(parser.parse_args()))
    return 0


if __name__ == "__main__":
    sys.exit(main())

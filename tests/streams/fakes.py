"""Fakes for the engine's ports: dict tables, a recording sender, a log read from it."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry

from flexpipe import envelope
from flexpipe.schemas import GearDecision
from streams import codec
from streams.catalog import Catalog
from streams.decider import Decider
from streams.deployments import Deployment
from streams.metrics import StreamsMetrics
from streams.ports import TableName
from streams.processor import ProcessorTopics, StreamProcessor
from streams.state import GpuState, NodeState
from streams.step import LoggedDecision

TOPICS = ProcessorTopics("decisions", "deadletter", "triggers")


@dataclass
class FakeTables:
    """Tables as dicts; ``writes`` counts sets per table."""

    data: dict[TableName, dict[bytes, bytes]] = field(default_factory=lambda: defaultdict(dict))
    writes: dict[TableName, int] = field(default_factory=lambda: defaultdict(int))

    def get(self, table: TableName, key: bytes) -> bytes | None:
        return self.data[table].get(key)

    def set(self, table: TableName, key: bytes, value: bytes) -> None:
        self.data[table][key] = value
        self.writes[table] += 1

    def keys(self, table: TableName) -> Iterable[bytes]:
        return list(self.data[table])


@dataclass
class FakeBroker:
    """Every sent message per topic, in order; ``fail_next`` makes the next acked send raise."""

    sent: dict[str, list[tuple[bytes | None, bytes]]] = field(
        default_factory=lambda: defaultdict(list)
    )
    fail_next: bool = False

    async def __call__(self, topic: str, key: bytes | None, value: bytes, *, wait: bool) -> None:
        if wait and self.fail_next:
            self.fail_next = False
            raise ConnectionError("broker went away")
        self.sent[topic].append((key, value))

    def decisions(self) -> list[GearDecision]:
        out = []
        for _, value in self.sent[TOPICS.decisions]:
            payload = envelope.decode(value).payload
            assert isinstance(payload, GearDecision)
            out.append(payload)
        return out


@dataclass
class FakeLog:
    """The decisions topic of a FakeBroker, read back."""

    broker: FakeBroker
    reads: int = 0

    async def last(self, deployment: str) -> LoggedDecision | None:
        self.reads += 1
        found = None
        for key, value in self.broker.sent[TOPICS.decisions]:
            if key == deployment.encode():
                env = envelope.decode(value)
                found = LoggedDecision(env.event_time_ms, env.payload)
        return found


def make_engine(
    cfg: object,
    catalog: Catalog,
    deployments: tuple[Deployment, ...],
    *,
    tables: FakeTables | None = None,
    broker: FakeBroker | None = None,
    wall: list[float] | None = None,
    owned: set[str] | None = None,
) -> tuple[StreamProcessor, FakeTables, FakeBroker]:
    """An engine over fakes; ``wall[0]`` is the wall clock, ``owned`` the deployments owned."""
    tables = tables or FakeTables()
    broker = broker or FakeBroker()
    clock = wall if wall is not None else [0.0]
    mine = owned if owned is not None else {d.name for d in deployments}
    engine = StreamProcessor(
        cfg,  # type: ignore[arg-type]
        catalog=catalog,
        deployments=deployments,
        tables=tables,
        send=broker,
        decisions=lambda p: Decider(p, FakeLog(broker), lambda name: name in mine),
        topics=TOPICS,
        metrics=StreamsMetrics(CollectorRegistry()),
        worker="test",
        wall=lambda: clock[0],
    )
    # NOTE: what the view reader does in a worker: read the GPU and node changelogs in full.
    for value in tables.data[TableName.GPUS].values():
        engine.view.apply_gpu(codec.loads(GpuState, value))
    for value in tables.data[TableName.NODES].values():
        engine.view.apply_node(codec.loads(NodeState, value))
    engine.view_caught_up = True
    return engine, tables, broker

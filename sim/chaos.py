"""`flexpipe up --chaos`: the run's own failures, planned, and when each one recovered.

Two faults, one after the other, on the run's simulated clock:

1. the stream worker is killed with SIGKILL at ``kill_at_s`` and a new one started at once; it
   has recovered when it owns every triggers partition again;
2. the broker is killed (SIGKILL: it goes mid-shift, not after a graceful hand-off) as soon as a
   runtime starts a shift after the worker's recovery — or at ``broker_by_s`` when none does —
   and started again ``broker_down_s`` wall seconds later, on the same port and data; it has
   recovered when every partition of the run's topics has a leader again.

Each fault becomes an :class:`sim.summary.Outage` in simulated seconds, from the fault to
the recovery, so the invariants measure answers from recovery. ``broker_planned`` is set while
the broker is meant to be away: the broker watchdog of `up` does not count that as a failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError

from flexpipe.config import FlexPipeConfig
from flexpipe.errors import FlexPipeError
from flexpipe.kafka import client_kwargs
from flexpipe.kafka_local import LocalKafka
from sim.streamproc import StreamWorker
from sim.summary import Outage

__all__ = ["BROKER_DOWN_S", "Chaos", "ChaosPlan", "chaos_plan", "shift_in_progress"]

BROKER_DOWN_S = 10.0  # wall seconds the broker stays down
KILL_AT = 0.25  # the worker is killed at this share of the run …
BROKER_BY = 0.75  # … and the broker stopped by this share at the latest
POLL_S = 0.05  # wall seconds between looks at the runtime's transitions
BROKER_GONE_S = 10.0  # wall seconds a killed broker may take to exit
LEADERS_S = 60.0  # wall seconds a restarted broker may take to lead its partitions again
QUIET_AFTER_S = 10.0  # wall seconds the clients' reconnect noise is muted after the restart


@dataclass(frozen=True, slots=True)
class ChaosPlan:
    """When the faults happen (simulated seconds) and how long the broker stays down (wall)."""

    kill_at_s: float  # SIGKILL the stream worker at this simulated time
    broker_by_s: float  # stop the broker by then even when no shift started
    broker_down_s: float = BROKER_DOWN_S


def chaos_plan(duration_s: float) -> ChaosPlan:
    """The default plan for a run of ``duration_s`` simulated seconds."""
    return ChaosPlan(kill_at_s=KILL_AT * duration_s, broker_by_s=BROKER_BY * duration_s)


def shift_in_progress(worker: Any) -> str | None:
    """A runtime's transition after the starting plan, as ``deployment #seq phase``; or None."""
    for dep, rt in worker.runtimes.items():
        a = rt.state.active
        if a is not None and a.seq > 0:
            return f"{dep} #{a.seq} {a.phase}"
    return None


async def wait_partitions_led(cfg: FlexPipeConfig, timeout_s: float = LEADERS_S) -> None:
    """Wait until every partition of the run's topics has a leader again: a restarted broker
    answers metadata requests before it leads its partitions (log recovery)."""
    admin = AIOKafkaAdminClient(**client_kwargs(cfg))
    deadline = time.monotonic() + timeout_s
    try:
        await admin.start()
        while time.monotonic() < deadline:
            try:
                names = [t for t in await admin.list_topics() if t.startswith(cfg.topics.prefix)]
                described = await admin.describe_topics(names)
            except KafkaError:
                described = None
            if described is not None and all(
                t["error_code"] == 0 and all(p["leader"] >= 0 for p in t["partitions"])
                for t in described
            ):
                return
            await asyncio.sleep(POLL_S * 4)
        raise FlexPipeError(f"chaos: the restarted broker led no partitions after {timeout_s} s")
    finally:
        with contextlib.suppress(Exception):
            await admin.close()


class Chaos:
    """Carries out a :class:`ChaosPlan` against a run's worker, broker and runtime."""

    def __init__(
        self,
        plan: ChaosPlan,
        streams: StreamWorker,
        local: LocalKafka,
        runtime: Any,
        clock: Callable[[], float],
        cfg: FlexPipeConfig,
    ) -> None:
        self.cfg = cfg
        self.plan = plan
        self.streams = streams
        self.local = local
        self.runtime = runtime
        self.clock = clock  # the run's simulated clock
        self.outages: list[Outage] = []
        self.broker_planned = asyncio.Event()
        self.busy = False  # a fault is under way: the run must not end in the middle of it

    async def run(self) -> None:
        """Both faults, in order; returns once the broker is back."""
        await self._until(lambda: self.clock() >= self.plan.kill_at_s)
        await self.kill_worker()
        await self._until(
            lambda: (
                shift_in_progress(self.runtime) is not None or self.clock() >= self.plan.broker_by_s
            )
        )
        await self.stop_broker()

    async def settle(self, task: asyncio.Task[None]) -> None:
        """At the end of the run: let a fault under way recover; drop the ones not begun."""
        if self.busy:
            await task
        else:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def kill_worker(self) -> None:
        """SIGKILL the stream worker, start another, and wait until it owns its partitions."""
        start_s, pid = self.clock(), self.streams.pid
        print(f"chaos: SIGKILL the stream worker (pid {pid})", flush=True)
        self.busy = True
        try:
            await self.streams.kill_and_restart()
        finally:
            self.busy = False
        end_s = self.clock()
        detail = f"pid {pid} killed, pid {self.streams.pid} owns its partitions"
        self.outages.append(Outage("stream_worker_killed", start_s, end_s, detail))
        print(f"chaos: the stream worker is back after {end_s - start_s:.0f} simulated s")

    async def stop_broker(self) -> None:
        """Kill the broker, wait ``broker_down_s`` wall seconds, start it again."""
        during = shift_in_progress(self.runtime)
        where = f"during {during}" if during else "no shift was in progress"
        start_s = self.clock()
        self.broker_planned.set()
        self.busy = True
        # NOTE: every Kafka client here retries and logs each failed connect; chaos says once.
        quiet = [logging.getLogger(n) for n in ("aiokafka", "probes.publisher", "runtime.worker")]
        levels = [q.level for q in quiet]
        for q in quiet:
            q.setLevel(logging.CRITICAL)
        try:
            await asyncio.to_thread(self._kill_broker)
            print(f"chaos: broker killed ({where}); back in {self.plan.broker_down_s:.0f} s")
            await asyncio.sleep(self.plan.broker_down_s)  # NOTE: the outage itself
            await asyncio.to_thread(self.local.up)
            await wait_partitions_led(self.cfg)
        finally:
            self.broker_planned.clear()
            self.busy = False
            loop = asyncio.get_running_loop()
            for q, level in zip(quiet, levels, strict=True):
                loop.call_later(QUIET_AFTER_S, q.setLevel, level)
        end_s = self.clock()
        detail = f"killed {where}, {self.plan.broker_down_s:.0f} wall s down"
        self.outages.append(Outage("broker_stopped", start_s, end_s, detail))
        print(f"chaos: the broker is back after {end_s - start_s:.0f} simulated s", flush=True)

    def _kill_broker(self) -> None:
        pid = self.local.status().pid
        if pid is None:
            raise FlexPipeError("chaos: the local broker is not running")
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + BROKER_GONE_S
        while self.local.status().running:
            if time.monotonic() > deadline:
                raise FlexPipeError(f"chaos: the broker (pid {pid}) outlived SIGKILL")
            time.sleep(POLL_S)

    @staticmethod
    async def _until(ready: Callable[[], bool]) -> None:
        while not ready():
            await asyncio.sleep(POLL_S)

"""The stream worker of `flexpipe up` as a child process: start, readiness, failed ticks, restart.

The faust worker runs as its own process, as in a cluster (log ``out/streams.log``, appended by
every start). :class:`StreamWorker` starts it, waits until it owns every triggers partition,
watches that it stays up (a planned kill is not a failure), and counts its failed decision runs
from its Prometheus counter ``flexpipe_streams_tick_failures_total`` (scraped while it runs, and
once more before each stop), with its log as the fallback.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError

from flexpipe.config import FlexPipeConfig
from flexpipe.errors import FlexPipeError
from flexpipe.kafka import client_kwargs

__all__ = [
    "TICK_FAILURES",
    "StaleAssignment",
    "StreamWorker",
    "assigned_partitions",
    "config_env",
    "free_port",
    "metric_total",
    "stop_process",
    "tick_failures_in_log",
]

TICK_FAILURES = "flexpipe_streams_tick_failures_total"
GROUP_DEADLINE_S = 90.0  # wall seconds for the stream worker to join its consumer group
STALE_ASSIGNMENT_S = 5.0  # wall seconds a stable group may lack partitions before a restart
STREAMS_STARTS = 3  # stream-worker starts before `up` gives up
SCRAPE_EVERY_S = 2.0  # wall seconds between scrapes of the worker's metrics
SCRAPE_TIMEOUT_S = 2.0


def config_env(cfg: FlexPipeConfig, config_path: Path | None = None) -> dict[str, str]:
    """Environment overrides that give a child process the same config; the sections that do
    not fit in variables (deployments, catalog, gearbox) come from ``config_path``, the run's
    config file (:func:`sim.catalog.write_config`)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEXPIPE_")}
    if config_path is not None:
        env["FLEXPIPE_CONFIG"] = str(config_path)
    s = cfg.streams
    flat = {
        "KAFKA__BOOTSTRAP_SERVERS": cfg.kafka.bootstrap_servers or "",
        "TOPICS__PREFIX": cfg.topics.prefix,
        "TOPICS__PARTITIONS": str(cfg.topics.partitions),
        "INTERVALS__DECISION_S": str(cfg.intervals.decision_s),
        "STREAMS__LOGLEVEL": s.loglevel,
        "STREAMS__METRICS_PORT": str(s.metrics_port),
        "STREAMS__SESSION_TIMEOUT_S": str(s.session_timeout_s),
    }
    return env | {f"FLEXPIPE_{k}": v for k, v in flat.items()}


def free_port() -> int:
    """A TCP port free on loopback right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class StaleAssignment(FlexPipeError):
    """The stream worker joined its group without the partitions it decides on."""


def assigned_partitions(group: Any, topic: str, skip: frozenset[str] = frozenset()) -> set[int]:
    """Partitions of ``topic`` the members of a described consumer group hold (members whose id
    is in ``skip`` — a killed worker not yet evicted — do not count)."""
    from aiokafka.coordinator.protocol import ConsumerProtocolMemberAssignment

    out: set[int] = set()
    for member in group[5]:
        raw = member[-1]  # member_assignment is the last field in every protocol version
        if raw and member[0] not in skip:
            for name, partitions in ConsumerProtocolMemberAssignment.decode(raw).assignment:
                if name == topic:
                    out.update(partitions)
    return out


def stop_process(proc: subprocess.Popen[bytes], timeout_s: float = 20.0) -> None:
    """SIGTERM, then SIGKILL if it lingers."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class StreamWorker:
    """The faust worker subprocess of one `up` run (see the module docstring)."""

    def __init__(self, cfg: FlexPipeConfig, out_dir: Path, config_path: Path | None = None) -> None:
        self.cfg = cfg
        self.out_dir = out_dir
        self.config_path = config_path  # the run's config file (deployments, catalog, gearbox)
        self.log_path = out_dir / "streams.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self.planned_exit = False  # a planned kill: the watchdog must not report it
        self._members: frozenset[str] = frozenset()  # the current worker's group member ids
        self._counted = 0.0  # failed ticks of the workers already stopped
        self._current: float | None = None  # the running worker's counter at the last scrape
        self._unscraped = False  # some stopped worker's counter was never read

    @property
    def pid(self) -> int | None:
        """The running worker's pid."""
        return self.proc.pid if self.proc is not None else None

    def died(self) -> FlexPipeError:
        """The error for a worker that exited on its own."""
        code = self.proc.returncode if self.proc is not None else None
        return FlexPipeError(f"the stream worker exited with code {code}; see {self.log_path}")

    def _spawn(self) -> subprocess.Popen[bytes]:
        # NOTE: faust writes its data directory into the working directory: out_dir.
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.starts += 1
        with open(self.log_path, "ab") as log:
            log.write(f"==== up: stream worker start {self.starts}\n".encode())
            log.flush()
            return subprocess.Popen(
                [sys.executable, "-m", "flexpipe.cli", "streams", "worker", "--worker-id", "up"],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=config_env(self.cfg, self.config_path),
                cwd=self.out_dir,
                start_new_session=True,
            )

    async def launch(self) -> None:
        """Start the worker and wait until it owns its partitions; restart it (up to
        ``STREAMS_STARTS`` times in all) when it joined on stale topic metadata."""
        skip = self._members
        for attempt in range(1, STREAMS_STARTS + 1):
            self.proc = self._spawn()
            self._current = None
            try:
                self._members = await self._wait_group_stable(skip)
                return
            except StaleAssignment:
                await self._retire()
                if attempt == STREAMS_STARTS:
                    raise
                print("up: the stream worker joined before its topics were visible; restarting it")
            except BaseException:
                await self._retire()
                raise
        raise AssertionError("unreachable")

    async def _retire(self) -> None:
        """Stop a worker that will not serve this run, its failed ticks counted first."""
        await self.scrape()
        if self.proc is not None:
            await asyncio.to_thread(stop_process, self.proc)
        self._stop_counting()

    async def _wait_group_stable(self, skip: frozenset[str]) -> frozenset[str]:
        """Wait until the group is stable with every triggers partition held by members not in
        ``skip``; return the member ids holding them.

        NOTE: a worker that joins while freshly created topics are missing from the broker's
        metadata (a loaded machine) is assigned none of them and never decides; faust does not
        rebalance when they appear, so that is reported as :class:`StaleAssignment`.
        """
        from streams.app import app_id, triggers_topic

        admin = AIOKafkaAdminClient(**client_kwargs(self.cfg))
        await admin.start()
        wanted = set(range(self.cfg.topics.partitions))
        try:
            deadline = time.monotonic() + GROUP_DEADLINE_S
            stable_since: float | None = None
            while time.monotonic() < deadline:
                if self.proc is None or self.proc.poll() is not None:
                    raise self.died()
                try:
                    resp = await admin.describe_consumer_groups([app_id(self.cfg)])
                except KafkaError:  # the group coordinator appears a moment after the first join
                    resp = []
                groups = resp[0].groups if resp else []
                if groups and groups[0][2] == "Stable":
                    members = frozenset(m[0] for m in groups[0][5]) - skip
                    if (
                        members
                        and assigned_partitions(groups[0], triggers_topic(self.cfg), skip) >= wanted
                    ):
                        return members
                    if members:
                        stable_since = stable_since or time.monotonic()
                    if stable_since and time.monotonic() - stable_since > STALE_ASSIGNMENT_S:
                        raise StaleAssignment(
                            "the stream worker was assigned no triggers partition;"
                            f" see {self.log_path}"
                        )
                await asyncio.sleep(0.5)
            raise FlexPipeError(
                f"the stream worker did not join its consumer group within"
                f" {GROUP_DEADLINE_S:.0f} s; see {self.log_path}"
            )
        finally:
            await admin.close()

    async def watch(self) -> None:
        """Raise once the worker exits unplanned: it must outlive the run."""
        while True:
            proc = self.proc
            if proc is not None and proc.poll() is not None and not self.planned_exit:
                raise self.died()
            await asyncio.sleep(0.5)

    async def kill_and_restart(self) -> None:
        """SIGKILL the worker (its counter read first) and start a new one; returns once the
        new worker owns every triggers partition."""
        assert self.proc is not None, "worker not started"
        await self.scrape()
        self.planned_exit = True
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # NOTE: its own session: the whole group
            await asyncio.to_thread(self.proc.wait)
            self._stop_counting()
            await self.launch()
        finally:
            self.planned_exit = False

    def stop(self) -> None:
        """Stop the worker (SIGTERM, then SIGKILL)."""
        if self.proc is not None:
            self.planned_exit = True
            stop_process(self.proc)

    # ---- failed ticks ------------------------------------------------------------------------

    async def scrape(self) -> float | None:
        """Read the running worker's failed-tick counter (None when it does not answer)."""
        port = self.cfg.streams.metrics_port
        if not port or self.proc is None or self.proc.poll() is not None:
            return None
        url = f"http://127.0.0.1:{port}/metrics"
        try:
            text = await asyncio.to_thread(_get, url)
        except OSError:
            return None
        value = metric_total(text, TICK_FAILURES)
        self._current = value if value is not None else 0.0  # NOTE: no sample yet: none failed
        return self._current

    async def scrape_loop(self) -> None:
        """Keep the counter fresh while the run lasts (a killed worker's last value counts)."""
        while True:
            await self.scrape()
            await asyncio.sleep(SCRAPE_EVERY_S)

    def _stop_counting(self) -> None:
        if self._current is None:
            self._unscraped = True
        else:
            self._counted += self._current
        self._current = None

    async def failed_ticks(self) -> tuple[int | None, str]:
        """Failed decision runs of every worker of this run, and where the figure comes from:
        the metric, or the log when some worker's metric was never read."""
        await self.scrape()
        metric = self._counted + (self._current or 0.0)
        unscraped = self._unscraped or self._current is None
        if not unscraped:
            return int(metric), "metric"
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return None, "none"
        return max(int(metric), tick_failures_in_log(text)), "log"


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=SCRAPE_TIMEOUT_S) as resp:
        body: bytes = resp.read()
        return body.decode()


async def cancel_quietly(task: asyncio.Task[Any]) -> None:
    """Cancel a helper task and wait for it."""
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task


# ---- the stream worker's failed ticks, from its exposition or its log -------------------------

_FIRST = re.compile(r"\b(\w+) failed \(first time")
_AGAIN = re.compile(r"\b(\w+) failed again: (.*) \((\d+) times")
_LEGACY = re.compile(r"\b(tick|trigger batch) failed\s*$")


def tick_failures_in_log(text: str) -> int:
    """Failed decision runs a stream worker's log shows (a lower bound: repeats of one error
    are logged at 10, 100, 1000 …; the metric counts each).

    NOTE: every distinct error is logged whole once ("tick failed (first time …)") and then as
    "tick failed again: KEY (N times, …)"; older workers logged "tick failed" each time.
    """
    firsts = 0
    repeats: dict[str, int] = {}
    legacy = 0
    for line in text.splitlines():
        if _FIRST.search(line):
            firsts += 1
        elif m := _AGAIN.search(line):
            key = f"{m.group(1)} {m.group(2)}"
            repeats[key] = max(repeats.get(key, 0), int(m.group(3)) - 1)
        elif _LEGACY.search(line):
            legacy += 1
    return firsts + sum(repeats.values()) + legacy


def metric_total(text: str, name: str) -> float | None:
    """The sum of every sample of ``name`` in a Prometheus text exposition; None if absent."""
    total: float | None = None
    for line in text.splitlines():
        if line.startswith(name) and line[len(name) : len(name) + 1] in ("{", " "):
            value = float(line.rsplit(" ", 1)[1])
            if not math.isnan(value):
                total = (total or 0.0) + value
    return total

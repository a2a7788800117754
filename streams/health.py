"""Whether a stream worker can do its job: its topics are writable, and its decisions succeed.

Two guards, both loud: a worker whose producer cannot see a topic it writes does not process a
single event until it can (it names the topic while it waits, and gives up after a bounded wait);
a worker whose decision path keeps failing counts every failure, logs each distinct error once
with its count, and stops after a bounded run of consecutive failures so its supervisor
restarts it.
"""

from __future__ import annotations

import asyncio
import logging
import traceback
from collections.abc import Iterable, Mapping, Set
from dataclasses import dataclass, field
from typing import Any

from aiokafka import AIOKafkaProducer

from flexpipe.errors import FlexPipeError

__all__ = [
    "FailureLog",
    "FailureVerdict",
    "InputWatch",
    "NotReadyError",
    "stalled_inputs",
    "wait_writable",
]

log = logging.getLogger(__name__)
MAX_BACKOFF_S = 5.0


class NotReadyError(FlexPipeError):
    """A topic the worker needs stayed missing from its producer's metadata."""


def _missing(producer: AIOKafkaProducer, partitions: Mapping[str, int]) -> list[str]:
    cluster = producer.client.cluster
    return sorted(
        t for t, n in partitions.items() if len(cluster.partitions_for_topic(t) or ()) < n
    )


async def wait_writable(
    producer: AIOKafkaProducer, partitions: Mapping[str, int], timeout_s: float
) -> None:
    """Wait until ``producer``'s metadata lists every topic with at least its partitions.

    NOTE: faust partitions table writes eagerly through the producer's cached metadata, without
    waiting for it; a changelog topic missing there fails every write (aiokafka's partitioner
    gets ``None`` partitions). Raises :class:`NotReadyError` naming the topics after
    ``timeout_s``.
    """
    client = producer.client
    for topic in partitions:
        client.add_topic(topic)  # tracked from now on: every metadata refresh includes it
    loop = asyncio.get_running_loop()
    start = loop.time()
    delay_s = 0.1
    while missing := _missing(producer, partitions):
        waited_s = loop.time() - start
        if waited_s >= timeout_s:
            raise NotReadyError(
                f"not ready after {timeout_s:.0f} s: missing from the producer's metadata: "
                + ", ".join(missing)
            )
        if waited_s >= 1.0:  # NOTE: a fresh producer needs one refresh for topics it just added
            log.warning(
                "not ready (%.1f s): missing from the producer's metadata: %s; retrying in %.1f s",
                waited_s,
                ", ".join(missing),
                delay_s,
            )
        await client.force_metadata_update()
        if _missing(producer, partitions):
            await asyncio.sleep(delay_s)
            delay_s = min(MAX_BACKOFF_S, delay_s * 2)


@dataclass(frozen=True, slots=True)
class FailureVerdict:
    """What to do about one failure."""

    first: bool  # the first time this error was seen: log it whole, with its traceback
    count: int  # how often this error was seen in all
    consecutive: int  # failures in a row, this one included
    fatal: bool  # the bound of consecutive failures is reached: stop the worker


@dataclass(slots=True)
class FailureLog:
    """Counts failures of a periodic job by distinct error, and runs of consecutive ones."""

    max_consecutive: int
    counts: dict[str, int] = field(default_factory=dict)
    consecutive: int = 0
    exhausted: bool = False  # the bound was reached once: the worker is stopping

    @staticmethod
    def key(exc: BaseException) -> str:
        """An error's identity: its type, message and the frame that raised it."""
        frames = traceback.extract_tb(exc.__traceback__)
        where = f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
        return f"{type(exc).__name__}: {str(exc)[:200]}{where}"

    def failed(self, exc: BaseException) -> FailureVerdict:
        """Record one failure."""
        k = self.key(exc)
        count = self.counts.get(k, 0) + 1
        self.counts[k] = count
        self.consecutive += 1
        fatal = self.consecutive >= self.max_consecutive
        return FailureVerdict(count == 1, count, self.consecutive, fatal)

    def succeeded(self) -> int:
        """Record a success; return how many failures in a row it ended."""
        ended, self.consecutive = self.consecutive, 0
        return ended

    @property
    def total(self) -> int:
        """Failures seen in all."""
        return sum(self.counts.values())


def stalled_inputs(
    assigned: Iterable[Any], active: Set[Any] | None, paused: Set[Any], topics: Set[str]
) -> set[Any]:
    """Input partitions assigned to this worker that faust does not fetch: paused, or missing
    from its active set (``None``: every assigned partition is active).

    NOTE: besides partitions left paused by a stale recovery pass, a rebalance right after
    start-up has left input partitions out of faust's active set without pausing them (seen
    beside busy loops: assigned, never fetched, never decided on); both stall the worker alike.
    """
    return {
        tp
        for tp in assigned
        if tp.topic in topics and (tp in paused or (active is not None and tp not in active))
    }


@dataclass(slots=True)
class InputWatch:
    """How long the worker's input has trailed the clock, and which input partitions stay
    paused after the consumer's recovery finished.

    NOTE: faust pauses a worker's input partitions while its tables recover and resumes them
    when recovery completes. A rebalance that lands during recovery can leave some paused
    (a stale recovery pass pausing after the new one resumed); they are then never fetched, the
    worker's input trails the clock for good and it never decides. A partition not fetched
    (:func:`stalled_inputs`) for ``grace_s`` with recovery complete is due to be resumed.
    """

    grace_s: float
    since: dict[tuple[str, int], float] = field(default_factory=dict)
    behind_since: float = float("inf")  # wall time the input last fell behind the clock

    def overdue(self, paused: set[tuple[str, int]], now_s: float) -> list[tuple[str, int]]:
        """Of ``paused`` (seen now, recovery complete), those paused for ``grace_s`` or more."""
        self.since = {tp: self.since.get(tp, now_s) for tp in paused}
        return sorted(tp for tp, t in self.since.items() if now_s - t >= self.grace_s)

"""Faust's consumer with a cheaper hand-over of each fetched record to the streams.

Faust's fetch loop (``Consumer._drain_messages``) hands every record to the conductor with
``await self.wait_first(callback(message), self.suspend_flow.wait())``: mode's ``wait_first``
wraps each argument, and the service's ``stopped`` and ``crashed`` events, in a task of its own
(four per record), waits for the first to finish, then cancels the three others — about a dozen
event-loop callbacks per record, though the delivery nearly always finishes at once (it only
puts the record on a stream's queue). In a bench.pipeline worker that was the largest single
share of the event loop's work per NodeSamples message.

:class:`IntakeConsumer` runs the delivery's first step inline. When the delivery finishes in that
step (the queue had room), nothing else could have run meanwhile, so mode's version would have
returned the same: the delivery done first (its task is created, and so run, first). Only when
the delivery has to wait (a full queue, the producer buffer over its bound) does it hand the
suspended coroutine, as it stands, to mode's ``wait_first``, which then lets a suspended flow or
a stop interrupt it exactly as before.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Generator
from typing import Any

from faust.transport.drivers import aiokafka as faust_aiokafka
from mode.services import WaitResults

__all__ = ["IntakeConsumer", "Resumed", "step_once"]


class Resumed:
    """A coroutine that already ran its first step (which suspended on ``pending``), as an
    awaitable that goes on from there: what ``await coro`` would have done after that step."""

    __slots__ = ("_coro", "_pending")

    def __init__(self, coro: Coroutine[Any, Any, Any], pending: Any) -> None:
        self._coro = coro
        self._pending = pending

    def __await__(self) -> Generator[Any, Any, Any]:
        coro, pending = self._coro, self._pending
        while True:
            try:
                sent = yield pending
            except GeneratorExit:
                coro.close()
                raise
            except BaseException as exc:  # NOTE: cancellation too: into the coroutine
                try:
                    pending = coro.throw(exc)
                except StopIteration as stop:
                    return stop.value
            else:
                try:
                    pending = coro.send(sent)
                except StopIteration as stop:
                    return stop.value


def step_once(coro: Coroutine[Any, Any, Any]) -> tuple[bool, Any]:
    """Run ``coro``'s first step in the caller's task: ``(True, result)`` when it finished
    there, else ``(False, Resumed)`` to await for the rest. Its exception propagates."""
    try:
        pending = coro.send(None)
    except StopIteration as stop:
        return True, stop.value
    return False, Resumed(coro, pending)


class IntakeConsumer(faust_aiokafka.Consumer):
    """Faust's aiokafka consumer whose record hand-over runs inline when it need not wait."""

    async def wait_first(self, *coros: Any, timeout: Any = None) -> WaitResults:
        """mode's ``wait_first``, with the first coroutine's first step run inline (see the
        module docstring); the others are closed unawaited when it finished there.

        NOTE: the only caller handing it a coroutine first is faust's fetch loop (record
        delivery, then the suspended flow's wait); ``Consumer.wait`` hands it events, which take
        mode's path unchanged.
        """
        first = coros[0] if coros else None
        if (
            timeout is None
            and asyncio.iscoroutine(first)
            and not self._stopped.is_set()
            and not self._crashed.is_set()
        ):
            try:
                finished, outcome = step_once(first)
            except BaseException:
                _close(coros[1:])
                raise
            if finished:
                _close(coros[1:])
                return WaitResults([first], [outcome], False)
            coros = (outcome, *coros[1:])
        return await super().wait_first(*coros, timeout=timeout)


def _close(coros: tuple[Any, ...]) -> None:
    for coro in coros:
        if asyncio.iscoroutine(coro):
            coro.close()

"""The fetch loop's record hand-over (streams.delivery): inline when it need not wait, otherwise
exactly what awaiting the coroutine does (result, exception, cancellation)."""

from __future__ import annotations

import asyncio
import inspect

import pytest
from faust.transport.consumer import Consumer as FaustConsumer

from streams.delivery import IntakeConsumer, step_once

pytestmark = pytest.mark.unit


def test_a_delivery_that_need_not_wait_finishes_inline() -> None:
    calls: list[str] = []

    async def deliver() -> str:
        calls.append("ran")
        return "done"

    async def main() -> None:
        loop = asyncio.get_running_loop()
        scheduled = len(loop._ready)  # type: ignore[attr-defined]
        finished, value = step_once(deliver())
        assert (finished, value, calls) == (True, "done", ["ran"])
        assert len(loop._ready) == scheduled  # type: ignore[attr-defined]  # nothing scheduled

    asyncio.run(main())


def test_a_delivery_that_waits_goes_on_as_awaiting_it_would() -> None:
    async def deliver(gate: asyncio.Future[int], log: list[str]) -> int:
        log.append("before")
        got = await gate
        await asyncio.sleep(0)  # a bare yield as well
        log.append("after")
        return got + 1

    async def main() -> None:
        gate: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        log: list[str] = []
        finished, rest = step_once(deliver(gate, log))
        assert not finished and log == ["before"]
        task = asyncio.ensure_future(rest)
        await asyncio.sleep(0)
        assert not task.done()
        gate.set_result(41)
        assert await task == 42
        assert log == ["before", "after"]

    asyncio.run(main())


def test_a_waiting_delivery_is_cancelled_into_the_coroutine_and_errors_propagate() -> None:
    async def deliver(gate: asyncio.Future[None], log: list[str]) -> None:
        try:
            await gate
        finally:
            log.append("cleaned up")

    async def fails() -> None:
        raise ValueError("bad record")

    async def main() -> None:
        gate: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        log: list[str] = []
        _, rest = step_once(deliver(gate, log))
        task = asyncio.ensure_future(rest)
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert log == ["cleaned up"]
        with pytest.raises(ValueError, match="bad record"):
            step_once(fails())

    asyncio.run(main())


def test_faust_fetch_loop_still_hands_records_over_through_wait_first() -> None:
    """IntakeConsumer speeds up the one call faust's fetch loop makes per record; a faust whose
    loop delivers some other way would leave it unused (not wrong, only slow again)."""
    source = inspect.getsource(FaustConsumer._drain_messages)
    assert "await self.wait_first(" in source and "callback(message)" in source
    assert "wait_first" in IntakeConsumer.__dict__

"""Unit: the admission rules the live ServingCore and the multi-model benchmark share."""

from __future__ import annotations

import pytest

from runtime.admission import memory_wait_until_s, screen, transient, worst_refusal
from runtime.throttle import GpuMemory
from runtime.types import Reason

pytestmark = pytest.mark.unit

GB = 10**9
FULL = {"g": GpuMemory(100 * GB, 80 * GB)}  # 80 % committed
NEED = {"g": 10 * GB}  # would take it to 90 %


def _screen(too_long: bool, queue_full: bool, memory: dict[str, GpuMemory] = FULL) -> Reason | None:
    return screen(
        too_long=too_long, queue_full=queue_full, memory=memory, need_bytes=NEED, watermark=0.85
    )


def test_screen_refuses_by_the_first_rule_in_order() -> None:
    assert _screen(True, True) is Reason.TOO_LONG
    assert _screen(False, True) is Reason.QUEUE_FULL
    assert _screen(False, False) is Reason.THROTTLED_WATERMARK
    assert _screen(False, False, {"g": GpuMemory(100 * GB, 50 * GB)}) is None


def test_worst_refusal_names_the_most_specific_rule() -> None:
    assert (
        worst_refusal({Reason.TOO_LONG, Reason.THROTTLED_WATERMARK}) is Reason.THROTTLED_WATERMARK
    )
    assert worst_refusal({Reason.QUEUE_FULL, Reason.REJECTED_OOM_RISK}) is Reason.REJECTED_OOM_RISK


def test_a_refusal_is_transient_only_when_the_weights_alone_leave_room() -> None:
    assert transient(FULL, {"g": 30 * GB}, NEED, 0.85)  # 30 + 10 of 100: room once KV frees
    assert not transient(FULL, {"g": 80 * GB}, NEED, 0.85)  # the weights alone leave none


def test_a_transient_watermark_refusal_waits_while_its_first_token_can_be_in_time() -> None:
    wait = Reason.THROTTLED_WATERMARK
    assert memory_wait_until_s(wait, 0.5, 10.0, 10.0, 2.0) == 11.5
    assert memory_wait_until_s(wait, 0.5, 10.0, 11.4, 2.0) == 11.5
    assert memory_wait_until_s(wait, 0.5, 10.0, 11.5, 2.0) is None  # deadline reached
    assert memory_wait_until_s(wait, 2.5, 10.0, 10.0, 2.0) is None  # could never be in time
    assert memory_wait_until_s(wait, None, 10.0, 10.0, 2.0) is None  # not transient
    assert memory_wait_until_s(Reason.QUEUE_FULL, 0.5, 10.0, 10.0, 2.0) is None

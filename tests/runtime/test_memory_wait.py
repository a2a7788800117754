"""Unit: a request the watermark refuses only for the moment waits for memory (bounded), is
admitted once memory frees, or is refused ``throttled_watermark`` at its deadline; never OOM."""

from __future__ import annotations

import pytest

from runtime.admission import first_token_s
from runtime.types import OwnershipKind, Reason
from tests.runtime.builders import Harness, make_plan, make_replica, make_request, make_runtime

pytestmark = pytest.mark.unit

L40S = make_plan(make_replica(["C0"], gpu_class="l40s"))  # 48 GB: four 12k prompts fill it
PROMPT = 12_000


def _serving(wait_s: float) -> Harness:
    h = Harness(make_runtime()).serve(L40S)
    h.rt.core.memory_wait_s = wait_s
    return h


def _fill(h: Harness, output: int) -> list[str]:
    """Four long prompts take the GPU up to the watermark; returns their ids."""
    admitted = [h.submit(make_request(i, PROMPT, output, h.now_s)) for i in range(4)]
    assert all(a.reason is Reason.ADMITTED for a in admitted)
    return [a.request_id for a in admitted]


def _under_watermark(h: Harness) -> bool:
    return h.rt.core.vmm.memory()["C0"].fill <= h.rt.settings.serving.watermark


def test_a_held_request_is_admitted_when_memory_frees_before_its_deadline() -> None:
    h = _serving(30.0)
    _fill(h, output=50)
    held = [h.submit(make_request(i, PROMPT, 50, h.now_s)) for i in (4, 5)]
    assert [a.reason for a in held] == [Reason.HELD_FOR_MEMORY] * 2 and held[0].admitted
    assert h.rt.core.held(Reason.HELD_FOR_MEMORY) == ("r4", "r5")
    assert h.rt.status(h.now_s)["held_for_memory"] == 2
    h.until(lambda: not h.rt.core.held() and _under_watermark(h), 30)
    h.until(lambda: len(h.outputs.completions) == 6, 60)
    admitted = [
        e.request.request_id for e in h.outputs.ownership if e.kind is OwnershipKind.ADMITTED
    ]
    assert admitted.index("r4") < admitted.index("r5")  # oldest first
    assert h.outputs.refused == [] and not h.rt.core.rejections
    assert h.rt.pool.oom_events == 0 and h.rt.core.engine_oom_events == 0


def test_a_held_request_is_refused_throttled_watermark_once_it_could_not_start_in_time() -> None:
    h = _serving(3.0)
    _fill(h, output=4_000)  # nothing finishes within the wait
    t0 = h.now_s
    assert h.submit(make_request(4, PROMPT, 50, h.now_s)).reason is Reason.HELD_FOR_MEMORY
    timing = next(iter(h.rt.core._slots.values())).timing
    deadline_s = t0 + 3.0 - first_token_s(timing, PROMPT)  # it could not start in time after
    h.advance_to(deadline_s - 0.1)
    assert h.rt.core.held() == ("r4",) and h.outputs.refused == []
    h.advance_to(deadline_s + 0.1)
    assert h.rt.core.held() == ()
    assert h.outputs.refused == [("r4", Reason.THROTTLED_WATERMARK)]
    assert h.rt.core.rejections == {Reason.THROTTLED_WATERMARK: 1}
    assert h.rt.core.window.capacity_refusals == 1  # the scale-out signal sees it once
    assert _under_watermark(h) and h.rt.pool.oom_events == 0


def test_a_request_that_could_not_start_in_time_or_never_fits_is_refused_at_once() -> None:
    h = _serving(2.0)  # the default: the TTFT SLO
    _fill(h, output=4_000)
    timing = next(iter(h.rt.core._slots.values())).timing
    assert first_token_s(timing, 20_000) > 2.0
    late = h.submit(make_request(4, 20_000, 50, h.now_s))
    assert late.reason is Reason.THROTTLED_WATERMARK and not late.admitted
    h = _serving(30.0)
    # its KV alone would pass the watermark on the idle GPU: past the context limit too, which
    # gearbox sizes at the same watermark (memory_utilisation), so it is never held
    huge = h.submit(make_request(9, 55_000, 100, h.now_s))
    assert huge.reason is Reason.TOO_LONG and h.rt.core.held() == ()


def test_no_wait_refuses_at_once_as_before() -> None:
    h = _serving(0.0)
    _fill(h, output=50)
    assert h.submit(make_request(4, PROMPT, 50, h.now_s)).reason is Reason.THROTTLED_WATERMARK
    assert h.rt.core.held() == ()


def test_a_later_request_that_fits_is_not_held_behind_a_waiting_one() -> None:
    h = _serving(30.0)
    _fill(h, output=4_000)
    assert h.submit(make_request(4, PROMPT, 50, h.now_s)).reason is Reason.HELD_FOR_MEMORY
    assert h.submit(make_request(5, 200, 20, h.now_s)).reason is Reason.ADMITTED

"""Unit: a new request with no first token ``ttft_deadline_s`` after its arrival (queued, or
admitted to the engine but still prefilling) is refused ``ttft_deadline``, at once when its
engine's turn to prefill it comes too late (expired); what did get a first token in time runs
to its end; a request held for a model's load is not subject to it."""

from __future__ import annotations

import pytest

from runtime.engine.sim import SimEngine
from runtime.types import OwnershipKind, Reason
from tests.runtime.builders import Harness, make_plan, make_replica, make_request, make_runtime

pytestmark = pytest.mark.unit

H100 = make_plan(make_replica(["A0"]))
BURST = 100  # prompts at once: more prefill than one H100 does in 2 s, under the watermark
PROMPT = 1_000


def _serving(deadline_s: float) -> Harness:
    h = Harness(make_runtime()).serve(H100)
    h.rt.core.ttft_deadline_s = deadline_s
    return h


def _burst(h: Harness) -> float:
    t0 = h.now_s
    admitted = [h.submit(make_request(i, PROMPT, 50, t0)) for i in range(BURST)]
    assert all(a.reason is Reason.ADMITTED for a in admitted)
    h.until(lambda: len(h.outputs.completions) + len(h.outputs.refused) == BURST, 120)
    return t0


def test_requests_past_the_deadline_are_refused_and_the_rest_start_in_time() -> None:
    h = _serving(2.0)
    _burst(h)
    refused = [rid for rid, _ in h.outputs.refused]
    assert 0 < len(refused) < BURST
    assert {reason for _, reason in h.outputs.refused} == {Reason.TTFT_DEADLINE}
    assert h.rt.core.rejections == {Reason.TTFT_DEADLINE: len(refused)}
    assert h.rt.core.window.capacity_refusals == len(refused)  # the streams see a violation
    # the step that notices a late request runs at most one tick (0.05 s) past its deadline
    assert max(c.ttft_s for c in h.outputs.completions) <= 2.0 + 0.05
    finished = [
        e.request.request_id for e in h.outputs.ownership if e.kind is OwnershipKind.FINISHED
    ]
    assert sorted(finished) == sorted([c.request_id for c in h.outputs.completions] + refused)
    # nothing of a refused request is left: no owner, no KV commit, nothing in the engine
    core = h.rt.core
    slot = next(iter(core._slots.values()))
    assert all(core.router.owner(rid) is None for rid in refused)
    assert not any(core.vmm.holds(slot.ledger, rid) for rid in refused)
    assert slot.engine.progress() == ()
    assert h.rt.pool.oom_events == 0


def test_a_request_whose_prefill_would_start_too_late_is_refused_before_its_deadline() -> None:
    h = _serving(2.0)
    t0 = h.now_s
    for i in range(BURST):
        h.submit(make_request(i, PROMPT, 50, t0))
    h.until(lambda: bool(h.outputs.refused), 10)
    # its engine dropped it when its turn came: before the deadline, without its prefill
    assert h.now_s < t0 + 2.0
    h.until(lambda: len(h.outputs.completions) + len(h.outputs.refused) == BURST, 120)
    engine = next(iter(h.rt.core._slots.values())).engine
    assert isinstance(engine, SimEngine)
    assert engine.stats.prefill_tokens == PROMPT * len(h.outputs.completions)
    assert {reason for _, reason in h.outputs.refused} == {Reason.TTFT_DEADLINE}


def test_without_a_deadline_every_request_waits_its_turn() -> None:
    h = _serving(0.0)
    _burst(h)
    assert h.outputs.refused == [] and not h.rt.core.rejections
    # the same burst: the deadline above refused what would have started this late
    assert max(c.ttft_s for c in h.outputs.completions) > 3.0


def test_a_request_held_for_a_load_is_not_refused_for_the_wait() -> None:
    h = Harness(make_runtime())
    h.rt.core.hold_s = 60.0
    h.rt.core.ttft_deadline_s = 0.5
    held = h.submit(make_request(1, 500, 20, h.now_s))
    assert held.reason is Reason.HELD_FOR_LOAD
    h.decide(1, H100)  # the load alone takes longer than the deadline
    h.until(lambda: len(h.outputs.completions) == 1, 60)
    assert h.outputs.completions[0].ttft_s > 0.5 and h.outputs.refused == []

"""On-demand deployments in the runtime: requests held for a load, refused after the wait, and
evictions (transitions to the empty plan) that never unload a model with requests."""

from __future__ import annotations

import pytest

from flexpipe.schemas import TransitionPhase
from gearbox.plans import DeploymentPlan
from runtime.types import Reason
from tests.runtime.builders import (
    DEPLOYMENT,
    Harness,
    make_plan,
    make_replica,
    make_request,
    make_runtime,
)

pytestmark = pytest.mark.unit

HOLD_S = 30.0
PLAN = make_plan(make_replica(["A0"]))
EMPTY = DeploymentPlan(DEPLOYMENT, PLAN.model_name, ())


def _on_demand() -> Harness:
    h = Harness(make_runtime())
    h.rt.core.hold_s = HOLD_S
    return h


def test_a_request_for_a_cold_model_is_held_and_served_once_it_loads() -> None:
    h = _on_demand()
    assert h.submit(make_request(1, output=16)).reason is Reason.HELD_FOR_LOAD
    assert h.rt.core.held() == ("r1",)
    h.advance(5.0)
    h.decide(1, PLAN)
    h.until(lambda: any(c.request_id == "r1" for c in h.outputs.completions), 60)
    assert h.rt.core.held() == () and h.outputs.refused == []
    done = next(c for c in h.outputs.completions if c.request_id == "r1")
    assert done.ttft_s >= 5.0  # NOTE: the wait for the load counts in its latency


def test_a_held_request_is_refused_model_loading_after_the_wait() -> None:
    h = _on_demand()
    h.submit(make_request(1))
    h.advance(HOLD_S - 1.0)
    assert h.outputs.refused == []
    h.advance(2.0)
    assert h.outputs.refused == [("r1", Reason.MODEL_LOADING)]
    assert h.rt.core.rejections[Reason.MODEL_LOADING] == 1 and h.rt.core.held() == ()


def test_a_resident_deployment_still_refuses_with_no_plan() -> None:
    h = Harness(make_runtime())
    assert h.submit(make_request(1)).reason is Reason.NO_SERVING_PLAN


def test_an_eviction_with_a_request_in_flight_rolls_back_and_the_request_finishes() -> None:
    h = _on_demand()
    h.decide(1, PLAN)
    h.until(lambda: h.rt.state.active is None, 30)
    assert h.submit(make_request(1, output=400)).admitted
    h.decide(2, EMPTY, from_plan_id=PLAN.plan_id)
    h.until(lambda: h.rt.state.active is None, 120)
    phases = [(r.transition_seq, r.phase) for r in h.outputs.records]
    assert (2, TransitionPhase.ROLLED_BACK) in phases and (2, TransitionPhase.DONE) not in phases
    assert any("not evicted" in r.detail for r in h.outputs.records if r.transition_seq == 2)
    assert h.rt.state.serving_plan_id == PLAN.plan_id
    h.until(lambda: any(c.request_id == "r1" for c in h.outputs.completions), 120)


def test_an_idle_model_is_evicted_and_its_next_request_is_held() -> None:
    h = _on_demand()
    h.decide(1, PLAN)
    h.until(lambda: h.rt.state.active is None, 30)
    h.decide(2, EMPTY, from_plan_id=PLAN.plan_id)
    h.until(lambda: h.rt.state.active is None, 60)
    assert h.rt.state.serving_plan_id == EMPTY.plan_id and h.rt.core.replica_ids() == ()
    assert h.submit(make_request(1)).reason is Reason.HELD_FOR_LOAD

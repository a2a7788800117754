"""On-demand deployments through the decision step the live decider runs (via the replay):
demand loads a cold model, the runtime's DONE makes it resident, a waiting model evicts the
least recently used idle one, and the transitions keyed ``deployment/seq`` pass the intake."""

from __future__ import annotations

from typing import Any

import pytest

from flexpipe import envelope
from flexpipe.config import DeploymentConfig
from flexpipe.schemas import GearTransition, PhaseStatus, TransitionPhase
from gearbox.config import PlacementConfig, PlacementStrategy
from gearbox.decisions import DecisionReason, Trigger
from gearbox.residency import Residency
from streams.deployments import resolve_deployments
from streams.intake import Accepted, SourceTopic, admit
from streams.ondemand import on_demand_view, residency_of
from streams.replay import Replayer
from streams.step import PlanState, StepOutput, TriggerInfo
from streams.windows import HoppingWindow
from tests.streams.builders import (
    T0_MS,
    cluster_envelopes,
    env,
    heartbeats,
    make_load,
    streams_config,
)

pytestmark = pytest.mark.unit

NAMES = ("m1", "m2", "m3", "m4", "late")


def _replayer(max_models_per_gpu: int = 1, displace_in_use: bool = True) -> Replayer:
    """Five on-demand 7B models on block B (four 80 GiB GPUs); one model per GPU unless
    ``max_models_per_gpu`` lets them share."""
    deps = tuple(
        DeploymentConfig(
            name=n, model="llama-2-7b", residency="on_demand", block="B", arrival_rps=0.5
        )
        for n in NAMES
    )
    cfg = streams_config(deployments=deps)
    placement = PlacementConfig(
        cold_after_s=60.0,
        max_models_per_gpu=max_models_per_gpu,
        strategy=PlacementStrategy.PACK,
        displace_in_use=displace_in_use,
    )
    cfg = cfg.model_copy(update={"placement": placement})
    catalog, deployments = resolve_deployments(cfg)
    return Replayer(cfg, catalog, deployments)


def _report(r: Replayer, name: str, t_ms: int, seq: int, **load: Any) -> None:
    values = {"arrivals": 0, "arrival_rate_rps": 0.0, "queue_len": 0, "active_sequences": 0}
    r.fold(env(make_load(name, **{**values, **load}), t_ms, "runtime-0/runtime", seq))


def _tick(r: Replayer, t_ms: int) -> dict[str, StepOutput]:
    outs = r.decide_all(TriggerInfo(Trigger.TIMER, t_ms, "periodic tick"), t_ms)
    return {o.decision.deployment: o for o in outs}


def _done(out: StepOutput) -> GearTransition:
    d = out.decision
    return GearTransition(
        deployment=d.deployment,
        transition_seq=d.seq,
        decision_id=d.decision_id,
        phase=TransitionPhase.DONE,
        status=PhaseStatus.COMPLETED,
        from_plan_id=d.from_plan_id,
        to_plan_id=d.to_plan_id,
        plan=d.decision.to_plan if d.decision is not None else None,
    )


def test_on_demand_models_share_a_gpu_when_their_footprints_fit_under_the_watermark() -> None:
    r = _replayer(max_models_per_gpu=4)
    for e in cluster_envelopes(T0_MS):
        r.fold(e)
    for i, name in enumerate(NAMES[:4]):
        _report(r, name, T0_MS + 1000 + i, i + 1, arrivals=3, arrival_rate_rps=0.3, queue_len=2)
    outs = _tick(r, T0_MS + 15_000)
    on: dict[str, list[str]] = {}
    for n, o in outs.items():
        if o.decision.decision is not None:
            for uuid in o.decision.decision.to_plan.gpu_uuids:
                on.setdefault(uuid, []).append(n)
    assert sorted(n for names in on.values() for n in names) == list(NAMES[:4])
    # NOTE: the step no longer shows a GPU an on-demand model holds as full; the watermark
    # arithmetic per GPU is gearbox.residency's (tests/gearbox/test_residency.py)
    assert max(len(names) for names in on.values()) >= 2, on


def test_demand_loads_done_makes_resident_and_a_waiting_model_evicts_the_lru() -> None:
    r = _replayer()
    seq = 0
    for e in cluster_envelopes(T0_MS):
        r.fold(e)
    for i, name in enumerate(NAMES[:4]):
        seq += 1
        _report(r, name, T0_MS + 1000 + i, seq, arrivals=3, arrival_rate_rps=0.3, queue_len=2)
    first = _tick(r, T0_MS + 15_000)
    loads = {n: o for n, o in first.items() if o.decision.reason == DecisionReason.LOAD_ON_DEMAND}
    assert set(loads) == set(NAMES[:4]), {n: o.decision.reason for n, o in first.items()}
    assert first["late"].decision.reason == DecisionReason.COLD
    gpus = [o.decision.decision.to_plan.gpu_uuids for o in loads.values() if o.decision.decision]
    assert len(set().union(*gpus)) == 4  # B's four GPUs, one model each
    for n, out in loads.items():
        seq += 1
        record = _done(out)
        key = f"{n}/{record.transition_seq}".encode()
        raw = envelope.encode(
            envelope.make(record, event_time_ms=T0_MS + 20_000, source="rt", seq=seq)
        )
        now_s = T0_MS / 1000.0
        ok = admit(SourceTopic.TRANSITIONS, key, raw, now_s, now_s, 300.0, frozenset(NAMES))
        assert isinstance(ok, Accepted), ok  # the runtime's key reaches the fold
        r.fold(ok.env)
        plan = r.tables[n].plan
        assert residency_of(plan.current, plan.confirmed, plan.in_flight is not None)[0] is (
            Residency.RESIDENT
        )
    # m1 … m3 keep working until t0+100 s, m4 goes quiet at t0+1 s; then "late" is requested.
    t_ms = T0_MS + 200_000
    for e in heartbeats(t_ms - 1000, 1000):
        r.fold(e)
    for name in NAMES[:3]:
        seq += 1
        _report(r, name, T0_MS + 100_000, seq, arrivals=1, arrival_rate_rps=0.1)
    held = _tick(r, T0_MS + 105_000)  # NOTE: a step notes when its model last had requests
    assert {o.decision.reason for o in held.values()} <= {DecisionReason.RESIDENT, "cold"}
    for name in NAMES[:4]:
        seq += 1
        _report(r, name, t_ms - 500, seq)
    seq += 1
    _report(r, "late", t_ms - 400, seq, arrivals=2, arrival_rate_rps=0.2, queue_len=2)
    second = _tick(r, t_ms)
    reasons = {n: o.decision.reason for n, o in second.items()}
    assert reasons["m4"] == DecisionReason.EVICT_COLD, second["late"].decision.explanation
    assert [n for n, why in reasons.items() if why == DecisionReason.EVICT_COLD] == ["m4"]
    assert reasons["late"] == DecisionReason.WAITING_FOR_ROOM
    evict = second["m4"].decision
    assert evict.decision is not None and not evict.decision.to_plan.replicas
    assert "to make room for late" in evict.explanation


def test_a_resident_model_refusing_requests_scales_out_keeping_its_replica() -> None:
    r = _replayer()
    for e in cluster_envelopes(T0_MS):
        r.fold(e)
    _report(r, "m1", T0_MS + 1000, 1, arrivals=3, arrival_rate_rps=0.3, queue_len=2)
    load = _tick(r, T0_MS + 15_000)["m1"]
    assert load.decision.reason == DecisionReason.LOAD_ON_DEMAND
    r.fold(env(_done(load), T0_MS + 20_000, "rt", 2))
    loaded = r.tables["m1"].plan.confirmed
    assert loaded is not None and r.tables["m1"].plan.changed_ms == T0_MS + 20_000
    t_ms = T0_MS + 90_000  # 70 s after the load: the whole 60 s window saw one replica
    for e in heartbeats(t_ms - 1000, 1000):
        r.fold(e)
    busy = {"arrivals": 20, "arrival_rate_rps": 2.0, "queue_len": 4, "active_sequences": 8}
    _report(r, "m1", t_ms - 500, 3, capacity_refusals=10, **busy)  # a 10 s report
    out = _tick(r, t_ms)["m1"]
    assert out.decision.reason == DecisionReason.SCALE_OUT, out.decision.explanation
    assert out.decision.decision is not None
    replicas = out.decision.decision.to_plan.replicas
    assert len(replicas) == 2
    kept = [x for x in replicas if x.plan_id == loaded.replicas[0].plan_id]
    assert len(kept) == 1  # the serving replica is the same plan: only the new one loads


def test_a_model_needing_two_victims_evicts_those_two_and_no_other() -> None:
    """Twelve 7B models fill block B's four GPUs, three each; a 13B then needs two of them gone
    from one GPU. Every on-demand deployment decides from the round as the tick began: before,
    each eviction decided earlier in the tick moved the later victims' round elsewhere, and one
    waiting 13B evicted a model on each GPU."""
    names = tuple(f"s{i}" for i in range(1, 13))
    models = [*((n, "llama-2-7b") for n in names), ("big", "llama-2-13b")]
    deps = tuple(
        DeploymentConfig(name=n, model=m, residency="on_demand", block="B", arrival_rps=0.5)
        for n, m in models
    )
    placement = PlacementConfig(
        cold_after_s=60.0, max_models_per_gpu=4, strategy=PlacementStrategy.PACK
    )
    cfg = streams_config(deployments=deps).model_copy(update={"placement": placement})
    catalog, deployments = resolve_deployments(cfg)
    r = Replayer(cfg, catalog, deployments)
    for e in cluster_envelopes(T0_MS):
        r.fold(e)
    seq = 0
    for i, name in enumerate(names):
        seq += 1
        _report(r, name, T0_MS + 1000 + i, seq, arrivals=3, arrival_rate_rps=0.3, queue_len=2)
    loaded = _tick(r, T0_MS + 15_000)
    on: dict[str, list[str]] = {}
    for name in names:
        out = loaded[name]
        assert out.decision.decision is not None, out.decision.explanation
        (uuid,) = out.decision.decision.to_plan.gpu_uuids
        on.setdefault(uuid, []).append(name)
        seq += 1
        r.fold(env(_done(out), T0_MS + 20_000, "rt", seq))
    assert sorted(len(v) for v in on.values()) == [3, 3, 3, 3], on
    t_ms = T0_MS + 200_000
    for e in heartbeats(t_ms - 1000, 1000):
        r.fold(e)
    for name in names:
        seq += 1
        _report(r, name, t_ms - 500, seq)
    seq += 1
    _report(r, "big", t_ms - 400, seq, arrivals=2, arrival_rate_rps=0.2, queue_len=2)
    outs = _tick(r, t_ms)
    assert outs["big"].decision.reason == DecisionReason.WAITING_FOR_ROOM
    gone = [n for n, o in outs.items() if o.decision.reason == DecisionReason.EVICT_COLD]
    assert len(gone) == 2, {n: o.decision.reason for n, o in outs.items()}
    (gpu,) = {u for u, held in on.items() if set(gone) <= set(held)}
    assert f"@{gpu}" in outs["big"].decision.explanation
    for name in gone:
        assert f"evict {name}@{gpu}" in outs["big"].decision.explanation


def _all_resident(r: Replayer, seq: int) -> int:
    """m1 … m4 requested, loaded and confirmed, one per GPU of block B; the last seq used."""
    for e in cluster_envelopes(T0_MS):
        r.fold(e)
    for i, name in enumerate(NAMES[:4]):
        seq += 1
        _report(r, name, T0_MS + 1000 + i, seq, arrivals=3, arrival_rate_rps=0.3, queue_len=2)
    for out in _tick(r, T0_MS + 15_000).values():
        if out.decision.reason == DecisionReason.LOAD_ON_DEMAND:
            seq += 1
            r.fold(env(_done(out), T0_MS + 20_000, "rt", seq))
    return seq


@pytest.mark.parametrize("displace", [True, False])
def test_a_model_asked_for_at_many_times_a_busy_neighbours_rate_displaces_it(
    displace: bool,
) -> None:
    # every GPU holds a model in use; "late" is asked for at 1 request/s, m4 at one every 20 s
    # (× 3 = 0.15 / s), m1 … m3 at 1 / s each: only m4 may go, and only by the displace rule
    r = _replayer(displace_in_use=displace)
    seq = _all_resident(r, 0)
    t_ms = T0_MS + 200_000
    for e in heartbeats(t_ms - 1000, 1000):
        r.fold(e)
    # the view's rate is the arrivals its 60-s window holds
    for name, arrivals in (("m1", 60), ("m2", 60), ("m3", 60), ("m4", 3)):
        seq += 1
        rps = arrivals / 60.0
        _report(
            r, name, t_ms - 500, seq, arrivals=arrivals, arrival_rate_rps=rps, active_sequences=2
        )
    seq += 1
    _report(r, "late", t_ms - 400, seq, arrivals=60, arrival_rate_rps=1.0, queue_len=3)
    outs = _tick(r, t_ms)
    reasons = {n: o.decision.reason for n, o in outs.items()}
    assert reasons["late"] == DecisionReason.WAITING_FOR_ROOM
    if not displace:  # the article's rule: a model in use is never evicted
        assert DecisionReason.EVICT_DISPLACE not in reasons.values(), reasons
        return
    assert [n for n, why in reasons.items() if why == DecisionReason.EVICT_DISPLACE] == ["m4"]
    assert "(displace rule)" in outs["late"].decision.explanation
    assert "to make room for late" in outs["m4"].decision.explanation


def _busy(r: Replayer, t_ms: int, seq: int, slow: tuple[str, ...]) -> int:
    """Every model in use, those in ``slow`` asked for once every 20 s and the others at 1 / s;
    "late" asked for at 1 / s with 3 requests waiting; the last seq used."""
    for e in heartbeats(t_ms - 1000, 1000):
        r.fold(e)
    for name in NAMES[:4]:
        seq += 1
        arrivals = 3 if name in slow else 60
        rps = arrivals / 60.0
        _report(
            r, name, t_ms - 500, seq, arrivals=arrivals, arrival_rate_rps=rps, active_sequences=2
        )
    seq += 1
    _report(r, "late", t_ms - 400, seq, arrivals=60, arrival_rate_rps=1.0, queue_len=3)
    return seq


def test_a_model_displaces_no_second_neighbour_while_the_first_waits_for_an_idle_moment() -> None:
    # m3 and m4 may each be displaced for "late"; the first one taken stays in use (its
    # eviction waits, unconfirmed, for an idle moment), and later ticks take no other
    r = _replayer()
    seq = _all_resident(r, 0)
    t_ms = T0_MS + 200_000
    seq = _busy(r, t_ms, seq, slow=("m3", "m4"))
    outs = _tick(r, t_ms)
    first = [n for n, o in outs.items() if o.decision.reason == DecisionReason.EVICT_DISPLACE]
    assert len(first) == 1, first
    for k in range(1, 4):
        t_ms += 5000
        seq = _busy(r, t_ms, seq, slow=("m3", "m4"))
        reasons = {n: o.decision.reason for n, o in _tick(r, t_ms).items()}
        assert DecisionReason.EVICT_DISPLACE not in reasons.values(), (k, reasons)
        assert reasons["late"] == DecisionReason.WAITING_FOR_ROOM
        assert reasons[first[0]] == DecisionReason.TRANSITION_IN_FLIGHT


@pytest.mark.parametrize("made_for", ["late", None])
def test_the_view_names_whom_a_finished_displacement_made_room_for(made_for: str | None) -> None:
    # m1's last decision was its eviction by the displace rule, for "late", and it ended 5 s
    # ago: the round gives that room to "late" first, so the view keeps saying whom it was for
    r = _replayer()
    plans = {"m1": PlanState(evicting_for=made_for, changed_ms=T0_MS)}
    window = HoppingWindow(60.0, 10.0)
    view = on_demand_view(r.deployments, plans, {}, window, T0_MS / 1000 + 5.0, r.cfg.gearbox)
    m1 = next(m for m in view if m.name == "m1")
    assert (m1.state, m1.evicting_for, m1.steady_s) == (Residency.COLD, made_for, 5.0)

"""Tests for the multi-model benchmark (``bench.multimodel``): determinism, safety, mechanics."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

import pytest

from bench.mm.core import Instance, Seq, Simulator, System
from bench.mm.farm import (
    ACTIVE_MODELS,
    ENCODER_MAX_TOKENS,
    FARM_LOAD,
    PHASE_S,
    build_farm,
    make_farm_cluster,
    offered_gpu_load,
)
from bench.mm.metrics import Metrics, percentile, union_length_s
from bench.mm.scenario import (
    MAX_OUTPUT_TOKENS,
    ModelProfile,
    Scenario,
    SimRequest,
    TrafficProfile,
    build_scenario,
    make_cluster,
)
from bench.mm.systems import (
    GPU_MEMORY_UTILIZATION,
    GearboxSystem,
    ModelAwareRoundRobin,
    NaiveRoundRobin,
    VllmLikeSystem,
)
from bench.multimodel import ENGINE_CONFIGS, main, results_text, run_seed
from gearbox.config import GearboxConfig, PlacementConfig
from gearbox.presets import GIB, MODEL_7B_MHA
from gearbox.residency import Residency
from runtime.engine.paging import KvAdmission, admission_tokens

SHORT_S = 900.0
# NOTE: a short run cannot wait the default 30 min for a model to go cold; shortening it lets
# the tidal models become eviction candidates before the late ones need their room.
SHORT_PLACEMENT = PlacementConfig(cold_after_s=120.0)
KV_PER_TOKEN = MODEL_7B_MHA.kv_bytes_per_token
# What one A10 24 GB leaves for KV once the 7B's weights and the runtime's overhead are loaded.
A10_KV_ROOM = 24 * GIB - MODEL_7B_MHA.weight_bytes - GearboxConfig().runtime_overhead_bytes
SYSTEMS: dict[str, Callable[[Simulator], System]] = {
    "naive": NaiveRoundRobin,
    "rr": ModelAwareRoundRobin,
    "vllm": VllmLikeSystem,
    "ours": GearboxSystem,
}
BASELINE = {"naive": "naive_rr", "rr": "model_aware_rr"}  # this file's names → the benchmark's


def make_single_gpu_scenario(requests: tuple[SimRequest, ...]) -> Scenario:
    """One A10 24 GB, one 7B model, the given requests (no generated traffic)."""
    cluster = make_cluster()
    a10 = next(g for g in cluster.gpus if g.gpu_class.name == "a10-24g")
    traffic = TrafficProfile(0.0, 0.0, 600.0, 120.0, 600, 200, 0.0)
    model = ModelProfile("chat-7b", MODEL_7B_MHA, 1, 4, 2048, traffic)
    return Scenario(0, 400.0, dataclasses.replace(cluster, gpus=(a10,)), (model,), (), requests)


def request(n: int, prompt: int, output: int, arrival_s: float = 100.0) -> SimRequest:
    """A chat-7b request."""
    return SimRequest(f"chat-7b/{n}", "chat-7b", arrival_s, prompt, output, True)


def run_one(
    scenario: Scenario,
    system: str,
    admission: KvAdmission = KvAdmission.INCREMENTAL,
    deadline: bool = True,
) -> Metrics:
    """Run one system on a scenario with the default placement config; ``deadline`` False:
    ours without the runtime's TTFT deadline (for a test of another rule whose requests start
    late: an 8k prompt's first token on the A10 takes 2.04 s, past the 2 s SLO)."""
    sim = Simulator(scenario, PlacementConfig(), admission)
    if system == "ours" and not deadline:
        return sim.run(GearboxSystem(sim, ttft_deadline=0.0))
    return sim.run(SYSTEMS[system](sim))


@pytest.mark.unit
def test_same_seed_gives_byte_identical_results() -> None:
    first = json.dumps(run_seed(3, 600.0, placement=SHORT_PLACEMENT), sort_keys=True)
    assert first == json.dumps(run_seed(3, 600.0, placement=SHORT_PLACEMENT), sort_keys=True)
    assert json.dumps(run_seed(4, 600.0, placement=SHORT_PLACEMENT), sort_keys=True) != first


@pytest.mark.unit
def test_ours_evicts_only_idle_models_and_never_ooms() -> None:
    scenario = build_scenario(3, SHORT_S)
    sim = Simulator(scenario, SHORT_PLACEMENT)
    metrics = sim.run(GearboxSystem(sim))
    assert metrics.evictions > 0  # the eviction path ran …
    assert metrics.evicted_with_active == 0  # … and never hit a model with requests
    assert metrics.oom_events == 0
    assert metrics.served_requests > 0.8 * metrics.arrivals


@pytest.mark.unit
def test_scenario_is_seeded_and_sorted() -> None:
    a, b = build_scenario(5, SHORT_S), build_scenario(5, SHORT_S)
    assert a.requests == b.requests
    assert [r.arrival_s for r in a.requests] == sorted(r.arrival_s for r in a.requests)
    assert build_scenario(6, SHORT_S).requests != a.requests
    assert all(r.output_tokens <= r.max_tokens for r in a.requests)


@pytest.mark.unit
@pytest.mark.parametrize("system", ["naive", "rr"])
def test_growing_kv_preempts_the_youngest_and_resumes_it(system: str) -> None:
    # Both prompts fit side by side, both finished contexts do not: the younger one is preempted
    # mid-generation, resumes once the older one has finished, and both are served; no OOM.
    prompt = A10_KV_ROOM // KV_PER_TOKEN // 2 - 600
    older, younger = request(0, prompt, 1000, 100.0), request(1, prompt, 1000, 100.5)
    metrics = run_one(make_single_gpu_scenario((older, younger)), system)
    assert metrics.oom_events == 0
    assert metrics.preemptions >= 1
    assert metrics.served_requests == 2
    assert metrics.latency_s[0] + older.arrival_s < metrics.latency_s[1] + younger.arrival_s


@pytest.mark.unit
@pytest.mark.parametrize("system", ["naive", "rr", "ours"])
def test_kv_growth_past_memory_preempts_instead_of_crashing(system: str) -> None:
    # Eight prompts pass ours' 85 % watermark together; their outputs outgrow the GPU.
    count, output = 8, 1000
    under_watermark = 0.85 * 24 * GIB - (24 * GIB - A10_KV_ROOM)
    prompt = int(under_watermark) // KV_PER_TOKEN // count - 50
    assert count * (prompt + output) * KV_PER_TOKEN > A10_KV_ROOM
    requests = tuple(request(n, prompt, output, 100.0 + n / 100) for n in range(count))
    # (one prefill step takes all eight prompts: their first tokens come past the TTFT deadline)
    metrics = run_one(make_single_gpu_scenario(requests), system, deadline=False)
    assert metrics.oom_events == 0 and metrics.rejected == {}
    assert metrics.preemptions >= 1
    assert metrics.served_requests == count


@pytest.mark.unit
def test_useful_utilisation_leaves_out_recompute_loads_and_unserved_work() -> None:
    # The preemption case above: the younger sequence's context is prefilled twice.
    prompt = A10_KV_ROOM // KV_PER_TOKEN // 2 - 600
    requests = (request(0, prompt, 1000, 100.0), request(1, prompt, 1000, 100.5))
    scenario = make_single_gpu_scenario(requests)
    sim = Simulator(scenario, PlacementConfig())
    metrics = sim.run(ModelAwareRoundRobin(sim))
    assert metrics.preemptions >= 1 and metrics.served_requests == 2
    assert metrics.recompute_gpu_s > 0  # the second prefill of the preempted context …
    # … is engine time but not useful time; with nothing lost, the rest is useful
    assert metrics.useful_gpu_s == pytest.approx(metrics.step_gpu_s - metrics.recompute_gpu_s)
    timing = sim.timing(scenario.models[0], scenario.cluster.gpus[0].uuid)
    assert metrics.load_gpu_s == pytest.approx(metrics.loads * timing.weight_load_s())
    figures = metrics.summary(24 * GIB, 1, scenario.duration_s)
    assert float(figures["useful_frac"]) < float(figures["engine_frac"])  # type: ignore[arg-type]
    # a request that never completes adds engine time and no useful time
    lost = dataclasses.replace(scenario, duration_s=110.0)
    sim = Simulator(lost, PlacementConfig())
    cut = sim.run(ModelAwareRoundRobin(sim))
    assert cut.served_requests == 0 and cut.step_gpu_s > 0 and cut.useful_gpu_s == 0


@pytest.mark.unit
def test_an_arrival_joins_the_batch_at_the_next_token_not_the_next_chunk() -> None:
    # A long generation is mid-chunk (32 tokens, ~0.7 s on an A10) when a short one arrives.
    requests = (request(0, 100, 1000, 100.0), request(1, 100, 10, 100.3))
    metrics = run_one(make_single_gpu_scenario(requests), "rr")
    assert metrics.served_requests == 2
    assert metrics.ttft_s[0] < 0.2  # the short one finished first: one cycle + its prefill


@pytest.mark.unit
def test_a_burst_of_long_prompts_is_prefilled_a_token_budget_at_a_time() -> None:
    # Four 3k prompts at once: the first arrival's step takes it alone; the next step prefills
    # two of the rest (6k of the 8k budget) and the last waits a step more. Without the budget
    # the three would share one 9k-token prefill and first tokens (2.83 s each on the A10).
    burst = tuple(request(n, 3000, 50, 100.0) for n in range(4))
    metrics = run_one(make_single_gpu_scenario(burst), "rr")
    assert metrics.served_requests == 4
    first, second, third, fourth = sorted(metrics.ttft_s)
    assert first < second < 2.5 and second == pytest.approx(third)
    assert fourth > third + 1.0


@pytest.mark.unit
def test_max_tokens_admission_reserves_up_front_and_never_preempts() -> None:
    prompt = A10_KV_ROOM // KV_PER_TOKEN // 2 - 600
    requests = (request(0, prompt, 1000, 100.0), request(1, prompt, 1000, 100.5))
    metrics = run_one(make_single_gpu_scenario(requests), "rr", KvAdmission.MAX_TOKENS)
    assert metrics.oom_events == 0 and metrics.preemptions == 0
    assert metrics.served_requests == 2  # the second waited for the first's reservation


@dataclasses.dataclass(frozen=True)
class StatedRequest:
    """A request as its client states it: no actual output length anywhere."""

    request_id: str
    model_name: str
    arrival_s: float
    prompt_tokens: int
    max_tokens: int = MAX_OUTPUT_TOKENS


@pytest.mark.unit
@pytest.mark.parametrize("admission", list(KvAdmission))
def test_admission_never_reads_the_actual_output_length(admission: KvAdmission) -> None:
    # Routing, the watermark check and the engine's admission take a request that has no
    # output_tokens at all: reading it would raise.
    sim = Simulator(make_single_gpu_scenario(()), PlacementConfig(), admission)
    sim.system = system = GearboxSystem(sim)
    system.deploy(sim.scenario.models)
    stated = StatedRequest("chat-7b/0", "chat-7b", 0.0, 500)
    choice = system.route(stated)  # type: ignore[arg-type]
    assert isinstance(choice, Instance)
    sim.now_s = choice.ready_at_s
    choice.waiting.append(Seq(stated, sim.now_s))  # type: ignore[arg-type]
    sim._admit(choice)
    assert [s.request_id for s in choice.running.values()] == [stated.request_id]
    held = choice.running[stated.request_id].kv_tokens
    assert held == admission_tokens(admission, 500, 0, MAX_OUTPUT_TOKENS)


@pytest.mark.unit
def test_context_limit_uses_the_stated_max_tokens_not_the_output() -> None:
    # prompt + actual output fits the engine, prompt + max_tokens does not: refused up front.
    prompt = A10_KV_ROOM // KV_PER_TOKEN - 500
    metrics = run_one(make_single_gpu_scenario((request(0, prompt, 100),)), "rr")
    assert metrics.rejected == {"too_long": 1}


@pytest.mark.unit
@pytest.mark.parametrize("system", ["naive", "rr"])
def test_baselines_size_their_context_limit_as_vllm_does_not_by_our_watermark(system: str) -> None:
    # prompt + max_tokens fits one sequence's KV under vLLM's default 0.9 of the A10 but not
    # under the 0.85 our runtime admits KV to: a baseline's engine (vLLM as shipped) takes it,
    # ours refuses it up front; our knob must not reconfigure their engines.
    scenario = make_single_gpu_scenario(())
    (a10,) = scenario.cluster.gpus
    weights = MODEL_7B_MHA.weight_bytes + GearboxConfig().runtime_overhead_bytes
    room = a10.gpu_class.memory_bytes * (0.85 + 0.9) / 2 - weights
    prompt = int(room // KV_PER_TOKEN) - MAX_OUTPUT_TOKENS
    scenario = dataclasses.replace(scenario, requests=(request(0, prompt, 100),))
    theirs = Simulator(scenario, PlacementConfig(), config=ENGINE_CONFIGS[BASELINE[system]])
    assert "too_long" not in theirs.run(SYSTEMS[system](theirs)).rejected
    # the same engine sized by our config refuses it, as ours does
    assert run_one(scenario, system).rejected == {"too_long": 1}
    assert run_one(scenario, "ours").rejected == {"too_long": 1}


@pytest.mark.unit
def test_ours_throttles_at_the_watermark() -> None:
    # The first long prompt leaves the GPU at ~82 %; a second would pass the 85 % watermark.
    requests = tuple(request(n, 8000, 200) for n in range(3))
    metrics = run_one(make_single_gpu_scenario(requests), "ours", deadline=False)
    assert metrics.oom_events == 0
    assert metrics.rejected == {"throttled_watermark": 2}
    assert metrics.served_requests == 1


def _ours_beside_a_late_8k(other: SimRequest) -> Metrics:
    """Ours on the A10 with an 8k prompt, whose first token takes 2.04 s (past the 2 s TTFT
    SLO), and ``other``: the deadline refuses the 8k, ``other`` is served within the SLOs."""
    metrics = run_one(make_single_gpu_scenario((request(0, 8000, 200), other)), "ours")
    assert metrics.rejected == {"ttft_deadline": 1} and metrics.served_requests == 1
    assert metrics.goodput_requests == 1
    return metrics


@pytest.mark.unit
def test_ours_refuses_at_the_ttft_deadline_but_not_a_request_held_for_a_load() -> None:
    # The runtime's deadline refuses the 8k prompt (its KV goes back) rather than serve it
    # late; a 2k prompt starts in time. A request that arrives while the model is still loading
    # is held for the load and exempt: served, late.
    late = request(0, 8000, 200)
    assert _ours_beside_a_late_8k(request(1, 2000, 200, 110.0)).ttft_s[0] < 2.0
    assert run_one(make_single_gpu_scenario((late,)), "ours", deadline=False).rejected == {}
    loading = run_one(make_single_gpu_scenario((request(2, 500, 50, 0.0),)), "ours")
    assert loading.rejected == {} and loading.served_requests == 1 and loading.ttft_s[0] > 2.0
    for baseline in ("naive", "rr", "vllm"):  # vLLM has no such deadline: served late
        assert run_one(make_single_gpu_scenario((late,)), baseline).rejected == {}


@pytest.mark.unit
def test_ours_does_not_spend_a_prefill_on_a_request_its_deadline_will_refuse() -> None:
    # The runtime's engine drops the 8k prompt when its prefill would start (expired), so the
    # 2k prompt half a second behind starts at once; prefilling the 8k first would hold the GPU
    # until the deadline refused it, and the 2k's first token would come after 2 s.
    assert _ours_beside_a_late_8k(request(1, 2000, 200, 100.5)).ttft_s[0] < 1.0


@pytest.mark.unit
def test_ours_waits_for_memory_only_while_a_request_can_start_in_time() -> None:
    # As above; the default wait (half the 2 s TTFT SLO) is shorter than an 8k prompt's first
    # token on the A10 (2.04 s), so there no request waits. Given longer, the two refused above
    # wait for the first to finish (~10.4 s each), in arrival order, never past the watermark.
    scenario = make_single_gpu_scenario(tuple(request(n, 8000, 200) for n in range(3)))

    def ours(wait_s: float) -> Metrics:
        sim = Simulator(scenario, PlacementConfig())
        return sim.run(GearboxSystem(sim, memory_wait_s=wait_s, ttft_deadline=0.0))

    waited = ours(30.0)
    assert waited.rejected == {} and waited.served_requests == 3 and waited.oom_events == 0
    assert waited.ttft_s == sorted(waited.ttft_s) and waited.ttft_s[2] > 20.0
    bounded = ours(20.0)  # the third could start only past its wait: refused then
    assert bounded.rejected == {"throttled_watermark": 1} and bounded.served_requests == 2


@pytest.mark.unit
def test_vllm_like_keeps_kv_in_its_private_pool() -> None:
    # Two long prompts fit the GPU's free memory but not the 90 % pool: the second waits.
    requests = tuple(request(n, 7000, 200, 100.0 + n / 10) for n in range(2))
    scenario = make_single_gpu_scenario(requests)
    sim = Simulator(scenario, PlacementConfig())
    metrics = sim.run(VllmLikeSystem(sim))
    (inst,) = sim.instances.values()
    assert inst.kv_pool_bytes is not None
    assert 0 < inst.kv_pool_bytes < A10_KV_ROOM
    assert metrics.served_requests == 2 and metrics.oom_events == 0
    assert metrics.loads == 1 and metrics.evictions == 0


@pytest.mark.unit
def test_naive_round_robin_loads_the_model_where_the_request_lands() -> None:
    scenario = build_scenario(3, 300.0)
    sim = Simulator(scenario, PlacementConfig())
    metrics = sim.run(NaiveRoundRobin(sim))
    live = sum(m.replicas for m in scenario.models if m.traffic.active_from_s <= 0.0)
    assert metrics.loads > 2 * live  # the cycle, not the model, picks the GPU
    assert metrics.evicted_with_active == 0


@pytest.mark.unit
def test_json_line_matches_results_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "multimodel.json"
    argv = ["--scenario", "fits", "--seed", "2", "--seeds", "1", "--duration-s", "600"]
    code = main([*argv, "--out", str(out)])
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == (1 if last["missed"] else 0)
    assert last["admission"] == "incremental" and last["scenario"] == "fits"
    required = {
        "oom_ours",
        "goodput_util_ratio_vs_naive_rr",
        "goodput_util_ratio_vs_model_aware_rr",
        "goodput_ratio_vs_vllm_like",
        "dead_memory_frac_ours",
        "evicted_with_active",
        "calibration_ms",
    }
    assert required <= set(last)
    reported = {
        "util_ratio_vs_naive_rr_median",
        "util_ratio_vs_model_aware_rr_median",
        "useful_util_ratio_vs_naive_rr_median",
        "useful_util_ratio_vs_model_aware_rr_median",
    }
    definitions = {"busy_frac", "useful_frac", "goodput_tok_per_gpu_s"}
    assert reported <= set(last) and definitions <= set(last["definitions"])
    assert set(last["targets"]) == {f for f in required if f != "calibration_ms"}  # no new target
    del last["wall_s"], last["calibration_ms"]
    written = json.loads(out.read_text())
    assert last == written["summary"]
    assert results_text(written) == out.read_text()


@pytest.mark.unit
def test_metric_helpers() -> None:
    assert union_length_s([(0.0, 2.0), (1.0, 3.0), (5.0, 6.0)]) == pytest.approx(4.0)
    assert union_length_s([]) == 0.0
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([], 95) == 0.0


@pytest.mark.unit
def test_goodput_utilisation_counts_delivered_tokens_not_gpu_time() -> None:
    thin, packed = Metrics(goodput_tokens=3600), Metrics(goodput_tokens=3600)
    thin.busy = {"g0": [(0.0, 90.0)], "g1": [(0.0, 90.0)]}  # the same work, spread thin
    packed.busy = {"g0": [(0.0, 60.0)]}
    figures = [m.summary(48 * GIB, 2, 100.0) for m in (thin, packed)]
    assert figures[0]["busy_frac"] == pytest.approx(0.9)
    assert figures[1]["busy_frac"] == pytest.approx(0.3)
    assert figures[0]["goodput_tok_per_gpu_s"] == figures[1]["goodput_tok_per_gpu_s"] == 18.0


@pytest.mark.unit
def test_farm_catalogue_does_not_fit_statically() -> None:
    scenario = build_farm(7, 600.0)
    config = GearboxConfig()
    big_cards = [g for g in scenario.cluster.gpus if g.total_memory_bytes >= 80 * GIB]
    mid = max(g.total_memory_bytes for g in scenario.cluster.gpus if g not in big_cards)
    weights = [m.spec.weight_bytes + config.runtime_overhead_bytes for m in scenario.models]
    assert sum(w > mid for w in weights) > len(big_cards)  # more 80 GB-only models than cards
    cap = GPU_MEMORY_UTILIZATION * sum(g.total_memory_bytes for g in scenario.cluster.gpus)
    assert sum(weights) > cap
    sizes = sorted(m.spec.weight_bytes for m in scenario.models)
    assert sizes[0] < GIB and sizes[-1] > 60 * GIB
    sim = Simulator(scenario, PlacementConfig())
    sim.run(VllmLikeSystem(sim))
    placed = {i.profile.name for i in sim.instances.values()}
    assert len(placed) < len(scenario.models)  # the static plan leaves models without a home


@pytest.mark.unit
def test_farm_popularity_is_heavy_tailed_shifts_and_silences_models() -> None:
    scenario = build_farm(7, 2 * PHASE_S)
    assert scenario == build_farm(7, 2 * PHASE_S)
    assert scenario.requests != build_farm(8, 2 * PHASE_S).requests
    assert len(scenario.popularity) == 2
    assert all(len(p) == ACTIVE_MODELS < len(scenario.models) for p in scenario.popularity)
    assert scenario.popularity[0] != scenario.popularity[1]
    for phase, active in enumerate(scenario.popularity):
        inside = [
            r for r in scenario.requests if phase * PHASE_S <= r.arrival_s < (phase + 1) * PHASE_S
        ]
        counts = {name: sum(r.model_name == name for r in inside) for name in active}
        assert {r.model_name for r in inside} <= set(active)  # silent models get nothing
        assert counts[active[0]] > 5 * counts[active[-1]]  # rank 1 vs rank 20 under Zipf(1.1)


@pytest.mark.unit
def test_farm_load_is_around_capacity_and_encoders_stay_short() -> None:
    scenario = build_farm(9)
    assert len(scenario.cluster.gpus) == len(make_farm_cluster().gpus) == 12
    load = offered_gpu_load(scenario, GearboxConfig())
    assert 0.8 * FARM_LOAD < load < 1.2 * FARM_LOAD
    assert offered_gpu_load(build_scenario(9, 1800.0), GearboxConfig()) < 0.6 * load
    encoders = [r for r in scenario.requests if r.model_name.startswith("cls-")]
    assert encoders and all(r.prompt_tokens <= ENCODER_MAX_TOKENS for r in encoders)
    assert all(r.max_tokens == 1 == r.output_tokens and not r.long_prompt for r in encoders)
    assert any(r.long_prompt for r in scenario.requests)


@pytest.mark.unit
def test_default_run_covers_both_scenarios(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["--seed", "3", "--seeds", "1", "--duration-s", "300", "--out", "-"])
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(last["scenarios"]) == {"fits", "farm"}
    assert last["scenarios"]["farm"]["scenario"] == "farm"
    missed = [f"{n}:{f}" for n, s in last["scenarios"].items() for f in s["missed"]]
    assert sorted(last["missed"]) == sorted(missed) and code == (1 if missed else 0)
    with pytest.raises(SystemExit):
        main(["--seeds", "1", "--duration-s", "300", "--out", "somewhere.json"])


def make_two_gpu_scenario(requests: tuple[SimRequest, ...]) -> Scenario:
    """Two A10 24 GB on two nodes, one 7B model with one catalogue replica."""
    cluster = make_cluster()
    a10s = tuple(g for g in cluster.gpus if g.gpu_class.name == "a10-24g")
    two = tuple(dataclasses.replace(g, node=f"n{i}") for i, g in enumerate(a10s[:2]))
    traffic = TrafficProfile(0.0, 0.0, 600.0, 120.0, 600, 200, 0.0)
    model = ModelProfile("chat-7b", MODEL_7B_MHA, 1, 4, 2048, traffic)
    return Scenario(0, 600.0, dataclasses.replace(cluster, gpus=two), (model,), (), requests)


@pytest.mark.unit
def test_ours_scales_out_a_model_its_replica_refuses_and_gives_the_extra_back_idle() -> None:
    # long prompts every 2 s for two minutes: one replica's GPU hits the watermark (429s)
    flood = tuple(request(n, 6000, 300, arrival_s=100.0 + 2.0 * n) for n in range(60))
    scenario = make_two_gpu_scenario(flood)
    sim = Simulator(scenario, PlacementConfig(cold_after_s=120.0))
    system = GearboxSystem(sim)
    metrics = sim.run(system)
    assert metrics.scale_outs == 1  # one more replica, on the other GPU …
    outs = [v for v in system.verdicts if v.action.value == "scale_out"]
    assert "refused" in outs[0].explanation and len(outs[0].gpu_uuids) == 2
    assert metrics.scale_ins == 1  # … given back once idle, never below the catalogue's one
    assert metrics.evicted_with_active == 0 and metrics.oom_events == 0
    one = Simulator(scenario, PlacementConfig(cold_after_s=120.0, max_replicas_per_model=1))
    fixed = one.run(GearboxSystem(one))  # the same system held at one replica
    assert fixed.scale_outs == 0
    assert metrics.goodput_requests > fixed.goodput_requests  # the second GPU served


@pytest.mark.unit
def test_ours_views_a_model_the_displace_rule_unloaded_as_made_room_for_until_it_loads() -> None:
    # as the live plan state keeps its last decision's: whom the displacement was for, read by
    # the round while the model is cold (gearbox.residency gives that room to it first)
    sim = Simulator(make_single_gpu_scenario(()), PlacementConfig())
    sim.system = system = GearboxSystem(sim)
    system.deploy(sim.scenario.models)
    (inst,) = sim.instances_of("chat-7b")
    profile = inst.profile
    system._displacing[inst.iid] = (sim.now_s + 60.0, "other")
    sim.evict(inst)
    view = system._view(profile, False)
    assert (view.state, view.evicting_for) == (Residency.COLD, "other")
    sim.load(profile, inst.gpu_uuid)
    assert system._view(profile, False).evicting_for is None


@pytest.mark.unit
def test_snapshot_reads_a_gpu_busy_as_nvml_does_not_by_batch_size() -> None:
    # one sequence decoding nonstop keeps the GPU busy (NVML, as the live stream reads it),
    # though it fills one slot of 32; once it is done the GPU reads idle
    readings: list[tuple[float, float]] = []

    class Watching(ModelAwareRoundRobin):
        def on_tick(self) -> None:
            (gpu,) = self.sim.snapshot().gpus
            readings.append((self.sim.now_s, gpu.utilisation))

    sim = Simulator(make_single_gpu_scenario((request(0, 100, 3000),)), PlacementConfig())
    metrics = sim.run(Watching(sim))
    assert metrics.served_requests == 1
    during = [u for t, u in readings if 105.0 <= t < 100.0 + metrics.latency_s[0] - 1.0]
    assert during and min(during) > 0.9
    assert readings[-1][1] == 0.0 and readings[0][1] == 0.0


@pytest.mark.unit
def test_ours_unloads_a_displaced_replica_when_its_last_request_ends_not_at_the_next_tick() -> None:
    # as the runtime's executor does, which checks for the idle moment every 20 ms: displaced at
    # the 100-s tick, busy with one request until ~102 s, unloaded then (the next tick is 105 s)
    unloaded_s: list[float] = []

    class Displacing(GearboxSystem):
        def on_tick(self) -> None:
            super().on_tick()
            if self.sim.now_s == 100.0:
                (inst,) = self.sim.instances_of("chat-7b")
                self._displacing[inst.iid] = (self.sim.now_s + 60.0, "other")

        def on_unloaded(self, instance: Instance) -> None:
            unloaded_s.append(self.sim.now_s)
            super().on_unloaded(instance)

    sim = Simulator(make_single_gpu_scenario((request(0, 100, 60, 100.5),)), PlacementConfig())
    metrics = sim.run(Displacing(sim))
    assert metrics.served_requests == 1 and metrics.evicted_with_active == 0
    finished_s = 100.5 + metrics.latency_s[0]
    assert unloaded_s and unloaded_s[0] == pytest.approx(finished_s)
    assert unloaded_s[0] < 105.0


def make_shared_h100_scenario() -> Scenario:
    """One H100 80 GB, two 7B models: chat-7b with long prompts, quiet-7b asked for nothing."""
    cluster = make_cluster()
    h100 = next(g for g in cluster.gpus if g.gpu_class.name != "a10-24g")
    traffic = TrafficProfile(0.0, 0.0, 600.0, 120.0, 2000, 600, 0.0)
    models = tuple(ModelProfile(n, MODEL_7B_MHA, 1, 4, 2048, traffic) for n in ("chat-7b", "q"))
    return Scenario(0, 400.0, dataclasses.replace(cluster, gpus=(h100,)), models, (), ())


@pytest.mark.unit
def test_ours_lets_a_long_prompt_use_kv_room_a_quiet_neighbour_does_not_use() -> None:
    # both 7Bs resident (2 × 14.6 GiB of the watermark's 68 GiB); chat-7b already holds 40k
    # tokens of KV (19.5 GiB), and one more prompt of 16k tokens (7.8 GiB) fits under the
    # watermark (61.9 GiB). By default a replica's floor is its weights
    # (placement.kv_floor_batch = 0); with the footprint's batch as a floor, q's unused
    # 1.3 × 8 × 2,600 tokens of KV (13.2 GiB) are held against it and it is refused.
    def route(config: PlacementConfig) -> object:
        sim = Simulator(make_shared_h100_scenario(), config)
        sim.system = system = GearboxSystem(sim, memory_wait_s=0.0)
        (gpu,) = sim.gpus
        chat, _ = (sim.load(p, gpu) for p in sim.profiles.values())
        assert chat is not None
        running = Seq(request(0, 40_000, 100), 0.0)
        assert sim._grow(chat, running, 40_000)
        chat.running[running.request_id] = running
        sim.now_s = 100.0  # both loaded
        return system.route(request(1, 16_000, 100))

    assert isinstance(route(PlacementConfig()), Instance)
    assert route(PlacementConfig(kv_floor_batch=8)) == "throttled_watermark"

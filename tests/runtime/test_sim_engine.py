"""Unit: the simulated engine — cost-model timing, per-token KV against memory, faults."""

from __future__ import annotations

import dataclasses
import random

import pytest

from gearbox.config import DEFAULT_CONFIG, GearboxConfig
from gearbox.cost import replica_capacity
from gearbox.presets import MODEL_7B_MHA
from runtime.engine.base import EngineFault, SeqSpec, SeqState
from runtime.engine.sim import SimEngine
from runtime.engine.simgpu import SimGpuPool
from runtime.timing import ReplicaTiming
from tests.runtime.builders import make_replica
from tests.runtime.test_sim_engine_oracle import next_prompt_after_a_dropped_pass

pytestmark = pytest.mark.unit


WHOLE = dataclasses.replace(DEFAULT_CONFIG, prefill_chunk_tbt_share=0.0)


def _engine(
    gpus: tuple[str, ...] = ("G0",),
    pool: SimGpuPool | None = None,
    gpu_class: str = "h100-sxm",
    config: GearboxConfig = DEFAULT_CONFIG,
) -> tuple[SimEngine, SimGpuPool, ReplicaTiming]:
    timing = ReplicaTiming.build(make_replica(gpus, gpu_class=gpu_class), MODEL_7B_MHA, config)
    pool = pool or SimGpuPool()
    engine = SimEngine(timing, pool)
    for i in range(len(timing.plan.stages)):
        assert engine.load_shard(i, 0.0).ok
    ready = engine.build_comm_groups(0.0)
    assert ready.ok
    assert not engine.is_ready(ready.ready_at_s - 1e-6) and engine.is_ready(ready.ready_at_s)
    engine.step(ready.ready_at_s)
    return engine, pool, timing


def test_loading_takes_the_weight_load_time_plus_comm_setup() -> None:
    timing = ReplicaTiming.build(make_replica(["G0"]), MODEL_7B_MHA, DEFAULT_CONFIG)
    engine = SimEngine(timing, SimGpuPool())
    assert engine.load_shard(0, 10.0).ready_at_s == pytest.approx(10.0 + timing.weight_load_s())
    ready = engine.build_comm_groups(10.0).ready_at_s
    assert ready == pytest.approx(10.0 + timing.weight_load_s() + DEFAULT_CONFIG.comm_setup_s)


def test_iterations_are_timed_by_gearbox_cost_model() -> None:
    engine, _, timing = _engine()
    t0 = 100.0
    assert engine.admit(SeqSpec("s", 1000, 3), t0) is None
    out = engine.step(t0 + 10.0)
    assert out.first_tokens[0].t_s == pytest.approx(t0 + timing.prefill_s(1000))
    step = timing.decode_cycle_s(1, 1001)
    assert out.finished[0].t_s == pytest.approx(t0 + timing.prefill_s(1000) + 2 * step, rel=1e-3)
    assert out.finished[0].output_tokens == 3
    assert engine.is_drained() and engine.kv_bytes() == 0


def test_a_prompt_whose_first_token_would_miss_its_due_time_is_dropped_unprefilled() -> None:
    engine, _, timing = _engine(config=WHOLE)
    t0 = 100.0
    first_s = timing.prefill_s(1000) + timing.decode_cycle_s(1, 1000)  # alone, a lower bound
    engine.admit(SeqSpec("ahead", 1000, 3), t0)
    # behind "ahead"'s prefill in the same iteration, it could start no sooner than t0 + that
    engine.admit(SeqSpec("late", 1000, 3, first_token_due_s=t0 + first_s + 1e-3), t0)
    engine.admit(SeqSpec("in-time", 10, 3, first_token_due_s=t0 + 10.0), t0)
    out = engine.step(t0 + 10.0)
    assert out.expired == ("late",)
    assert {f.seq_id for f in out.first_tokens} == {"ahead", "in-time"}
    assert out.prefill_tokens == 1010 and engine.is_drained() and engine.kv_bytes() == 0


def test_a_prompt_dropped_while_its_prefill_is_under_way_does_not_give_its_time_back() -> None:
    """A GPU cannot take back a forward pass it began: the next prompt starts after it."""
    engine, _, timing = _engine(config=WHOLE)
    first, long_s = next_prompt_after_a_dropped_pass(engine)
    assert first.t_s == pytest.approx(100.0 + long_s + timing.prefill_s(10))
    assert engine.stats.busy_s > long_s  # the dropped prompt's pass counts as busy time


def test_a_long_prompt_is_prefilled_in_chunks_beside_the_running_batch() -> None:
    """Chunked prefill: a prompt longer than the replica's chunk spans several iterations, each
    also decoding the running batch, so no decode step waits on the whole prompt."""
    engine, _, timing = _engine(gpu_class="a100-80g")  # chunked by default
    chunk = timing.prefill_chunk_tokens
    assert 0 < chunk < 4000
    t0 = 100.0
    engine.admit(SeqSpec("chat", 100, 200), t0)
    first = engine.step(t0 + 1.0)  # the chat sequence is decoding
    assert [f.seq_id for f in first.first_tokens] == ["chat"]
    engine.admit(SeqSpec("long", 4000, 2), t0 + 1.0)
    out = engine.step(t0 + 10.0)
    steps = -(-4000 // chunk)
    chunk_s = timing.prefill_s(4000) * chunk / 4000
    # every iteration carrying a chunk also decodes the chat sequence in the same forward
    # pass: a chunk plus one decode token's compute, not a chunk plus a whole decode step
    fused = timing.prefill_s(1)
    longest = max(out.decode_step_s)
    assert longest <= chunk_s + fused + 1e-9
    assert longest < chunk_s + timing.decode_cycle_s(1, 100)
    assert longest < timing.prefill_s(4000)
    # the long prompt's first token comes after all its chunks, each carrying a decode token
    ttft = next(f.t_s for f in out.first_tokens if f.seq_id == "long") - (t0 + 1.0)
    in_progress = timing.decode_cycle_s(1, 400)  # the chat iteration it arrived during
    assert timing.prefill_s(4000) <= ttft <= timing.prefill_s(4000) + steps * fused + in_progress
    assert out.prefill_tokens == 4000


def test_an_iteration_with_a_prompt_decodes_the_batch_in_the_same_forward_pass() -> None:
    """Fused iterations: a whole prompt's iteration also advances the running batch, taking
    the longer of the prompt's prefill (plus the decode tokens' compute) and the decode step."""
    engine, _, timing = _engine(gpu_class="a100-80g", config=WHOLE)
    t0 = 100.0
    engine.admit(SeqSpec("chat", 100, 500), t0)
    engine.step(t0 + 0.5)  # the chat sequence is decoding
    engine.admit(SeqSpec("prompt", 2000, 2), t0 + 0.5)
    out = engine.step(t0 + 5.0)
    mixed = max(out.decode_step_s)
    prefill, step = timing.prefill_s(2000), timing.decode_cycle_s(1, 150)
    assert mixed == pytest.approx(prefill + timing.prefill_s(1))
    assert mixed < prefill + step  # an unfused iteration would pay both


def test_a_saturated_fused_engine_serves_more_than_the_unfused_sum() -> None:
    """Kept full (a new request whenever a slot frees), the engine fuses each prompt's prefill
    with a decode step, so it completes more requests a second than prefill plus decode time
    would allow; gearbox's capacity (gearbox.cost) is what it serves, within 10 % (spreading each
    prompt's prefill over the decode-only iterations too said 11.4 rps, 40 % over)."""
    replica = make_replica(("G0",), gpu_class="a100-80g")
    timing = ReplicaTiming.build(replica, MODEL_7B_MHA, DEFAULT_CONFIG)
    capacity = replica_capacity(timing.shape, MODEL_7B_MHA, 800, 200, DEFAULT_CONFIG)
    engine = SimEngine(timing, SimGpuPool(), max_batch=capacity.max_batch)
    engine.load_shard(0, 0.0)
    engine.build_comm_groups(0.0)
    rng = random.Random(3)
    now, admitted, finished = 1.0, 0, []
    while now < 200.0:
        while engine.has_capacity():
            prompt = max(1, int(rng.expovariate(1 / 800)))
            output = max(1, int(rng.expovariate(1 / 200)))
            engine.admit(SeqSpec(f"s{admitted}", prompt, output), now)
            admitted += 1
        finished += [f.t_s for f in engine.step(now).finished]
        now += 0.005
    served_rps = sum(1 for t in finished if t >= 50.0) / 150.0
    step_s = timing.decode_cycle_s(capacity.max_batch, 900)
    unfused_rps = 1.0 / (timing.prefill_s(800) + 200 * step_s / capacity.max_batch)
    assert served_rps > 1.15 * unfused_rps
    assert served_rps == pytest.approx(capacity.capacity_rps, rel=0.1)


def test_a_sequence_never_starts_before_it_was_admitted() -> None:
    engine, _, timing = _engine()
    engine.step(50.0)
    engine.admit(SeqSpec("late", 200, 1), 80.0)
    out = engine.step(90.0)
    assert out.first_tokens[0].t_s == pytest.approx(80.0 + timing.prefill_s(200))


def test_kv_is_allocated_per_token_against_the_gpu_memory_limit() -> None:
    engine, pool, timing = _engine(gpu_class="l40s")  # 48 GB: 7B weights leave ~30 GB of KV
    per_token = timing.kv_bytes_per_token_per_gpu["G0"]
    before = pool.used_bytes("G0")
    engine.admit(SeqSpec("one", 1000, 5000), 10.0)
    engine.step(10.5)
    assert pool.used_bytes("G0") - before >= 1000 * per_token
    # Bypassing admission control, long prompts overrun the GPU: the engine refuses the KV.
    for i in range(40):
        engine.admit(SeqSpec(f"long{i}", 8000, 2000), 11.0)
    out = engine.step(60.0)
    assert pool.oom_events > 0
    assert {f.fault for f in out.failed} == {EngineFault.OUT_OF_MEMORY}
    assert pool.used_bytes("G0") <= pool.total_bytes("G0")


def test_a_lost_gpu_kills_the_engine_and_frees_its_memory() -> None:
    pool = SimGpuPool()
    engine, _, _ = _engine(("G0", "G1"), pool)
    engine.admit(SeqSpec("a", 500, 100), 10.0)
    engine.step(10.2)
    pool.preempt(["G1"])
    assert engine.health() is EngineFault.GPU_LOST
    assert pool.used_bytes("G0") == 0  # weights and KV gone with the process
    assert engine.admit(SeqSpec("b", 10, 1), 11.0) is EngineFault.GPU_LOST
    assert engine.load_shard(0, 11.0).fault is EngineFault.GPU_LOST


def test_export_import_is_copy_then_commit() -> None:
    pool = SimGpuPool()
    src, _, _ = _engine(("G0",), pool)
    dst, _, _ = _engine(("G1",), pool)
    src.admit(SeqSpec("m", 2000, 500), 10.0)
    src.step(11.0)
    exports = src.export_kv(["m"], 11.0)
    assert exports and exports[0].spec.generated_tokens > 0
    paused = {p.seq_id: p.state for p in src.progress()}
    assert paused["m"] is SeqState.PAUSED
    generated = exports[0].spec.generated_tokens
    src.step(12.0)  # a paused sequence does not advance
    assert src.progress()[0].generated_tokens == generated
    assert dst.import_kv(exports, 12.0, transfer_s=0.5).ok
    assert not dst.staged_ready(["m"], 12.2) and dst.staged_ready(["m"], 12.5)
    dst.activate(["m"])
    src.drop(["m"])
    assert src.kv_bytes() == 0
    out = dst.step(40.0)
    assert out.finished and out.finished[0].output_tokens == 500


def test_abandoned_hand_over_resumes_at_the_source() -> None:
    src, _, _ = _engine()
    src.admit(SeqSpec("m", 100, 500), 10.0)
    src.step(10.5)
    assert src.progress()[0].state is SeqState.RUNNING
    src.export_kv(["m"], 10.5)
    src.resume(["m"])
    assert src.step(30.0).finished[0].seq_id == "m"


def test_a_replay_is_held_after_prefill_until_activated() -> None:
    engine, _, _ = _engine()
    engine.admit(SeqSpec("r", 700, 40, generated_tokens=10), 10.0, staged=True)
    engine.step(11.0)
    assert engine.staged_ready(["r"], 11.0)
    assert engine.progress()[0].generated_tokens == 10  # nothing generated while staged
    engine.activate(["r"])
    assert engine.step(30.0).finished[0].output_tokens == 40


def test_injected_load_failures_surface_as_faults() -> None:
    pool = SimGpuPool()
    pool.fail_loads(["G0"])
    timing = ReplicaTiming.build(make_replica(["G0"]), MODEL_7B_MHA, DEFAULT_CONFIG)
    assert SimEngine(timing, pool).load_shard(0, 0.0).fault is EngineFault.LOAD_FAILED
    pool.fail_loads(["G0"], failing=False)
    assert SimEngine(timing, pool).load_shard(0, 0.0).ok


def test_draining_refuses_new_sequences_but_finishes_its_own() -> None:
    engine, _, _ = _engine()
    engine.admit(SeqSpec("a", 100, 5), 10.0)
    engine.close_admission()
    assert engine.admit(SeqSpec("b", 100, 5), 10.0) is EngineFault.DRAINING
    engine.step(20.0)
    assert engine.is_drained()

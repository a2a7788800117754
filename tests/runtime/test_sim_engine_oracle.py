"""Unit: the event-stepped SimEngine reproduces a token-by-token oracle (one ledger, checked).

The product's engine and :class:`tests.runtime.token_engine.TokenSimEngine` get the same replica
timing, the same admissions and the same ``step`` calls at irregular times; every first token
and every finish must come out at the same simulated time with the same token count, including
sequences paused for a hand-over and resumed, and dropped.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
from collections import Counter
from dataclasses import dataclass, field

import pytest

from gearbox import DEFAULT_CONFIG, GearboxConfig, ModelSpec
from gearbox.plans import ExecutionPlan, StageRole
from gearbox.presets import LINK_CLASSES, MODEL_7B_MHA, MODEL_70B_GQA
from runtime.engine.base import Engine, FirstToken, SeqSpec, SeqState
from runtime.engine.sim import SimEngine
from runtime.engine.simgpu import SimGpuPool
from runtime.timing import ReplicaTiming
from tests.gearbox.builders import make_stage
from tests.runtime.builders import make_replica
from tests.runtime.token_engine import TokenSimEngine

pytestmark = pytest.mark.unit


@dataclass
class Outcome:
    """What an engine reported."""

    first: dict[str, float] = field(default_factory=dict)
    finished: dict[str, tuple[float, int]] = field(default_factory=dict)
    kv_bytes: list[int] = field(default_factory=list)
    tbt: Counter[float] = field(default_factory=Counter)  # decode iterations by duration


WHOLE = dataclasses.replace(DEFAULT_CONFIG, prefill_chunk_tbt_share=0.0)


def make_timing(
    model: ModelSpec, gpus: int, gpu_class: str, config: GearboxConfig = DEFAULT_CONFIG
) -> ReplicaTiming:
    replica = make_replica([f"g{i}" for i in range(gpus)], model=model, gpu_class=gpu_class)
    return ReplicaTiming.build(replica, model, config)


def make_split_timing(model: ModelSpec) -> ReplicaTiming:
    """The bench's split replica: prefill TP2 on H100, decode TP8 on A100, over RDMA."""
    layers = (0, model.num_layers)
    prefill = make_stage(("p0", "p1"), layers, role=StageRole.PREFILL)
    decode = make_stage(
        tuple(f"d{i}" for i in range(8)),
        layers,
        block_id="blk-b",
        domain_id="B",
        role=StageRole.DECODE,
        gpu_class="a100-80g",
    )
    replica = ExecutionPlan(model.name, (prefill, decode), None, LINK_CLASSES["rdma"])
    return ReplicaTiming.build(replica, model, DEFAULT_CONFIG)


def make_requests(seed: int, rps: float, count: int) -> list[tuple[float, SeqSpec]]:
    rng = random.Random(seed)
    t_s, out = 1.0, []
    for i in range(count):
        t_s += rng.expovariate(rps)
        prompt = max(1, int(rng.expovariate(1 / 900)))
        output = max(1, int(rng.expovariate(1 / 150)))
        out.append((t_s, SeqSpec(f"r{i}", prompt, output)))
    return out


def drive(engine: Engine, requests: list[tuple[float, SeqSpec]], seed: int) -> Outcome:
    """Admit when capacity allows, step at random times, pause/resume and drop a few."""
    rng = random.Random(seed)
    for index in range(len(engine.timing.plan.stages)):  # type: ignore[attr-defined]
        engine.load_shard(index, 0.0)
    engine.build_comm_groups(0.0)
    out, queue, now, i = Outcome(), list(requests), 0.0, 0
    end = requests[-1][0] + 120.0
    while now < end:
        now = round(now + rng.choice((0.004, 0.03, 0.11, 0.5)), 6)
        while queue and queue[0][0] <= now and engine.has_capacity():
            engine.admit(queue.pop(0)[1], now)
        i += 1
        if i % 97 == 0:  # a hand-over that is abandoned: pause, then resume
            running = [p.seq_id for p in engine.progress() if p.state.value == "running"]
            engine.export_kv(running[:2], now)
            engine.resume(running[:2])
        if i % 211 == 0:  # a sequence dropped (e.g. moved away)
            held = [p.seq_id for p in engine.progress()]
            engine.drop(held[:1])
        if i % 13 == 0:  # a prompt refused, perhaps while its prefill is under way
            waiting = [p.seq_id for p in engine.progress() if p.state is SeqState.WAITING]
            engine.drop(waiting[-1:])
        step = engine.step(now)
        out.first.update({f.seq_id: f.t_s for f in step.first_tokens})
        out.finished.update({f.seq_id: (f.t_s, f.output_tokens) for f in step.finished})
        out.kv_bytes.append(engine.kv_bytes())
        runs = step.decode_step_runs or (1,) * len(step.decode_step_s)
        for step_s, count in zip(step.decode_step_s, runs, strict=True):
            out.tbt[round(step_s, 9)] += count
    return out


@pytest.mark.parametrize(
    ("model", "gpus", "gpu_class", "rps", "config"),
    [
        (MODEL_7B_MHA, 1, "a100-80g", 3.0, WHOLE),
        (MODEL_70B_GQA, 4, "h100-sxm", 4.0, WHOLE),
        # chunked prefill: most prompts here are longer than the chunk (~800 / ~1,000 tokens)
        (MODEL_7B_MHA, 1, "a100-80g", 3.0, DEFAULT_CONFIG),
        (MODEL_70B_GQA, 4, "h100-sxm", 4.0, DEFAULT_CONFIG),
    ],
)
def test_event_engine_matches_sim_engine(
    model: ModelSpec, gpus: int, gpu_class: str, rps: float, config: GearboxConfig
) -> None:
    timing = make_timing(model, gpus, gpu_class, config)
    assert (timing.prefill_chunk_tokens > 0) is (config is DEFAULT_CONFIG)
    requests = make_requests(seed=11, rps=rps, count=400)
    reference = drive(TokenSimEngine(timing, SimGpuPool()), requests, seed=5)
    fast = drive(SimEngine(timing, SimGpuPool()), requests, seed=5)
    assert reference.first.keys() == fast.first.keys()
    assert reference.finished.keys() == fast.finished.keys()
    assert len(reference.finished) > 300
    for sid, t_s in reference.first.items():
        assert fast.first[sid] == pytest.approx(t_s, abs=1e-6)
    for sid, (t_s, tokens) in reference.finished.items():
        assert fast.finished[sid][0] == pytest.approx(t_s, abs=1e-6)
        assert fast.finished[sid][1] == tokens
    assert fast.kv_bytes == reference.kv_bytes
    # every decode iteration is reported, a run of them as one entry standing for its length
    assert fast.tbt == reference.tbt


def test_event_engine_matches_sim_engine_on_a_split_replica() -> None:
    timing = make_split_timing(MODEL_70B_GQA)
    requests = make_requests(seed=13, rps=6.0, count=400)
    reference = drive(TokenSimEngine(timing, SimGpuPool()), requests, seed=7)
    fast = drive(SimEngine(timing, SimGpuPool()), requests, seed=7)
    assert reference.first.keys() == fast.first.keys()
    assert reference.finished.keys() == fast.finished.keys()
    assert len(reference.finished) > 300
    for sid, t_s in reference.first.items():
        assert fast.first[sid] == pytest.approx(t_s, abs=1e-6)
    for sid, (t_s, tokens) in reference.finished.items():
        assert fast.finished[sid][0] == pytest.approx(t_s, abs=1e-6)
        assert fast.finished[sid][1] == tokens
    assert fast.kv_bytes == reference.kv_bytes


def ready_split_engine(
    engine_cls: type[SimEngine] | type[TokenSimEngine],
) -> SimEngine | TokenSimEngine:
    """An engine of ``engine_cls`` on the bench's split replica, loaded and connected at 0."""
    timing = make_split_timing(MODEL_70B_GQA)
    engine = engine_cls(timing, SimGpuPool())
    for index in range(len(timing.plan.stages)):
        engine.load_shard(index, 0.0)
    engine.build_comm_groups(0.0)
    return engine


@pytest.mark.parametrize("engine_cls", [TokenSimEngine, SimEngine])
def test_split_replica_decodes_while_it_prefills(
    engine_cls: type[SimEngine] | type[TokenSimEngine],
) -> None:
    """Prefill and decode stages are different GPUs: decode steps never wait for prefills, and
    prefill batches run back to back on their own stage (finding 2 of the bench report)."""
    engine = ready_split_engine(engine_cls)
    for i in range(64):
        engine.admit(SeqSpec(f"r{i}", 2000, 400), 0.0)
    steps: list[float] = []
    firsts: dict[str, float] = {}
    now = 0.0
    while now < 120.0:
        now += 0.25
        out = engine.step(now)
        steps.extend(out.decode_step_s)
        firsts.update({f.seq_id: f.t_s for f in out.first_tokens})
    timing = engine.timing
    longest_step = timing.decode_cycle_s(64, 2400.0)
    assert steps and max(steps) <= longest_step + 1e-9  # no prefill inside a decode step
    batch_s = 4 * timing.prefill_s(2000)  # 4 prompts of 2,000 tokens fit the 8,192 budget
    ends = sorted(set(firsts.values()))
    assert len(firsts) == 64 and len(ends) == 16
    for a, b in itertools.pairwise(ends):
        assert batch_s - 1e-9 <= b - a <= batch_s + longest_step + 1e-9


def next_prompt_after_a_dropped_pass(
    engine: SimEngine | TokenSimEngine, t0: float = 100.0
) -> tuple[FirstToken, float]:
    """A doomed 8k prompt admitted at ``t0`` and dropped half way through its prefill, then a
    10-token prompt: the latter's first token, and the 8k prompt's prefill time."""
    long_s = engine.timing.prefill_s(8000)
    engine.admit(SeqSpec("doomed", 8000, 3), t0)
    engine.step(t0)  # its prefill starts
    assert engine.step(t0 + long_s / 2).first_tokens == ()  # and is half done
    engine.drop(["doomed"])
    engine.admit(SeqSpec("next", 10, 3), t0 + long_s / 2)
    [first] = engine.step(t0 + 2 * long_s).first_tokens
    assert first.seq_id == "next"
    return first, long_s


@pytest.mark.parametrize("engine_cls", [TokenSimEngine, SimEngine])
def test_a_split_prefill_stage_stays_busy_for_a_batch_whose_prompts_were_dropped(
    engine_cls: type[SimEngine] | type[TokenSimEngine],
) -> None:
    """The prefill GPUs cannot take back a pass they began: the next prompt waits for its end."""
    engine = ready_split_engine(engine_cls)
    first, long_s = next_prompt_after_a_dropped_pass(engine)
    assert first.t_s == pytest.approx(100.0 + long_s + engine.timing.prefill_s(10))

"""Unit: the simulated ground truth — off gearbox's model by the spread, fixed by the seed, and
what the SimEngine's iterations take when it is given."""

from __future__ import annotations

import pytest

from gearbox.config import DEFAULT_CONFIG
from gearbox.presets import MODEL_7B_MHA
from runtime.engine.base import SeqSpec
from runtime.engine.sim import SimEngine
from runtime.engine.simgpu import SimGpuPool
from runtime.timing import ReplicaTiming
from sim.truth import GroundTruth
from tests.runtime.builders import make_replica

pytestmark = pytest.mark.unit


def _timing(gpus: tuple[str, ...] = ("G0",), gpu_class: str = "h100-sxm") -> ReplicaTiming:
    return ReplicaTiming.build(
        make_replica(gpus, gpu_class=gpu_class), MODEL_7B_MHA, DEFAULT_CONFIG
    )


def test_spread_zero_is_the_estimators_model() -> None:
    timing = _timing()
    true = GroundTruth(seed=3, spread=0.0).replica(timing)
    for tokens in (16, 500, 4000):
        assert true.prefill_s(tokens) == timing.prefill_s(tokens)
    for batch in (1, 8, 64):
        assert true.decode_cycle_s(batch, 1024) == timing.decode_cycle_s(batch, 1024)


def test_the_world_stays_within_the_spread_and_differs_from_the_model() -> None:
    timing = _timing()
    spread = 0.3
    ratios = []
    for seed in range(20):
        true = GroundTruth(seed, spread).replica(timing)
        for batch in (1, 4, 16, 64):
            ratios.append(true.decode_cycle_s(batch, 512) / timing.decode_cycle_s(batch, 512))
        ratios.append(true.prefill_s(1000) / timing.prefill_s(1000))
    # efficiency within ±spread, times jitter within ±spread/2
    lo, hi = (1 - spread) * (1 - spread / 2), (1 + spread) * (1 + spread / 2)
    assert all(lo <= r <= hi for r in ratios)
    assert min(ratios) < 0.9 and max(ratios) > 1.1  # the draws do spread out


def test_same_seed_same_world_other_seed_other_world() -> None:
    timing = _timing()
    a, b = GroundTruth(7).replica(timing), GroundTruth(7).replica(timing)
    c = GroundTruth(8).replica(timing)
    assert a.decode_cycle_s(8, 512) == b.decode_cycle_s(8, 512)
    assert a.prefill_s(700) == b.prefill_s(700)
    assert (a.decode_factor, a.prefill_factor) != (c.decode_factor, c.prefill_factor)


def test_decode_steps_never_shrink_as_the_context_grows() -> None:
    # The engine skips ahead on a lower bound that assumes this.
    true = GroundTruth(5).replica(_timing())
    for batch in (1, 3, 32):
        steps = [true.decode_cycle_s(batch, ctx) for ctx in range(64, 8192, 64)]
        assert steps == sorted(steps)


def test_spread_out_of_range_is_refused() -> None:
    with pytest.raises(ValueError, match="spread"):
        GroundTruth(1, spread=1.5)


def test_the_engine_is_timed_by_the_ground_truth_when_given() -> None:
    timing = _timing()
    true = GroundTruth(seed=11, spread=0.3).replica(timing)
    engine = SimEngine(timing, SimGpuPool(), step_timing=true)
    assert engine.load_shard(0, 0.0).ok
    ready = engine.build_comm_groups(0.0).ready_at_s
    engine.step(ready)
    t0 = ready + 1.0
    assert engine.admit(SeqSpec("s", 1000, 3), t0) is None
    out = engine.step(t0 + 10.0)
    assert out.first_tokens[0].t_s == pytest.approx(t0 + true.prefill_s(1000))
    assert true.prefill_s(1000) != pytest.approx(timing.prefill_s(1000))
    finish = t0 + true.prefill_s(1000) + 2 * true.decode_cycle_s(1, 1024)
    assert out.finished[0].t_s == pytest.approx(finish, rel=1e-3)

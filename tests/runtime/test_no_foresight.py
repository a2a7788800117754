"""Unit: nothing that admits, routes or estimates reads a request's actual output length.

A request states its prompt and the client's cap (``max_output_tokens``); the length its answer
will have travels apart (``sim_output_tokens``, SIMULATED) and only the simulated engine's stop
reads it. Two runs whose requests differ only in that length must be admitted, committed and
routed identically, and end at their own lengths — were any admission or estimate path to read
the true length, the commits or the routers' estimates below would differ.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gearbox.config import DEFAULT_CONFIG
from gearbox.presets import MODEL_7B_MHA
from runtime.deployment import DeploymentRuntime, RuntimeSettings
from runtime.engine.base import Finished, SeqSpec
from runtime.engine.paging import KvAdmission, paged
from runtime.engine.sim import SimEngine
from runtime.engine.simgpu import SimGpuPool
from runtime.timing import ReplicaTiming
from runtime.types import Admission, Request, RequestKind, ServingSettings
from tests.runtime.builders import DEPLOYMENT, FAST_EXECUTOR, FAST_POLICY, Harness, make_plan
from tests.runtime.test_paging_live import A0, _TokenPager

pytestmark = pytest.mark.unit

CAP = 2_000  # every request's stated max_tokens
PROMPT = 1_000


def _runtime(mode: KvAdmission) -> Harness:
    serving = ServingSettings(watermark=0.85, kv_admission=mode)
    settings = RuntimeSettings(policy=FAST_POLICY, executor=FAST_EXECUTOR, serving=serving)
    h = Harness(DeploymentRuntime(DEPLOYMENT, settings=settings))
    h.decide(1, make_plan(A0))
    h.until(lambda: h.rt.state.active is None, 30)
    return h


def _serve(
    mode: KvAdmission, lengths: list[int]
) -> tuple[list[Admission], list[dict[str, int]], dict[str, int]]:
    h = _runtime(mode)
    requests = [
        Request(f"r{i}", PROMPT, CAP, h.now_s, RequestKind.CHAT, sim_output_tokens=n)
        for i, n in enumerate(lengths)
    ]
    outcomes = [h.submit(r) for r in requests]
    held = [
        h.rt.core.vmm.held_bytes(h.rt.core.ledger_id(o.replica_id), o.request_id)
        if o.replica_id
        else {}
        for o in outcomes
    ]
    h.until(lambda: not h.rt.core.router.ownership(), 900)
    done = {c.request_id: c.output_tokens for c in h.outputs.completions}
    return outcomes, held, done


@pytest.mark.parametrize("mode", list(KvAdmission))
def test_admission_and_routing_do_not_depend_on_the_true_length(mode: KvAdmission) -> None:
    short = [20, 35, 50, 20, 35, 50, 20, 35]
    long = [1_900, 1_500, 2_000, 1_800, 1_900, 1_500, 2_000, 1_800]
    a_out, a_held, a_done = _serve(mode, short)
    b_out, b_held, b_done = _serve(mode, long)
    assert a_out == b_out  # the same verdicts, replicas and predicted completion times
    assert a_held == b_held  # the same KV committed through the VMM
    assert a_done == {f"r{i}": n for i, n in enumerate(short)}  # the simulated model's EOS
    assert b_done == {f"r{i}": n for i, n in enumerate(long)}
    if mode is KvAdmission.MAX_TOKENS:  # prompt + the stated cap, whatever the answer will be
        per_token = MODEL_7B_MHA.kv_bytes_per_token
        assert a_held[0]["A0"] >= paged(PROMPT + CAP) * per_token


@pytest.mark.parametrize("mode", list(KvAdmission))
def test_the_engine_stops_at_the_simulated_length_and_reports_the_cap(mode: KvAdmission) -> None:
    pager = _TokenPager(100_000)
    timing = ReplicaTiming.build(A0, MODEL_7B_MHA, DEFAULT_CONFIG)
    engine = SimEngine(timing, SimGpuPool())
    engine.attach_pager(pager, mode)
    assert engine.load_shard(0, 0.0).ok
    ready = engine.build_comm_groups(0.0)
    engine.step(ready.ready_at_s)
    engine.admit(SeqSpec("s", 100, 400, sim_output_tokens=30), 10.0)
    (progress,) = engine.progress()
    assert progress.max_output_tokens == 400  # what a scheduler sees: the cap
    finished: list[Finished] = []
    now = 10.0
    while not finished and now < 60.0:
        now += 0.01
        finished += engine.step(now).finished
    if mode is KvAdmission.MAX_TOKENS:
        assert pager.first_hold["s"] == paged(100 + 400)
    else:
        assert pager.held["s"] < paged(100 + 400)
    assert [(f.seq_id, f.output_tokens) for f in finished] == [("s", 30)]


# Where the simulated length may be named at all: carried (the request, the journal, the HTTP
# body, the serving core building the engine's spec) or read by a simulated engine's stop.
ALLOWED = {
    "runtime/types.py",
    "runtime/engine/base.py",
    "runtime/engine/batch.py",
    "runtime/engine/sim.py",
    "runtime/serving.py",
    "runtime/ownership.py",
    "runtime/http.py",
    "flexpipe/schemas.py",
}


def test_only_the_carriers_and_the_simulated_engine_name_the_true_length() -> None:
    root = Path(__file__).resolve().parents[2]
    names = ("sim_output_tokens", "stop_tokens", "simulated_output_tokens")
    naming = {
        str(path.relative_to(root))
        for package in ("runtime", "gearbox", "streams", "flexpipe")
        for path in (root / package).rglob("*.py")
        if any(name in path.read_text() for name in names)
    }
    assert naming <= ALLOWED, f"reads the true output length: {sorted(naming - ALLOWED)}"
    serving = (root / "runtime/serving.py").read_text()
    assert serving.count("sim_output_tokens") == 1  # only into the engine's SeqSpec

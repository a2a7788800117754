"""Unit: the live engine's paged-KV admission (runtime.engine.paging applied by the SimEngine
through the VMM ledger) — admission commits the prompt's pages, pages grow as tokens are
generated, the youngest sequence is preempted and resumed with its tokens, never lost."""

from __future__ import annotations

import pytest

from flexpipe.config import load_config
from flexpipe.errors import ConfigError
from gearbox.config import DEFAULT_CONFIG
from gearbox.presets import MODEL_7B_MHA
from runtime.deployment import DeploymentRuntime, RuntimeSettings
from runtime.engine.base import SeqSpec, SeqState
from runtime.engine.paging import PAGE_TOKENS, CoveringPager, KvAdmission, KvPager, paged
from runtime.engine.sim import SimEngine
from runtime.engine.simgpu import SimGpuPool
from runtime.kvpager import VmmPager
from runtime.timing import ReplicaTiming
from runtime.types import Reason, ServingSettings
from runtime.vmm.host import HostReservationBackend
from runtime.vmm.manager import ReservationManager
from runtime.worker import runtime_settings
from tests.runtime.builders import (
    DEPLOYMENT,
    FAST_EXECUTOR,
    FAST_POLICY,
    Harness,
    make_plan,
    make_replica,
    make_request,
)

pytestmark = pytest.mark.unit

GIB = 1024**3
A0 = make_replica(["A0"])


class _TokenPager:
    """A KvPager over a fixed budget of KV tokens; records every hold it was asked for."""

    def __init__(self, capacity_tokens: int) -> None:
        self.capacity_tokens = capacity_tokens
        self.held: dict[str, int] = {}
        self.first_hold: dict[str, int] = {}

    def hold(self, seq_id: str, tokens: int) -> bool:
        self.first_hold.setdefault(seq_id, tokens)
        have = self.held.get(seq_id, 0)
        if tokens <= have:
            return True
        if sum(self.held.values()) - have + tokens > self.capacity_tokens:
            return False
        self.held[seq_id] = tokens
        return True

    def release(self, seq_id: str) -> None:
        self.held.pop(seq_id, None)


def _engine(pager: _TokenPager, mode: KvAdmission) -> SimEngine:
    timing = ReplicaTiming.build(A0, MODEL_7B_MHA, DEFAULT_CONFIG)
    engine = SimEngine(timing, SimGpuPool())
    engine.attach_pager(pager, mode)
    assert engine.load_shard(0, 0.0).ok
    ready = engine.build_comm_groups(0.0)
    assert ready.ok
    engine.step(ready.ready_at_s)
    return engine


@pytest.mark.parametrize(
    ("mode", "first"),
    [(KvAdmission.INCREMENTAL, paged(100 + PAGE_TOKENS)), (KvAdmission.MAX_TOKENS, paged(500))],
)
def test_a_sequence_takes_its_admission_pages_before_its_prefill(
    mode: KvAdmission, first: int
) -> None:
    pager = _TokenPager(100_000)
    engine = _engine(pager, mode)
    engine.admit(SeqSpec("s", 100, 400), 10.0)
    out = engine.step(10.5)
    assert out.first_tokens and pager.first_hold["s"] == first
    engine.step(60.0)
    assert pager.held["s"] == paged(100 + 400)  # grown page by page to the context it reached


def test_the_youngest_is_preempted_and_resumed_with_its_tokens_never_lost() -> None:
    pager = _TokenPager(1_200)  # four sequences of 100 + 400 tokens need 2,000
    engine = _engine(pager, KvAdmission.INCREMENTAL)
    for i in range(4):
        assert engine.admit(SeqSpec(f"s{i}", 100, 400), 10.0 + i * 0.001) is None
    finished: dict[str, int] = {}
    preempted: list[str] = []
    waiting_with_tokens = False
    now = 10.0
    while len(finished) < 4 and now < 600.0:
        now += 0.25
        out = engine.step(now)
        assert not out.failed
        preempted += out.preempted
        waiting_with_tokens |= any(
            p.state is SeqState.WAITING and p.generated_tokens > 0 for p in engine.progress()
        )
        for done in out.finished:
            finished[done.seq_id] = done.output_tokens
            pager.release(done.seq_id)  # the serving core releases a finished sequence's pages
        assert sum(pager.held.values()) <= pager.capacity_tokens
    assert finished == {f"s{i}": 400 for i in range(4)}
    assert preempted and preempted[0] == "s3"  # the youngest goes first
    assert waiting_with_tokens  # a preempted sequence keeps what it generated
    assert engine.stats.preemptions == len(preempted)
    assert engine.stats.prefill_tokens > 4 * 100  # resumed sequences were recomputed


def _runtime(mode: KvAdmission, vmm: ReservationManager | None = None) -> Harness:
    serving = ServingSettings(watermark=0.85 if vmm is None else 1.0, kv_admission=mode)
    settings = RuntimeSettings(policy=FAST_POLICY, executor=FAST_EXECUTOR, serving=serving)
    h = Harness(DeploymentRuntime(DEPLOYMENT, settings=settings, vmm=vmm))
    h.decide(1, make_plan(A0))
    h.until(lambda: h.rt.state.active is None, 30)
    assert h.rt.state.serving_plan_id is not None
    return h


def test_admission_commits_the_prompts_pages_not_the_stated_max_tokens() -> None:
    # 10 requests stating 20,000 output tokens: prompt + max_tokens would pass the watermark
    # after a few; their prompts' pages do not
    admitted = {}
    for mode in KvAdmission:
        h = _runtime(mode)
        outcomes = [h.submit(make_request(i, 1_000, 20_000, h.now_s)) for i in range(10)]
        admitted[mode] = sum(o.admitted for o in outcomes)
        assert {o.reason for o in outcomes} <= {Reason.ADMITTED, Reason.THROTTLED_WATERMARK}
        if mode is KvAdmission.INCREMENTAL:
            replica = outcomes[0].replica_id
            assert replica is not None
            kv = h.rt.core.vmm.held_bytes(h.rt.core.ledger_id(replica), "r0")["A0"]
            per_token = MODEL_7B_MHA.kv_bytes_per_token
            assert kv < paged(1_000 + 2 * PAGE_TOKENS) * per_token + 2 * 1024**2
    assert admitted[KvAdmission.INCREMENTAL] == 10
    assert admitted[KvAdmission.MAX_TOKENS] < 10


class _ShortBackend(HostReservationBackend):
    """Reports an 80 GB GPU but runs out of pages at 24 GiB (memory taken outside our view)."""

    def capacity_bytes(self) -> int:
        return 80 * GIB


def test_under_pressure_the_live_runtime_preempts_and_every_request_finishes() -> None:
    short = ReservationManager(lambda uuid, _cap: _ShortBackend(uuid, 24 * GIB))
    h = _runtime(KvAdmission.INCREMENTAL, short)
    outcomes = [h.submit(make_request(i, 500, 3_000, h.now_s)) for i in range(8)]
    admitted = {o.request_id for o in outcomes if o.admitted}
    replica = outcomes[0].replica_id
    # the prompts' pages fit; their whole outputs do not
    assert len(admitted) == 8 and replica is not None
    h.until(lambda: not h.rt.core.router.ownership(), 900)
    done = {c.request_id: c.output_tokens for c in h.outputs.completions}
    assert done == {r: 3_000 for r in admitted}
    core = h.rt.core
    assert core.preemptions > 0 and core.engine_oom_events == 0 and h.rt.pool.oom_events == 0
    assert h.rt.status(h.now_s)["preemptions"] == core.preemptions
    assert not any(
        core.vmm.holds(core.ledger_id(replica), r) for r in admitted
    )  # every page given back


def test_the_admission_mode_is_one_validated_config_key() -> None:
    cfg = load_config(None, env={"FLEXPIPE_RUNTIME__KV_ADMISSION": "max_tokens"})
    assert runtime_settings(cfg.runtime).serving.kv_admission is KvAdmission.MAX_TOKENS
    assert load_config(None, env={}).runtime.kv_admission == "incremental"
    with pytest.raises(ConfigError, match=r"runtime\.kv_admission"):
        load_config(None, env={"FLEXPIPE_RUNTIME__KV_ADMISSION": "actual_output"})


class _PlainPager:
    """The same pages through a pager that does not say what it covers: the engine asks it
    about every running sequence before each run of iterations."""

    def __init__(self, inner: KvPager) -> None:
        self._inner = inner

    def hold(self, seq_id: str, tokens: int) -> bool:
        return self._inner.hold(seq_id, tokens)

    def release(self, seq_id: str) -> None:
        self._inner.release(seq_id)


def _pressure_run(
    plain: bool, monkeypatch: pytest.MonkeyPatch
) -> tuple[list[tuple[str, float, int]], int, list[tuple[int, ...]]]:
    if plain:
        attach = SimEngine.attach_pager

        def attach_plain(engine: SimEngine, pager: KvPager, mode: KvAdmission) -> None:
            attach(engine, _PlainPager(pager), mode)

        monkeypatch.setattr(SimEngine, "attach_pager", attach_plain)
    short = ReservationManager(lambda uuid, _cap: _ShortBackend(uuid, 24 * GIB))
    h = _runtime(KvAdmission.INCREMENTAL, short)
    ledger: list[tuple[int, ...]] = []
    for i in range(24):
        h.submit(make_request(i, 200 + 97 * i, 600 + 131 * (i % 7), h.now_s))
        h.advance_to(h.now_s + 0.35)
        ledger.append(tuple(m.committed_bytes for m in short.memory().values()))
    h.until(lambda: not h.rt.core.router.ownership(), 900)
    monkeypatch.undo()
    completions = [(c.request_id, c.finish_s, c.output_tokens) for c in h.outputs.completions]
    return completions, h.rt.core.preemptions, ledger


def test_skipping_the_holds_the_pager_covers_changes_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The VMM pager says what each sequence's pages cover, so the engine asks it only about the
    # sequences whose pages end within a run; asking about every one must give the same run:
    # the same completions at the same instants, preemptions and ledger.
    fast = _pressure_run(False, monkeypatch)
    timing = ReplicaTiming.build(A0, MODEL_7B_MHA, DEFAULT_CONFIG)
    assert isinstance(VmmPager(ReservationManager(), A0.plan_id, timing), CoveringPager)
    assert fast[1] > 0  # under pressure: pages were refused and sequences preempted
    assert fast == _pressure_run(True, monkeypatch)

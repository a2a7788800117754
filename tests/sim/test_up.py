"""`flexpipe up` — broker, stream worker, runtime worker, simulated agents and load, whole.

E2e: one short run of the demo scenario (10 simulated minutes at 20×, about 45 s wall) as a
subprocess against the session broker: it must end cleanly with every invariant held, show
chat-70b serving from start-up and shifting after the 08:00 preemption with its three phases,
and write summary.json, the report and the PNG. A chaos run (its own broker, the stream worker
killed once, the broker stopped during a shift) must hold the same invariants. Unit: the end of a
run with an injected violation exits 1 naming it, and summary.json says so.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from flexpipe.config import FlexPipeConfig
from flexpipe.schemas import GearDecision
from gearbox.decisions import DecisionReason, Trigger
from sim.outcome import EXIT_BROKEN, RunOutcome, SequenceLedger, conclude
from sim.record import RunRecord, SeenDecision
from sim.scenario import load_scenario, scenario_path
from sim.streamproc import TICK_FAILURES, metric_total, tick_failures_in_log
from sim.summary import SequenceFacts
from sim.up import torch_engine_config
from tests.runtime.builders import make_context

PREEMPT = "00:08:00"


def _run_up(
    kafka_cfg: FlexPipeConfig | None, out: Path, *args: str, timeout_s: float = 240
) -> subprocess.CompletedProcess[str]:
    """`flexpipe up` as a subprocess; against the session broker unless ``kafka_cfg`` is None
    (then on a broker of its own)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEXPIPE_")}
    if kafka_cfg is not None:
        env |= {
            "FLEXPIPE_KAFKA__BOOTSTRAP_SERVERS": kafka_cfg.kafka.bootstrap_servers or "",
            "FLEXPIPE_TOPICS__PREFIX": kafka_cfg.topics.prefix,
        }
    cmd = [sys.executable, "-m", "flexpipe.cli", "up", *args, "--out", str(out)]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)


def _summary(out: Path) -> dict[str, object]:
    data: dict[str, object] = json.loads((out / "summary.json").read_text())
    return data


def _phases_after(stdout: str, deployment: str, after: str) -> dict[int, list[str]]:
    """Completed phases per transition of ``deployment`` printed at or after ``after``."""
    found: dict[int, list[str]] = {}
    pattern = rf"^(\d\d:\d\d:\d\d)    ↳ {deployment} #(\d+) (\w+) [\d.]+ s ✓"
    for t, seq, phase in re.findall(pattern, stdout, flags=re.M):
        if t >= after:
            found.setdefault(int(seq), []).append(phase)
    return found


@pytest.mark.e2e
def test_up_shifts_chat_70b_after_the_preemption_and_writes_the_report(
    kafka_cfg: FlexPipeConfig, tmp_path: Path
) -> None:
    proc = _run_up(kafka_cfg, tmp_path, "--duration", "600", "--speed", "20")
    out = proc.stdout
    assert proc.returncode == 0, f"exit {proc.returncode}\n{out[-3000:]}\n{proc.stderr[-3000:]}"
    summary = _summary(tmp_path)
    run = summary["run"]
    assert isinstance(run, dict)
    assert summary["invariants_ok"] is True and run["failed_ticks"] == 0, summary
    assert run["failed_ticks_source"] == "metric" and run["duplicate_decisions"] == 0
    events = summary["events"]
    assert isinstance(events, list) and events, "the 08:00 preemption hits chat-70b's plan"
    assert events[0]["deployment"] == "chat-70b" and events[0]["answered_after_s"] <= 40
    assert "== invariants: 8 of 8 held" in out
    # Start-up: the starting plan is loaded as transition 0, before any decision.
    assert re.search(r"↳ chat-70b #0 done [\d.]+ s ✓", out), out[-3000:]
    # The preemption, a decision for chat-70b, and a shift with all three phases after it.
    assert f"{PREEMPT}  ⚡ preempt on node-a1 (4 GPUs)" in out
    assert re.search(rf"^{PREEMPT}  ⚙ chat-70b: forced_infeasible \[topology_change\]", out, re.M)
    shifts = _phases_after(out, "chat-70b", PREEMPT)
    assert any(p[:4] == ["prepare", "switch", "cleanup", "done"] for p in shifts.values()), shifts
    assert re.search(r"^chat-70b #\d+: 00:08:00 preempt on node-a1 .* seen", out, re.M)
    # chat-70b serves from start-up: no status block before the preemption counts a request
    # turned away for want of a plan, and few are over the whole run (the preemption's outage).
    blocks = re.findall(r"^(\d\d:\d\d:\d\d)  ▸ chat-70b (.*)$", out, re.M)
    assert [t for t, _ in blocks if t < PREEMPT], out[-3000:]
    assert all("no_serving_plan" not in line for t, line in blocks if t < PREEMPT), blocks
    admitted = re.search(r"^chat-70b .* admitted (\d+)(?:, no_serving_plan (\d+))?", out, re.M)
    assert admitted is not None, out[-2000:]
    assert int(admitted.group(2) or 0) < 0.1 * int(admitted.group(1))
    # The summary, the report and the figure.
    assert "== shifts" in out and "== throughput and admission" in out
    report = (tmp_path / "report.md").read_text()
    assert report.splitlines()[3] == "== invariants: 8 of 8 held (all held)"
    assert "## Decisions that changed a plan" in report and "chat-70b" in report
    png = (tmp_path / "timeline.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
    assert (tmp_path / "streams.log").exists()


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_up_chaos_kills_the_worker_and_stops_the_broker_and_still_holds(tmp_path: Path) -> None:
    # NOTE: on a broker of its own (it stops it); 20 simulated minutes at chaos's default 5×,
    # about 260 s wall (see sim.up.CHAOS_SPEED).
    proc = _run_up(None, tmp_path, "--chaos", "--duration", "1200", timeout_s=540)
    out = proc.stdout
    assert proc.returncode == 0, f"exit {proc.returncode}\n{out[-3000:]}\n{proc.stderr[-3000:]}"
    summary = _summary(tmp_path)
    run = summary["run"]
    assert isinstance(run, dict) and run["chaos"] is True and run["speed"] == 5.0
    assert summary["invariants_ok"] is True, summary["invariants"]
    assert run["duplicate_decisions"] == 0 and run["failed_ticks"] == 0
    kinds = [o["kind"] for o in run["outages"]]
    assert kinds == ["stream_worker_killed", "broker_stopped"], run["outages"]
    assert "during" in run["outages"][1]["detail"], "the broker went down during a shift"
    deployments = summary["deployments"]
    assert isinstance(deployments, dict)
    for figures in deployments.values():
        assert figures["sequences"]["lost"] == 0 and figures["sequences"]["owned_twice"] == 0
    assert out.count("chaos: ") >= 4  # each fault announced, each recovery measured


def _decision(seq: int) -> GearDecision:
    return GearDecision(
        deployment="chat-70b",
        decision_id=f"chat-70b:{seq}",
        seq=seq,
        trigger=Trigger.TIMER,
        reason=DecisionReason.NO_BETTER_CANDIDATE,
        forced=False,
        from_plan_id="dp-1",
        to_plan_id=None,
        explanation="chat-70b: no_better_candidate (trigger timer).",
        context=make_context(float(seq)),
    )


@pytest.mark.unit
def test_an_injected_violation_exits_1_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    scenario = load_scenario(scenario_path("demo-shift"))
    record = RunRecord()
    record.decisions.append(SeenDecision(30.0, 30.5, _decision(2)))
    record.sequences["chat-70b"] = SequenceFacts(admitted=10, completed=9, in_flight=1)
    twice = [(30.0, _decision(2)), (30.0, _decision(2))]  # the injected violation
    outcome = RunOutcome(record=record, decisions=twice, transitions=[], events=[], end_s=60.0)
    code = conclude(outcome, scenario, 60.0, tmp_path, "injected")
    captured = capsys.readouterr()
    assert code == EXIT_BROKEN
    (line,) = captured.err.strip().splitlines()
    assert line.startswith("flexpipe up: invariant broken: unique_decision_ids: 1 decision id")
    assert "chat-70b:2 ×2" in line
    data = _summary(tmp_path)
    assert data["invariants_ok"] is False and data["broken"] == ["unique_decision_ids"]
    assert "BROKEN  unique_decision_ids" in (tmp_path / "report.md").read_text()
    assert "== invariants: 7 of 8 held (1 BROKEN)" in captured.out


@pytest.mark.unit
def test_failed_ticks_from_the_metric_and_from_the_log() -> None:
    exposition = "\n".join(
        [
            f"# TYPE {TICK_FAILURES[: -len('_total')]} counter",
            f'{TICK_FAILURES}{{path="tick"}} 3.0',
            f'{TICK_FAILURES}{{path="triggers"}} 1.0',
            f'{TICK_FAILURES[: -len("_total")]}_created{{path="tick"}} 1.7e9',
        ]
    )
    assert metric_total(exposition, TICK_FAILURES) == 4.0
    assert metric_total("", TICK_FAILURES) is None
    log = "\n".join(
        [
            "[..] [ERROR] tick failed (first time for this error)",
            "Traceback (most recent call last):",
            "[..] [ERROR] tick failed again: TypeError: x at a.py:1 (10 times, 10 in a row)",
            "[..] [ERROR] tick failed again: TypeError: x at a.py:1 (100 times, 100 in a row)",
            "[..] [ERROR] triggers failed (first time for this error)",
            "[..] [ERROR] tick failed",  # an older worker
        ]
    )
    assert tick_failures_in_log(log) == 1 + 99 + 1 + 1


class _Router:
    def __init__(self, owned: dict[str, str]) -> None:
        self.owned = owned

    def ownership(self) -> dict[str, str]:
        return dict(self.owned)

    def check_invariants(self) -> list[str]:
        return []


class _Core:
    def __init__(self, owned: dict[str, str]) -> None:
        self.router = _Router(owned)
        self.preemptions = 0

    def unplaced(self) -> tuple[str, ...]:
        return ()

    def held(self) -> tuple[str, ...]:
        return ()


class _Runtime:
    def __init__(self, core: _Core) -> None:
        self.core = core


class _Worker:
    def __init__(self, core: _Core) -> None:
        self.deployments = ("chat",)
        self.runtimes = {"chat": _Runtime(core)}


@pytest.mark.unit
async def test_the_ledger_calls_lost_only_what_stays_unaccounted() -> None:
    loop = asyncio.get_running_loop()
    futures = {rid: loop.create_future() for rid in ("done", "running", "delivering", "gone")}
    futures["done"].set_result(object())
    core = _Core({"running": "r1"})
    worker = _Worker(core)
    ledger = SequenceLedger()
    for rid, fut in futures.items():
        ledger.admit("chat", rid, fut)
    ledger.load_ended(worker)  # "delivering" finished in the engine, its future not yet resolved
    futures["delivering"].set_result(object())
    (facts,) = ledger.settle(worker).values()
    assert (facts.admitted, facts.completed, facts.in_flight) == (4, 1, 1)
    assert facts.lost == 1 and facts.owned_twice == 0  # "gone": nowhere, then and now
    core.router.owned["done"] = "r2"  # a completed sequence owned again
    assert ledger.settle(worker)["chat"].owned_twice == 1
    await ledger.close()


@pytest.mark.unit
def test_the_torch_engine_runs_without_a_ttft_deadline_unless_one_is_set() -> None:
    cfg = FlexPipeConfig()
    assert cfg.runtime.ttft_deadline_s is None  # the SimEngine's runs: each TTFT SLO
    assert torch_engine_config(cfg).runtime.ttft_deadline_s == 0.0
    runtime = cfg.runtime.model_copy(update={"ttft_deadline_s": 5.0})
    explicit = cfg.model_copy(update={"runtime": runtime})
    assert torch_engine_config(explicit).runtime.ttft_deadline_s == 5.0

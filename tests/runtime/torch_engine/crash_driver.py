"""Child process for the SIGKILL tests: a runtime host serving with torch engines, held in a phase.

``python -m tests.runtime.torch_engine.crash_driver WORKDIR PHASE`` runs the worker's core —
:class:`runtime.host.RuntimeHost` with the torch engine factory over a durable token ledger
(``WORKDIR/tokens.ledger``) — on a simulated clock: it places TP2, admits :data:`NUM_REQUESTS`
requests, lets each emit a few tokens, then shifts to TP1 with the executor's pause hook
holding the shift inside PHASE. It writes ``WORKDIR/pids`` (every rank process) and
``WORKDIR/paused``, then blocks until it is killed.

:class:`FileLogs` stands in for the broker: the transitions log (each record fsynced before the
machine hears it was persisted, as the worker waits for the broker's ack) and the ownership
journal (the worker's ``(key, value)`` pairs, :func:`runtime.ownership.encode_event`), one line
per record, read back by the recovering side into :meth:`RuntimeHost.recover` — the worker's
recovery path without Kafka.
"""

from __future__ import annotations

import base64
import os
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

from flexpipe import envelope
from flexpipe.errors import ValidationError
from flexpipe.schemas import GearTransition, TransitionPhase
from runtime.deployment import RuntimeSettings
from runtime.engine.torch.engine import TorchEngine
from runtime.engine.torch.factory import DEMO_MODEL, torch_engine_factory, warm_up
from runtime.engine.torch.tokens import TokenLedger
from runtime.executor import ExecutorSettings
from runtime.host import RuntimeHost
from runtime.ownership import encode_event
from runtime.types import Completion
from tests.runtime.builders import DEPLOYMENT, FAST_POLICY, make_decision, make_plan, make_replica
from tests.runtime.builders import make_request as _request

NUM_REQUESTS = 4
MAX_NEW = 12
TOKENS_BEFORE_SHIFT = 3
DT_S = 0.05  # simulated seconds per tick; each tick is one engine step
OLD = make_plan(make_replica(["A0", "A1"]))
NEW = make_plan(make_replica(["A2"]))
# NOTE: a short canary and every running sequence handed over (no "short" ones left to finish
# on the old plan), so the switch has staged copies on TP1 when it is held
SETTINGS = RuntimeSettings(
    policy=FAST_POLICY,
    executor=ExecutorSettings(canary_s=0.1, drain_timeout_s=5.0, short_sequence_tokens=1),
)
REQUESTS = [_request(i, 12 + 5 * i, MAX_NEW, prefix="crash-") for i in range(NUM_REQUESTS)]


def _line(key: bytes | None, value: bytes | None) -> str:
    def enc(b: bytes | None) -> str:
        return "-" if b is None else base64.b64encode(b).decode()

    return f"{enc(key)} {enc(value)}\n"


def _append(path: Path, line: str) -> None:
    with open(path, "a") as f:
        f.write(line)
        f.flush()
        os.fsync(f.fileno())


@dataclass
class FileLogs:
    """The transitions log and ownership journal as append-only files (the module docstring)."""

    workdir: Path
    completions: list[Completion] = field(default_factory=list)

    def persist(self, record: GearTransition) -> None:
        """Append a transition record durably."""
        env = envelope.make(record, event_time_ms=0, source="crash-driver", seq=0)
        _append(self.workdir / "transitions", _line(None, envelope.encode(env)))

    def pump(self, host: RuntimeHost, now_s: float) -> None:
        """One tick, then every output delivered as the worker's flush does."""
        host.tick(now_s)
        for deployment, rt in host.runtimes.items():
            while True:
                out = rt.drain()
                lines = [
                    _line(*encode_event(deployment, e, source="crash-driver", seq=0, now_ms=0))
                    for e in out.ownership
                ]
                if lines:
                    _append(self.workdir / "ownership", "".join(lines))
                self.completions += out.completions
                if not out.records:
                    break
                for record in out.records:
                    self.persist(record)
                    rt.on_persisted(record, now_s)

    def _entries(self, name: str) -> list[tuple[bytes | None, bytes | None]]:
        path = self.workdir / name
        out = []
        for line in path.read_text().splitlines() if path.exists() else []:
            key, value = (None if p == "-" else base64.b64decode(p) for p in line.split())
            out.append((key, value))
        return out

    def records(self) -> list[GearTransition]:
        """The transitions log, in order."""
        out = []
        for _, value in self._entries("transitions"):
            try:
                payload = envelope.decode(value).payload
            except ValidationError:
                continue
            if isinstance(payload, GearTransition):
                out.append(payload)
        return out

    def journal(self) -> list[tuple[bytes | None, bytes | None]]:
        """The ownership journal's (key, value) pairs, in order."""
        return self._entries("ownership")


def build_host(
    workdir: Path, pause_in: TransitionPhase | None = None
) -> tuple[RuntimeHost, TokenLedger]:
    """A host serving :data:`DEPLOYMENT` with torch engines over ``workdir``'s durable ledger."""
    ledger = TokenLedger(DEMO_MODEL.vocab_size, workdir / "tokens.ledger")
    host = RuntimeHost(
        [DEPLOYMENT],
        SETTINGS,
        pause_in=pause_in,
        pause_from_seq=2,
        engine_factories={DEPLOYMENT: torch_engine_factory(ledger)},
    )
    return host, ledger


def rank_pids(host: RuntimeHost) -> list[int]:
    """The process ids of every rank of every engine the host holds."""
    rt = host.runtimes[DEPLOYMENT]
    engines = [rt.core.engine(rid) for rid in rt.core.replica_ids()]
    return [
        rp.proc.pid or 0 for e in engines if isinstance(e, TorchEngine) for rp in e._procs.values()
    ]


def _until(host: RuntimeHost, logs: FileLogs, clock: list[float], predicate: object) -> None:
    for _ in range(2000):
        if predicate():  # type: ignore[operator]
            return
        clock[0] += DT_S
        logs.pump(host, clock[0])
    raise SystemExit("crash driver: condition not met in 2000 ticks")


def main(workdir: Path, phase: TransitionPhase) -> None:
    """Serve, shift, hold inside ``phase``, report, block (see the module docstring)."""
    warm_up()
    host, ledger = build_host(workdir, phase)
    rt = host.runtimes[DEPLOYMENT]
    logs, clock = FileLogs(workdir), [0.0]
    host.on_decision(make_decision(1, OLD), clock[0])
    _until(host, logs, clock, lambda: rt.state.serving_plan_id == OLD.plan_id)
    for r in REQUESTS:
        assert rt.submit(r, clock[0]).admitted, r
    _until(
        host,
        logs,
        clock,
        lambda: all(len(ledger.outputs(r.request_id)) >= TOKENS_BEFORE_SHIFT for r in REQUESTS),
    )
    host.on_decision(make_decision(2, NEW, from_plan_id=OLD.plan_id), clock[0])
    _until(host, logs, clock, lambda: rt.executor.paused)
    (workdir / "pids").write_text(" ".join(map(str, rank_pids(host))))
    (workdir / "paused").write_text(str(rt.state.active.phase if rt.state.active else None))
    threading.Event().wait()


if __name__ == "__main__":
    main(Path(sys.argv[1]), TransitionPhase(sys.argv[2]))

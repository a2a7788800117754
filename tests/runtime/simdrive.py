"""Drive a DeploymentRuntime under a simulated clock, without Kafka or the wall clock.

What a discrete-event benchmark or a test needs: deliver decisions, submit requests at their
arrival times, advance time in steps, and acknowledge every transition record at once (as the
log would) — collecting records, completions, admissions and ownership events on the way.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from flexpipe.schemas import GearDecision
from runtime.deployment import DeploymentRuntime, Outbox
from runtime.types import Admission, Request


@dataclass
class SimDriver:
    """Steps one runtime through simulated time (see the module docstring)."""

    rt: DeploymentRuntime
    now_s: float = 0.0
    outputs: Outbox = field(default_factory=Outbox)
    admissions: list[Admission] = field(default_factory=list)

    def ack(self) -> None:
        """Persist (acknowledge) records until none is outstanding; keep every output."""
        while True:
            out = self.rt.drain()
            self.outputs.ownership.extend(out.ownership)
            self.outputs.completions.extend(out.completions)
            self.outputs.resolved.extend(out.resolved)
            self.outputs.refused.extend(out.refused)
            if not out.records:
                return
            for record in out.records:
                self.outputs.records.append(record)
                self.rt.on_persisted(record, self.now_s)

    def deliver(self, decision: GearDecision) -> None:
        """Deliver a decision now."""
        self.rt.on_decision(decision, self.now_s)
        self.ack()

    def submit(self, request: Request) -> Admission:
        """Submit a request now."""
        admission = self.rt.submit(request, self.now_s)
        self.admissions.append(admission)
        return admission

    def advance(self, duration_s: float, dt_s: float = 0.05) -> None:
        """Tick for ``duration_s`` in steps of ``dt_s``."""
        self.advance_to(self.now_s + duration_s, dt_s)

    def advance_to(self, t_s: float, dt_s: float = 0.05) -> None:
        """Tick until ``t_s``."""
        while self.now_s < t_s - 1e-9:
            self.now_s = min(t_s, self.now_s + dt_s)
            self.rt.tick(self.now_s)
            self.ack()

    def run(self, requests: Iterable[Request], until_s: float, dt_s: float = 0.05) -> None:
        """Submit each request at its arrival (in order), ticking in between, up to ``until_s``."""
        for request in requests:
            if request.arrival_s > until_s:
                break
            self.advance_to(request.arrival_s, dt_s)
            self.submit(request)
        self.advance_to(until_s, dt_s)

    def until(self, predicate: Callable[[], bool], limit_s: float, dt_s: float = 0.05) -> bool:
        """Tick until ``predicate`` holds; False if ``limit_s`` simulated seconds pass first."""
        end = self.now_s + limit_s
        while not predicate():
            if self.now_s >= end:
                return False
            self.advance(dt_s, dt_s)
        return True

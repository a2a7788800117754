"""Request-level router: a queue per replica, routing by predicted completion time, and the
ownership map — the single source of truth for which replica owns each sequence.

A sequence is owned from routing until it finishes, by exactly one replica, either waiting in
that replica's queue or running in its engine. Ownership changes only through :meth:`Router.
transfer`, one atomic dictionary update, so no interleaving can leave a sequence with two owners
or none; :meth:`Router.check_invariants` states the rule and tests assert it after every step.
Pure: no clock, no I/O; predictions come from gearbox's cost model via :class:`ReplicaTiming`.
Where deployments share GPUs (on-demand models), the host tells the router how many other
replicas with work sit on a replica's GPUs (``neighbours_busy``): co-resident engines
time-slice a GPU, so its prediction stretches by that many (bench.multimodel, stop 48).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum

from runtime.timing import ReplicaTiming
from runtime.types import Request


class ReplicaRole(StrEnum):
    """A replica's place in the route table."""

    SHADOW = "shadow"  # loading in prepare; takes no traffic
    CANARY = "canary"  # takes a canary share of new requests during a switch
    ACTIVE = "active"  # in the route table
    FROZEN = "frozen"  # entry frozen for a hand-over: runs what it owns, admits nothing new
    DRAINING = "draining"  # out of the route table after the swap: finishes what it owns
    FAILED = "failed"  # engine lost (GPU preempted/failed); owns only requests awaiting re-homing


ROUTABLE = frozenset({ReplicaRole.CANARY, ReplicaRole.ACTIVE})
# How many recent answers the expected answer length follows (a running mean over the first
# ones, then decaying with this weight): long enough to smooth a heavy tail, short enough to
# follow a shift in the traffic's mix within minutes.
OUTPUT_MEMORY = 256


@dataclass(frozen=True, slots=True)
class RouteChoice:
    """A replica that could take a request, with the router's completion estimate."""

    replica_id: str
    predicted_completion_s: float


@dataclass
class _Entry:
    timing: ReplicaTiming
    role: ReplicaRole
    queued: dict[str, float]  # seq id → predicted prefill seconds, in arrival order
    running: set[str]


def answer_mean_after(answers: int, mean: float, output_tokens: int) -> float:
    """The mean answer length once the ``answers``-th answer (``output_tokens`` long) joined
    it: a running mean over the first ``OUTPUT_MEMORY``, then decaying with that weight."""
    weight = 1.0 / min(answers, OUTPUT_MEMORY)
    return mean + (output_tokens - mean) * weight


def expected_output_tokens(answers: int, mean: float, max_output_tokens: int) -> float:
    """The answer length a prediction assumes: the recent answers' ``mean`` length, at most the
    request's stated cap (its own length is unknown until it is out); the cap until an answer
    completed."""
    if answers == 0:
        return float(max_output_tokens)
    return min(float(max_output_tokens), mean)


def predicted_completion_s(
    now_s: float,
    timing: ReplicaTiming,
    queued_prefill_s: float,
    batch: int,
    prompt_tokens: int,
    output_tokens: float,
    sharing: int = 1,
) -> float:
    """When a request would complete on a replica: the queue's wait (``queued_prefill_s``, the
    prefills ahead) + its own prefill + ``output_tokens`` decode steps at ``batch`` sequences
    (the request included) of mean context prompt + half the output — stretched by
    ``sharing``, the engines busy on its GPUs with it (co-resident engines time-slice a GPU)."""
    context = prompt_tokens + output_tokens / 2
    prefill_s = timing.prefill_s(prompt_tokens)
    decode_s = output_tokens * timing.decode_cycle_s(batch, context)
    if sharing == 1:
        # NOTE: summed from now_s, as before GPUs were shared: the same figure to the last bit
        return now_s + queued_prefill_s + prefill_s + decode_s
    return now_s + (queued_prefill_s + prefill_s + decode_s) * sharing


def canary_fraction(request_id: str) -> float:
    """A stable pseudo-random number in [0, 1) per request id (same in every process)."""
    digest = hashlib.sha256(request_id.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


class Router:
    """Per-replica queues, the ownership map and completion-time routing."""

    def __init__(self, canary_share: float = 0.1) -> None:
        self.canary_share = canary_share
        # how many other replicas with work hold a replica's GPUs (:class:`runtime.host.
        # RuntimeHost` sets it where deployments share GPUs); None: a replica has its GPUs alone
        self.neighbours_busy: Callable[[ReplicaTiming], int] | None = None
        self._replicas: dict[str, _Entry] = {}
        self._owner: dict[str, str] = {}
        self._answers = 0  # answers completed, for the running mean's weight
        self._answer_mean = 0.0  # their mean length, decaying (``OUTPUT_MEMORY``)

    # ---- route table ---------------------------------------------------------------------------

    def add_replica(self, timing: ReplicaTiming, role: ReplicaRole = ReplicaRole.SHADOW) -> None:
        """Add a replica (idempotent: an existing one keeps its queue and only changes role)."""
        entry = self._replicas.get(timing.replica_id)
        if entry is None:
            self._replicas[timing.replica_id] = _Entry(timing, role, {}, set())
        else:
            entry.role = role

    def set_role(self, replica_id: str, role: ReplicaRole) -> None:
        """Move a replica in the route table."""
        self._replicas[replica_id].role = role

    def role(self, replica_id: str) -> ReplicaRole | None:
        """The replica's role, ``None`` when unknown."""
        entry = self._replicas.get(replica_id)
        return entry.role if entry else None

    def replicas(self, *roles: ReplicaRole) -> tuple[str, ...]:
        """Replica ids with any of ``roles`` (all when none given), in insertion order."""
        return tuple(r for r, e in self._replicas.items() if not roles or e.role in roles)

    def remove_replica(self, replica_id: str) -> bool:
        """Drop a replica that owns nothing; False (no change) while it still owns a sequence."""
        entry = self._replicas.get(replica_id)
        if entry is None:
            return True
        if entry.queued or entry.running:
            return False
        del self._replicas[replica_id]
        return True

    # ---- routing -------------------------------------------------------------------------------

    def expected_output_tokens(self, request: Request) -> float:
        """The answer length a prediction assumes (:func:`expected_output_tokens`)."""
        return expected_output_tokens(self._answers, self._answer_mean, request.max_output_tokens)

    def predict_completion_s(self, replica_id: str, request: Request, now_s: float) -> float:
        """Queue wait (prefills ahead) + own prefill + expected output × decode step at the new
        batch (:func:`predicted_completion_s`)."""
        entry = self._replicas[replica_id]
        batch = len(entry.running) + len(entry.queued) + 1
        output = self.expected_output_tokens(request)
        queued_s = sum(entry.queued.values())
        busy = self.neighbours_busy
        sharing = 1 if busy is None else 1 + busy(entry.timing)
        return predicted_completion_s(
            now_s, entry.timing, queued_s, batch, request.prompt_tokens, output, sharing
        )

    def gpu_uuids(self, replica_id: str) -> tuple[str, ...]:
        """The replica's GPUs."""
        return self._replicas[replica_id].timing.gpu_uuids

    def has_work(self, replica_id: str) -> bool:
        """Whether the replica owns a sequence, queued or running."""
        entry = self._replicas.get(replica_id)
        return entry is not None and bool(entry.queued or entry.running)

    def candidates(self, request: Request, now_s: float) -> tuple[RouteChoice, ...]:
        """Routable replicas, best first: the request's group (canary or not), then the other."""
        canary = [r for r, e in self._replicas.items() if e.role is ReplicaRole.CANARY]
        active = [r for r, e in self._replicas.items() if e.role is ReplicaRole.ACTIVE]
        # (no canary, the usual case: either order gives the active group alone, so the
        # request id is not hashed)
        wants_canary = bool(canary) and canary_fraction(request.request_id) < self.canary_share
        groups = (canary, active) if wants_canary or not active else (active, canary)
        out: list[RouteChoice] = []
        for group in groups:
            ranked = sorted(
                (RouteChoice(r, self.predict_completion_s(r, request, now_s)) for r in group),
                key=lambda c: (c.predicted_completion_s, c.replica_id),
            )
            out.extend(ranked)
        return tuple(out)

    # ---- ownership -----------------------------------------------------------------------------

    def owner(self, seq_id: str) -> str | None:
        """The replica owning ``seq_id``, or ``None``."""
        return self._owner.get(seq_id)

    def ownership(self) -> Mapping[str, str]:
        """seq id → owning replica (read-only view)."""
        return dict(self._owner)

    def enqueue(self, request: Request, replica_id: str, *, front: bool = False) -> None:
        """Make ``replica_id`` the owner of a new sequence, waiting in its queue."""
        if request.request_id in self._owner:
            raise ValueError(
                f"{request.request_id} is already owned by {self.owner(request.request_id)}"
            )
        entry = self._replicas[replica_id]
        prefill = entry.timing.prefill_s(request.prompt_tokens)
        if front:
            entry.queued = {request.request_id: prefill, **entry.queued}
        else:
            entry.queued[request.request_id] = prefill
        self._owner[request.request_id] = replica_id

    def queued(self, replica_id: str) -> tuple[str, ...]:
        """Waiting sequences of a replica, oldest first."""
        return tuple(self._replicas[replica_id].queued)

    def queue_len(self, replica_id: str) -> int:
        """How many sequences wait in the replica's queue (``len(queued(...))`` without the
        copy: admission asks once per request and candidate replica)."""
        return len(self._replicas[replica_id].queued)

    def running(self, replica_id: str) -> frozenset[str]:
        """Sequences of a replica that are inside its engine."""
        return frozenset(self._replicas[replica_id].running)

    def owned(self, replica_id: str) -> tuple[str, ...]:
        """Every sequence the replica owns (queued first)."""
        entry = self._replicas.get(replica_id)
        if entry is None:
            return ()
        return (*entry.queued, *sorted(entry.running))

    def mark_running(self, seq_id: str) -> None:
        """The owner's engine took the sequence out of its queue."""
        entry = self._replicas[self._owner[seq_id]]
        del entry.queued[seq_id]
        entry.running.add(seq_id)

    def mark_waiting(self, seq_id: str, prompt_tokens: int) -> None:
        """The owner's engine lost the sequence: it waits at the front of the same owner's queue."""
        entry = self._replicas[self._owner[seq_id]]
        entry.running.discard(seq_id)
        entry.queued.pop(seq_id, None)
        entry.queued = {seq_id: entry.timing.prefill_s(prompt_tokens), **entry.queued}

    def transfer(
        self, seq_id: str, to_replica: str, *, running: bool, prompt_tokens: int = 0
    ) -> None:
        """Move ownership atomically; the sequence is running in, or queued at, the new owner."""
        source = self._replicas[self._owner[seq_id]]
        target = self._replicas[to_replica]
        source.queued.pop(seq_id, None)
        source.running.discard(seq_id)
        if running:
            target.running.add(seq_id)
        else:
            target.queued = {seq_id: target.timing.prefill_s(prompt_tokens), **target.queued}
        self._owner[seq_id] = to_replica

    def finish(self, seq_id: str, output_tokens: int | None = None) -> None:
        """The sequence completed (with an answer of ``output_tokens``, when given): it leaves
        the ownership map, and its length joins :meth:`expected_output_tokens`'s mean."""
        if output_tokens is not None:
            self._answers += 1
            self._answer_mean = answer_mean_after(self._answers, self._answer_mean, output_tokens)
        replica = self._owner.pop(seq_id, None)
        if replica is not None:
            entry = self._replicas[replica]
            entry.queued.pop(seq_id, None)
            entry.running.discard(seq_id)

    def check_invariants(self) -> list[str]:
        """Violations of the ownership rule (empty when it holds)."""
        problems = []
        seen: dict[str, str] = {}
        for rid, entry in self._replicas.items():
            for sid in (*entry.queued, *entry.running):
                if sid in seen:
                    problems.append(f"{sid} held by {seen[sid]} and {rid}")
                seen[sid] = rid
                if self._owner.get(sid) != rid:
                    problems.append(f"{sid} held by {rid} but owned by {self._owner.get(sid)}")
            if set(entry.queued) & entry.running:
                problems.append(f"{rid} has sequences both queued and running")
        for sid, rid in self._owner.items():
            if sid not in seen:
                problems.append(f"{sid} owned by {rid} but held nowhere")
        return problems

"""Value types shared across the runtime: requests, admissions, completions, ownership events."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from flexpipe.schemas import RequestKind
from runtime.engine.paging import KvAdmission
from runtime.throttle import DEFAULT_WATERMARK

__all__ = [
    "CAPACITY_REFUSALS",
    "Admission",
    "Completion",
    "OwnershipEvent",
    "OwnershipKind",
    "Reason",
    "Request",
    "RequestKind",
    "RequestRefused",
    "ServingSettings",
]


class Reason(StrEnum):
    """Why a request was or was not admitted; shown as-is in HTTP bodies, logs and metrics."""

    ADMITTED = "admitted"
    THROTTLED_WATERMARK = "throttled_watermark"  # every plan's GPUs are above the pre-OOM mark
    REJECTED_OOM_RISK = "rejected_oom_risk"  # the VMM could not commit the request's KV pages
    NO_SERVING_PLAN = "no_serving_plan"  # no plan is loaded for the deployment (yet)
    QUEUE_FULL = "queue_full"  # every routable plan's queue is at its cap
    TOO_LONG = "too_long"  # prompt + output exceed what any plan's KV can ever hold
    DUPLICATE_REQUEST = "duplicate_request"  # the request id is already owned
    UNKNOWN_DEPLOYMENT = "unknown_deployment"  # this worker does not serve that deployment
    # on-demand models: a request for one that is not loaded waits for its load
    HELD_FOR_LOAD = "held_for_load"  # held until a replica serves (or model_load_wait_s)
    MODEL_LOADING = "model_loading"  # held past model_load_wait_s: the model is still not loaded
    # a transient watermark refusal waits for memory (runtime.admission, memory_wait_s), then
    # is admitted or refused THROTTLED_WATERMARK
    HELD_FOR_MEMORY = "held_for_memory"
    # no first token within the deployment's TTFT deadline (ServingCore.ttft_deadline_s) of its
    # arrival: refused while still queued or prefilling
    TTFT_DEADLINE = "ttft_deadline"


# Refusals for want of room on the serving plan: the request was fine, the plan could not take
# it. Such a request never gets a first token, so the streams count it as a TTFT beyond every
# sample (streams.load); a bad request (too long, a duplicate, an unknown deployment) or one
# with no plan to judge (none loaded, a model still loading) says nothing about the plan's TTFT.
CAPACITY_REFUSALS = frozenset(
    {
        Reason.THROTTLED_WATERMARK,
        Reason.REJECTED_OOM_RISK,
        Reason.QUEUE_FULL,
        Reason.TTFT_DEADLINE,
    }
)


class RequestRefused(Exception):
    """A held request refused later (its future's exception); ``reason`` says why."""

    def __init__(self, request_id: str, reason: Reason) -> None:
        super().__init__(f"{request_id}: {reason}")
        self.request_id = request_id
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Request:
    """One inference request as the runtime sees it (token counts, not text)."""

    request_id: str
    prompt_tokens: int
    max_output_tokens: int  # the client's stated cap (``max_tokens``), not its future
    arrival_s: float  # simulated or wall time the request arrived, in the caller's clock
    kind: RequestKind = RequestKind.CHAT
    # SIMULATED ONLY: where the simulated model stops (its EOS), ≤ the cap; None = at the cap.
    # The simulated engine alone reads it (``SeqSpec.stop_tokens``); no admission, routing,
    # estimate or scheduling rule may, as no server knows an answer's length before it is out.
    sim_output_tokens: int | None = None

    @property
    def total_tokens(self) -> int:
        """Context length if the request runs to its stated cap."""
        return self.prompt_tokens + self.max_output_tokens


@dataclass(frozen=True, slots=True)
class Admission:
    """Outcome of submitting one request."""

    request_id: str
    admitted: bool
    reason: Reason
    replica_id: str | None = None  # the owning replica when admitted
    predicted_completion_s: float | None = None  # router's estimate when admitted


@dataclass(frozen=True, slots=True)
class Completion:
    """A finished request with its simulated (or engine-measured) timings."""

    request_id: str
    replica_id: str
    plan_id: str | None  # deployment plan serving when it finished
    prompt_tokens: int
    output_tokens: int
    arrival_s: float
    first_token_s: float
    finish_s: float
    replays: int = 0  # times the sequence was re-prefilled (hand-over replay or failure)

    @property
    def ttft_s(self) -> float:
        """Time to first token."""
        return self.first_token_s - self.arrival_s

    @property
    def latency_s(self) -> float:
        """Arrival to last token."""
        return self.finish_s - self.arrival_s


class OwnershipKind(StrEnum):
    """Journal entries about a sequence's life (see :mod:`runtime.journal`)."""

    ADMITTED = "admitted"
    FINISHED = "finished"


@dataclass(frozen=True, slots=True)
class OwnershipEvent:
    """A sequence was admitted (with its owner) or finished."""

    kind: OwnershipKind
    request: Request
    replica_id: str | None


@dataclass(frozen=True, slots=True)
class ServingSettings:
    """Admission knobs."""

    watermark: float = DEFAULT_WATERMARK  # committed share of GPU memory that stops admission
    max_queue_per_replica: int = 1024
    # KV a request commits when admitted: its prompt's pages + one, grown as it generates
    # (incremental), or prompt + the client's stated max_tokens (runtime.engine.paging)
    kv_admission: KvAdmission = KvAdmission.INCREMENTAL


@dataclass
class HandoverTally:
    """What a switch's hand-over moved."""

    migrated: int = 0
    replayed: int = 0
    migrated_bytes: int = 0
    skipped: int = 0  # could not be staged: finish on the old replica instead
    notes: list[str] = field(default_factory=list)

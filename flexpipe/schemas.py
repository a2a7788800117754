"""Typed payloads for every event kind on FlexPipe's topics.

Payloads are plain frozen dataclasses; pydantic's ``TypeAdapter`` validates them on decode so a bad
message is rejected with the field's path and the reason, in microseconds, without hand-written
checks. Encoding is orjson's native dataclass form in :mod:`flexpipe.envelope`, which for
gearbox's values is exactly ``gearbox.serde.to_plain``; decoding gearbox's values goes through
``gearbox.serde`` too (:func:`_gearbox`), so the audit topic carries gearbox's own types.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Protocol, Self, TypeVar

from pydantic import ConfigDict, PlainValidator

from gearbox.decisions import CandidateSummary, Decision, DecisionReason, Trigger
from gearbox.plans import DeploymentPlan
from gearbox.types import LoadSnapshot

# Strict: no silent coercion of "5" into 5; unknown fields are an error, not ignored.

STRICT = ConfigDict(strict=True, extra="forbid")


class Kind(enum.StrEnum):
    """Event kinds; the value is what travels in the envelope's ``kind`` field."""

    GPU_SAMPLE = "gpu.sample"
    KERNEL_LAUNCHES = "kernel.launches"
    SERVING_LOAD = "serving.load"
    CLUSTER_EVENT = "cluster.event"
    GEAR_DECISION = "gear.decision"
    GEAR_TRANSITION = "gear.transition"
    CONTROL_COMMAND = "control.command"
    RUNTIME_OWNERSHIP = "runtime.ownership"
    NODE_SAMPLES = "node.samples"


class SampleReason(enum.StrEnum):
    """Why a GPU sample was published: agents publish on change or on heartbeat only."""

    INITIAL = "initial"
    DELTA = "delta"
    HEARTBEAT = "heartbeat"


@dataclass(frozen=True, slots=True)
class GpuProcess:
    """A process holding memory on a GPU (NVML's running-process list)."""

    __pydantic_config__: ClassVar[ConfigDict] = STRICT

    pid: int
    used_memory_bytes: int | None = None


@dataclass(frozen=True, slots=True)
class GpuSample:
    """One GPU's full state at a sample time.

    Each sample is complete (not a field diff) so any one message rebuilds the GPU's state; agents
    still publish only when a field moved past its threshold, plus a heartbeat. Fields NVML does not
    support on a device are ``None``.
    """

    __pydantic_config__: ClassVar[ConfigDict] = STRICT

    gpu_uuid: str
    node: str
    name: str
    reason: SampleReason
    memory_total_bytes: int
    memory_used_bytes: int
    memory_free_bytes: int
    healthy: bool = True
    gpu_class: str | None = None  # key into gearbox's GPU class presets
    domain: str | None = None  # interconnect domain (NVLink island, RDMA group, PCIe host)
    index: int | None = None
    memory_reserved_bytes: int | None = None
    sm_util_pct: float | None = None
    mem_util_pct: float | None = None
    power_w: float | None = None
    temperature_c: float | None = None
    ecc_uncorrected: int | None = None
    retired_pages: int | None = None
    xid_errors: tuple[int, ...] = ()
    nvlink_active_links: int | None = None
    nvlink_tx_bytes_per_s: float | None = None
    nvlink_rx_bytes_per_s: float | None = None
    pcie_tx_bytes_per_s: float | None = None
    pcie_rx_bytes_per_s: float | None = None
    mig_mode: bool | None = None
    processes: tuple[GpuProcess, ...] = ()


_D = TypeVar("_D")


def _unfrozen_twin(cls: type[_D]) -> Callable[..., _D]:
    """A constructor of frozen slotted dataclass ``cls`` at a plain class's speed.

    It fills a non-frozen twin with the same slots (names and order) by plain slot writes, then
    makes it a ``cls`` (``__class__`` assignment, allowed between identical slot layouts): the
    result is a genuine, frozen ``cls``, equal and hashed like one built by ``cls(...)``, from
    the same parameters (names, order, defaults).

    NOTE: a frozen dataclass's ``__init__`` sets each field through ``object.__setattr__``; with
    GpuSample's 26 fields that is ~4 µs, the twin's slot writes ~1 µs. Agents build one
    GpuSample per GPU every second (and a copy per heartbeat).
    """
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]
    assert all(f.default_factory is dataclasses.MISSING for f in fields), cls
    slots = tuple(f.name for f in fields)
    assert slots == cls.__slots__, cls  # type: ignore[attr-defined]
    twin = type(f"_{cls.__name__}Twin", (), {"__slots__": slots})
    params = ", ".join(
        f.name if f.default is dataclasses.MISSING else f"{f.name}=_d_{f.name}" for f in fields
    )
    body = "".join(f"    obj.{n} = {n}\n" for n in slots)
    src = f"def build({params}):\n    obj = _new(_twin)\n{body}"
    src += "    obj.__class__ = _cls\n    return obj\n"
    scope: dict[str, Any] = {"_new": object.__new__, "_twin": twin, "_cls": cls}
    scope.update({f"_d_{f.name}": f.default for f in fields})
    # generated from the dataclass's own field names, as dataclasses does; the file name makes
    # profiles attribute the constructor to this module
    exec(compile(src, f"<flexpipe/schemas.py new_{cls.__name__}>", "exec"), scope)
    build: Callable[..., _D] = scope["build"]
    build.__qualname__ = build.__name__ = f"new_{cls.__name__}"
    return build


if TYPE_CHECKING:
    gpu_sample = GpuSample
else:
    gpu_sample = _unfrozen_twin(GpuSample)
"""``GpuSample(...)``, faster (:func:`_unfrozen_twin`): the agent's constructor for samples."""


@dataclass(frozen=True, slots=True)
class ProcessLaunches:
    """Kernel launches of one process over one drain interval (counted in a BPF map)."""

    __pydantic_config__: ClassVar[ConfigDict] = STRICT

    pid: int
    comm: str
    launches: int
    launches_per_s: float
    graph_launches: int = 0
    mem_alloc_bytes: int = 0
    mem_free_bytes: int = 0


@dataclass(frozen=True, slots=True)
class KernelLaunches:
    """Per-GPU kernel-launch counts for one interval.

    Processes are mapped to GPUs through NVML's process list: a process using several GPUs has its
    launches attributed to each of them (an upper bound per GPU, stated in the README).
    """

    __pydantic_config__: ClassVar[ConfigDict] = STRICT

    gpu_uuid: str
    node: str
    interval_s: float
    launches: int
    launches_per_s: float
    processes: tuple[ProcessLaunches, ...] = ()


@dataclass(frozen=True, slots=True)
class NodeSamples:
    """One node's telemetry for one interval, in one message: fewer, fatter messages.

    ``samples`` are the GPU samples the agent would have sent one by one (the same delta and
    heartbeat rules pick them; a GPU with nothing to say is left out), ``launches`` the GPUs'
    kernel-launch counts. Every item names this node. The envelope's source and sequence number
    are each item's, so per-GPU duplicate detection works as for the per-GPU kinds. Published
    on the node topic keyed by node; the per-GPU topics stay for agents that publish per GPU,
    and the stream's ``gpus`` table changelog carries each GPU's state keyed by GPU uuid.
    """

    __pydantic_config__: ClassVar[ConfigDict] = STRICT

    node: str
    samples: tuple[GpuSample, ...] = ()
    launches: tuple[KernelLaunches, ...] = ()


@dataclass(frozen=True, slots=True)
class ServingLoad:
    """A runtime worker's serving load for one deployment over one window."""

    __pydantic_config__: ClassVar[ConfigDict] = STRICT

    deployment: str
    model: str
    window_s: float
    arrivals: int
    arrival_rate_rps: float
    queue_len: int
    active_sequences: int
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    mean_prompt_tokens: float = 0.0
    mean_output_tokens: float = 0.0
    ttft_p95_ms: float | None = None
    tbt_p95_ms: float | None = None
    kv_bytes: int = 0
    rejected: int = 0
    # of ``rejected``: refused for want of room on the plan (watermark, OOM risk, queue full):
    # no first token ever, so the streams count them beyond every TTFT sample (streams.load)
    capacity_refusals: int = 0
    plan_id: str | None = None
    ttft_histogram: tuple[tuple[int, int], ...] = ()  # the window's TTFTs, flexpipe.latency
    prompt_histogram: tuple[tuple[int, int], ...] = ()  # arrivals' prompt tokens, same buckets


# XID codes after which NVIDIA says the GPU needs a reset or replacement: double-bit ECC (48),
# fallen off the bus (79), contained/uncontained ECC (94/95), GSP/firmware errors (119/120).
# An XID event with one of these codes takes the GPU out of service until GPU_RESTORED.
FATAL_XIDS = frozenset({48, 79, 92, 94, 95, 119, 120})
# DomainInfo id of the network between a node's interconnect domains, in NODE_UP events.
INTER_DOMAIN_ID = "inter-domain"


class ClusterEventType(enum.StrEnum):
    """Topology and capacity changes seen by agents or declared by the scheduler."""

    NODE_UP = "node_up"
    NODE_DOWN = "node_down"
    GPU_ISOLATED = "gpu_isolated"
    GPU_RESTORED = "gpu_restored"
    PREEMPT = "preempt"
    RELEASE = "release"
    XID = "xid"
    LINK = "link"


@dataclass(frozen=True, slots=True)
class DomainInfo:
    """An interconnect domain as a node agent reports it."""

    __pydantic_config__: ClassVar[ConfigDict] = STRICT

    domain_id: str
    link: str  # key into gearbox's link class presets ("nvlink", "rdma", "pcie", ...)
    bandwidth_gbps: float | None = None  # measured, when the agent measured it


@dataclass(frozen=True, slots=True)
class ClusterEvent:
    """A change in what the cluster offers: a node, GPUs, a reservation or a link."""

    __pydantic_config__: ClassVar[ConfigDict] = STRICT

    type: ClusterEventType
    node: str
    gpu_uuids: tuple[str, ...] = ()
    domains: tuple[DomainInfo, ...] = ()
    xid: int | None = None
    detail: str = ""


class _FromDict(Protocol):
    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> Self: ...


T = TypeVar("T", bound=_FromDict)


def _gearbox(cls: type[T], *, optional: bool = False) -> PlainValidator:
    """Validate a gearbox value with ``gearbox.serde`` (its own rules, e.g. a claimed plan id
    must match the content); errors name the field inside the value."""

    def check(value: object) -> T | None:
        if value is None and optional:
            return None
        if isinstance(value, cls):
            return value
        if not isinstance(value, Mapping):
            raise ValueError(f"expected a {cls.__name__} object, got {type(value).__name__}")
        try:
            return cls.from_dict(value)
        except (TypeError, LookupError, ArithmeticError, AttributeError) as exc:
            # NOTE: a value's own checks (__post_init__) may trip over malformed parts before
            # naming them; to the sender it is all one thing: this field is invalid.
            raise ValueError(f"{cls.__name__}: {type(exc).__name__}: {exc}") from None

    validate: Callable[[object], T | None] = check
    return PlainValidator(validate)


MaybePlan = Annotated[DeploymentPlan | None, _gearbox(DeploymentPlan, optional=True)]
MaybeDecision = Annotated[Decision | None, _gearbox(Decision, optional=True)]
Load = Annotated[LoadSnapshot, _gearbox(LoadSnapshot)]
Candidate = Annotated[CandidateSummary, _gearbox(CandidateSummary)]
MaybeCandidate = Annotated[CandidateSummary | None, _gearbox(CandidateSummary, optional=True)]


class PlanSource(enum.StrEnum):
    """Where a deployment's current plan came from, as the stream saw it when deciding."""

    NONE = "none"  # nothing yet: gearbox makes a first placement
    HINT = "hint"  # the configured starting plan
    DECISION = "decision"  # our own switch decision, not yet confirmed by the runtime
    TRANSITION = "transition"  # a runtime worker finished the transition (phase DONE)


@dataclass(frozen=True, slots=True)
class InFlight:
    """A switch decision whose transition the runtime has not reported finished."""

    __pydantic_config__: ClassVar[ConfigDict] = STRICT

    decision_id: str  # the decision's id (``deployment:seq``)
    seq: int  # the decision's sequence number, which is the runtime's transition_seq for it
    to_plan_id: str  # the decision's target plan
    since_ms: int  # event time of the trigger that emitted it
    # a handover's: GPUs its target takes from another deployment, which must move off them
    taken_gpus: tuple[str, ...] = ()

    def deadline_ms(self, timeout_s: float) -> int:
        """Event time from which the step decides again without waiting for the runtime."""
        return self.since_ms + round(timeout_s * 1000)

    def describe(self) -> str:
        """``chat:3 → dp-…``, for explanations."""
        return f"{self.decision_id} → {self.to_plan_id}"


@dataclass(frozen=True, slots=True)
class BlockSummary:
    """One atomic block as the decision saw it."""

    __pydantic_config__: ClassVar[ConfigDict] = STRICT

    block_id: str
    domain_id: str
    num_gpus: int


@dataclass(frozen=True, slots=True)
class DecisionContext:
    """What the stream saw when it decided: enough for an auditor to check the decision, and
    for the stream itself to pick up after a crash (``now_s``, ``in_flight``)."""

    __pydantic_config__: ClassVar[ConfigDict] = STRICT

    trigger_time_ms: int
    trigger_description: str
    now_s: float  # event time of the snapshot decided on
    worker: str
    plan_source: PlanSource
    load_source: str  # which telemetry the load came from (e.g. "serving", "launches")
    load: Load
    digest: str  # of the snapshot: a replay that differs on the same digest differs in policy
    num_gpus: int
    num_live_gpus: int
    blocks: tuple[BlockSummary, ...]
    notes: tuple[str, ...]
    serving_plan_id: str | None  # what the runtime serves, as far as the stream knows
    in_flight: InFlight | None  # the switch in flight after this decision
    # Held decisions only: the candidates gearbox weighed and why nothing switched.
    current: MaybeCandidate = None
    candidates: tuple[Candidate, ...] = ()
    problems: tuple[str, ...] = ()
    retry_after_s: float | None = None


@dataclass(frozen=True, slots=True)
class GearDecision:
    """A gear decision as published on the audit topic.

    ``decision`` is gearbox's decision (None when the tick held); the flat fields repeat what
    subscribers filter on; ``context`` is what the stream saw.
    """

    __pydantic_config__: ClassVar[ConfigDict] = STRICT

    deployment: str
    decision_id: str  # deterministic: deployment + sequence, so replays never duplicate
    seq: int
    trigger: Trigger  # gearbox's enum: what made the loop run
    reason: DecisionReason  # gearbox's enum: why it switched or held (machine-readable)
    forced: bool
    from_plan_id: str | None
    to_plan_id: str | None
    explanation: str
    context: DecisionContext
    decision: MaybeDecision = None


class TransitionPhase(enum.StrEnum):
    """Phases of the three-phase transition plus its terminal states."""

    PREPARE = "prepare"
    SWITCH = "switch"
    CLEANUP = "cleanup"
    DONE = "done"
    ROLLED_BACK = "rolled_back"


class PhaseStatus(enum.StrEnum):
    """Where a phase stands."""

    STARTED = "started"
    COMPLETED = "completed"
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class GearTransition:
    """One state change of a transition, persisted before the next phase begins."""

    __pydantic_config__: ClassVar[ConfigDict] = STRICT

    deployment: str
    transition_seq: int
    decision_id: str
    phase: TransitionPhase
    status: PhaseStatus
    from_plan_id: str | None
    to_plan_id: str | None
    attempt: int = 1
    duration_ms: float | None = None
    detail: str = ""
    plan: MaybePlan = None  # the plan that serves, on DONE


class ControlAction(enum.StrEnum):
    """Operator commands; they travel on the control topic only."""

    PIN = "pin"
    UNPIN = "unpin"
    EMERGENCY_DOWNSHIFT = "emergency_downshift"
    CLEAR_DOWNSHIFT = "clear_downshift"


@dataclass(frozen=True, slots=True)
class ControlCommand:
    """An operator's command for one deployment."""

    __pydantic_config__: ClassVar[ConfigDict] = STRICT

    deployment: str
    action: ControlAction
    plan_id: str | None = None
    issued_by: str = "operator"
    reason: str = ""


class RequestKind(enum.StrEnum):
    """The request classes the load generator and stats distinguish."""

    CHAT = "chat"  # short prompt, online
    SUMMARISATION = "summarisation"  # long prompt, batch


@dataclass(frozen=True, slots=True)
class OwnershipRecord:
    """An admitted, unfinished sequence and its owner, in the runtime's ownership journal
    (key ``<deployment>/<request id>``; a tombstone once it finished)."""

    __pydantic_config__: ClassVar[ConfigDict] = STRICT

    deployment: str
    request_id: str
    replica_id: str | None  # the replica that owns it; None while queued
    prompt_tokens: int
    max_output_tokens: int  # the client's stated cap
    arrival_s: float
    kind: RequestKind = RequestKind.CHAT
    sim_output_tokens: int | None = None  # SIMULATED: the simulated model's stop (Request's)


PAYLOAD_TYPES: dict[Kind, type] = {
    Kind.GPU_SAMPLE: GpuSample,
    Kind.KERNEL_LAUNCHES: KernelLaunches,
    Kind.SERVING_LOAD: ServingLoad,
    Kind.CLUSTER_EVENT: ClusterEvent,
    Kind.GEAR_DECISION: GearDecision,
    Kind.GEAR_TRANSITION: GearTransition,
    Kind.CONTROL_COMMAND: ControlCommand,
    Kind.RUNTIME_OWNERSHIP: OwnershipRecord,
    Kind.NODE_SAMPLES: NodeSamples,
}
KIND_OF: dict[type, Kind] = {cls: kind for kind, cls in PAYLOAD_TYPES.items()}

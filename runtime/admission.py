"""The admission rules one candidate replica applies to a new request, and the memory wait.

Pure functions over figures the caller reads (its VMM ledger, or a benchmark's memory pool), so
:class:`runtime.serving.ServingCore` and the multi-model benchmark (``bench.mm.systems``) apply
the same rule rather than copies of it:

* :func:`screen` — the ladder each candidate is tried on, in order: the context limit
  (``TOO_LONG``), the queue cap (``QUEUE_FULL``), the pre-OOM watermark
  (``THROTTLED_WATERMARK``). A candidate that passes is then committed (the live VMM commit can
  still refuse: ``REJECTED_OOM_RISK``).
* :func:`worst_refusal` — the reason a request refused by every candidate is given.
* :func:`transient` and :func:`memory_wait_until_s` — a request the watermark refuses only
  because other sequences' KV fills its GPUs *for the moment* (it would pass with the replica's
  weights alone) waits for memory instead of an instant 429, while it can still get its first
  token within ``wait_s`` of its first refusal; the watermark (and the VMM commit) still gate
  its actual admission, so waiting never risks an OOM. The default wait is half the model's TTFT
  SLO (:func:`default_memory_wait_s`): a request that cannot start in time cannot count as
  goodput, and the client is better told (429 ``throttled_watermark``) at once then.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from runtime.throttle import GpuMemory, check_watermark
from runtime.timing import ReplicaTiming
from runtime.types import Reason

__all__ = [
    "MEMORY_WAIT_SHARE_OF_TTFT_SLO",
    "REJECTION_ORDER",
    "default_memory_wait_s",
    "first_token_s",
    "memory_wait_until_s",
    "screen",
    "transient",
    "ttft_deadline_s",
    "worst_refusal",
]

# Most specific rejection wins when several candidates refused for different reasons.
REJECTION_ORDER = (
    Reason.REJECTED_OOM_RISK,
    Reason.THROTTLED_WATERMARK,
    Reason.QUEUE_FULL,
    Reason.TOO_LONG,
)


def screen(
    *,
    too_long: bool,
    queue_full: bool,
    memory: Mapping[str, GpuMemory],
    need_bytes: Mapping[str, int],
    watermark: float,
) -> Reason | None:
    """The first rule that refuses the request on this candidate, ``None`` when all pass.

    ``memory``: the candidate's GPUs as its ledger sees them; ``need_bytes``: the KV the request
    is admitted with, per GPU.
    """
    if too_long:
        return Reason.TOO_LONG
    if queue_full:
        return Reason.QUEUE_FULL
    if not check_watermark(memory, need_bytes, watermark).allowed:
        return Reason.THROTTLED_WATERMARK
    return None


def worst_refusal(refused: Collection[Reason]) -> Reason:
    """The reason given for a request every candidate refused (``refused``: not empty)."""
    return next(r for r in REJECTION_ORDER if r in refused)


def transient(
    memory: Mapping[str, GpuMemory],
    own_bytes: Mapping[str, int],
    need_bytes: Mapping[str, int],
    watermark: float,
) -> bool:
    """True when the request would pass the watermark on GPUs holding only ``own_bytes`` (the
    candidate replica's weights): what refuses it now is other sequences' KV, which frees as
    they finish. False: it cannot pass there however long it waits."""
    alone = {u: GpuMemory(m.total_bytes, own_bytes.get(u, 0)) for u, m in memory.items()}
    return check_watermark(alone, need_bytes, watermark).allowed


# The share of the TTFT SLO a request may wait for memory by default. NOTE: measured, not
# derived (bench/HISTORY.md 2026-12-02): waiting the whole SLO served more requests but fewer
# within it on bench.multimodel's farm than refusing at once — a request admitted late still
# queues behind others' prefills, and lets in long prompts whose prefill delays everyone's
# first token; half the SLO, whose first-token estimate is a lower bound, was better on both
# scenarios.
MEMORY_WAIT_SHARE_OF_TTFT_SLO = 0.5


def default_memory_wait_s(ttft_slo_s: float) -> float:
    """How long a transient watermark refusal may wait for memory by default."""
    return MEMORY_WAIT_SHARE_OF_TTFT_SLO * ttft_slo_s


def ttft_deadline_s(configured_s: float | None, ttft_slo_s: float) -> float:
    """How long a new request may go without a first token before it is refused: the
    configured deadline, by default (``None``) the deployment's TTFT SLO (0: never refused)."""
    return ttft_slo_s if configured_s is None else configured_s


def first_token_s(timing: ReplicaTiming, prompt_tokens: int) -> float:
    """The time a request's first token takes once its replica runs it: the prompt's prefill
    and one decode cycle (alone, on an idle GPU: a lower bound)."""
    return timing.prefill_s(prompt_tokens) + timing.decode_cycle_s(1, prompt_tokens)


def too_late_to_prefill(
    start_s: float, due_s: float | None, timing: ReplicaTiming, prompt_tokens: int
) -> bool:
    """Whether a prefill starting at ``start_s`` cannot give the first token by ``due_s`` (the
    request's TTFT deadline; ``None``: none) even at :func:`first_token_s`, a lower bound:
    the engine would spend the prefill on a request the deadline refuses anyway."""
    return due_s is not None and start_s + first_token_s(timing, prompt_tokens) > due_s


def memory_wait_until_s(
    refusal: Reason,
    soonest_first_token_s: float | None,
    first_refused_s: float,
    now_s: float,
    wait_s: float,
) -> float | None:
    """Until when a refused request waits for memory, ``None`` when it is refused now.

    Only a watermark refusal that is :func:`transient` on some candidate waits
    (``soonest_first_token_s``: :func:`first_token_s` on the fastest such candidate, ``None``
    when there is none), and only while it can still start in time: until ``wait_s`` after its
    first refusal, less that first-token time: with the TTFT SLO (or a share of it) as
    ``wait_s``, a request admitted later could not meet it.
    """
    if refusal is not Reason.THROTTLED_WATERMARK or soonest_first_token_s is None:
        return None
    until_s = first_refused_s + wait_s - soonest_first_token_s
    return until_s if now_s < until_s else None

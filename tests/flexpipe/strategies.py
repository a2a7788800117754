"""Hypothesis strategies that build every payload kind from its dataclass field types."""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from typing import Any

from hypothesis import strategies as st

from flexpipe import envelope
from flexpipe.schemas import PAYLOAD_TYPES
from gearbox.decisions import Decision, DecisionReason, Trigger
from gearbox.plans import DeploymentPlan
from gearbox.types import LoadSnapshot
from tests.runtime.builders import gearbox_decision, make_plan, make_replica

_JSON_SCALAR = st.none() | st.booleans() | st.integers(-(2**53), 2**53) | st.text(max_size=20)
_JSON = st.recursive(
    _JSON_SCALAR,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


_PLANS = st.sampled_from(
    [
        make_plan(make_replica(["A0"])),
        make_plan(make_replica(["A0", "A1"]), make_replica(["B0", "B1"], domain="B")),
        make_plan(make_replica(["A0", "A1", "A2", "A3"], gpu_class="a100-80g"), deployment="chat"),
    ]
)
# NOTE: gearbox's values check their own invariants (a plan's replicas are disjoint, a load's
# means are >= 1); field-by-field random values would mostly be invalid, so draw valid ones.
_GEARBOX: dict[Any, st.SearchStrategy[Any]] = {
    DeploymentPlan: _PLANS,
    Decision: st.builds(
        gearbox_decision,
        _PLANS,
        now_s=st.floats(0, 1e9),
        from_plan_id=st.none() | st.text(max_size=20),
        reason=st.sampled_from(list(DecisionReason)),
        trigger=st.sampled_from(list(Trigger)),
    ),
    LoadSnapshot: st.builds(
        LoadSnapshot,
        now_s=st.floats(0, 1e9),
        arrival_rate_rps=st.floats(0, 1e6),
        mean_prompt_tokens=st.floats(1, 1e6),
        mean_output_tokens=st.floats(1, 1e6),
        queue_len=st.integers(0, 2**31),
    ),
}


def for_type(hint: Any) -> st.SearchStrategy[Any]:
    """A strategy for one field type of the schema dataclasses (JSON-representable values)."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return st.one_of([for_type(a) for a in args])
    if origin is tuple and args[-1] is not Ellipsis:  # fixed length, e.g. (bucket, count)
        return st.tuples(*(for_type(a) for a in args))
    if origin is tuple:
        return st.lists(for_type(args[0]), max_size=3).map(tuple)
    if origin is dict:
        return st.dictionaries(st.text(max_size=10), _JSON, max_size=4)
    if hint is type(None):
        return st.none()
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return st.sampled_from(list(hint))
    if hint in _GEARBOX:
        return _GEARBOX[hint]
    if dataclasses.is_dataclass(hint):
        return for_dataclass(hint)  # type: ignore[arg-type]
    simple: dict[Any, st.SearchStrategy[Any]] = {
        bool: st.booleans(),
        int: st.integers(-(2**63), 2**63 - 1),
        float: st.floats(allow_nan=False, allow_infinity=False),
        str: st.text(max_size=30),
    }
    return simple[hint]


def for_dataclass(cls: type) -> st.SearchStrategy[Any]:
    """Build ``cls`` with a strategy per field."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: for_type(hints[f.name]) for f in dataclasses.fields(cls)}
    return st.builds(cls, **fields)


def payloads() -> st.SearchStrategy[Any]:
    """Any valid payload of any kind."""
    return st.one_of([for_dataclass(cls) for cls in PAYLOAD_TYPES.values()])


def envelopes() -> st.SearchStrategy[envelope.Envelope[Any]]:
    """Any valid envelope."""
    return st.builds(
        lambda p, t, s, q: envelope.make(p, event_time_ms=t, source=s, seq=q),
        payloads(),
        st.integers(0, 2**53),
        st.text(min_size=1, max_size=40),
        st.integers(0, 2**62),
    )

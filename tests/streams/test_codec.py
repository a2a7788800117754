"""Table values round-trip through bytes, generic window states included."""

from __future__ import annotations

import orjson
import pytest

from flexpipe.latency import histogram
from gearbox.config import DEFAULT_CONFIG
from gearbox.correction import Corrections, observe
from gearbox.history import BlockHistory, BlockSample, BlockSeries, GearState
from gearbox.serde import to_plain
from streams.codec import dumps, loads
from streams.load import LaunchWindow, ServingWindows, fold_launches, fold_serving
from streams.state import NodeState, fold_cluster_event
from streams.step import Cursor, OverrideState, PlanState
from streams.windows import HoppingWindow
from tests.streams.builders import make_launches, make_load, node_up

pytestmark = pytest.mark.unit


def test_format_is_gearbox_serde() -> None:
    node, _ = fold_cluster_event(None, node_up("n", "A", "nvlink", 1.5), "s", 1, 0)
    for value in (node, Cursor(3, 99, 2), GearState()):
        assert dumps(value) == orjson.dumps(to_plain(value))


def test_round_trips() -> None:
    w = HoppingWindow(10.0, 2.0)
    launches, _ = fold_launches(LaunchWindow(), w, make_launches(), "s", 1, 1000)
    timed = make_load(ttft_histogram=histogram([80.0, 120.0, 2500.0]))
    serving, _ = fold_serving(ServingWindows(), w, timed, "s", 1, 1000)
    node, _ = fold_cluster_event(None, node_up("n", "A", "nvlink", 1.5), "s", 1, 0)
    # a restarted worker gets back what gearbox learned, not only blocks and history
    learned = observe(Corrections(), "h100/tp8", 200.0, 500.0, 60, 30.0, None, DEFAULT_CONFIG)
    for value in (
        launches,
        serving,
        node,
        Cursor(3, 99),
        PlanState(),
        OverrideState(),
        GearState(),
        GearState(corrections=learned),
    ):
        assert loads(type(value), dumps(value)) == value


def test_large_values_are_compressed_below_the_kafka_message_limit() -> None:
    samples = tuple(BlockSample(1_736_150_400.0 + 15 * i, 8) for i in range(240))
    history = BlockHistory(tuple(BlockSeries(f"nv-{b}:0123abcd", samples) for b in range(125)))
    state = GearState(history=history)
    raw = dumps(state)
    assert raw[:1] == b"\x00" and len(raw) < 200_000
    assert loads(GearState, raw) == state


def test_malformed_bytes_raise_value_error() -> None:
    with pytest.raises(ValueError):
        loads(NodeState, b"{not json")
    with pytest.raises(ValueError, match="node"):
        loads(NodeState, b"{}")
    with pytest.raises(ValueError):
        loads(Cursor, b'{"seq": "one"}')
    with pytest.raises(ValueError, match="compressed"):
        loads(Cursor, b"\x00not zlib")


def test_a_bad_nested_field_is_named_through_generic_windows() -> None:
    # Panes[LaunchSums] inside a LaunchWindow: the decoder built for the bound type variable
    # still checks the innermost field and names the path to it
    raw = b'{"panes": {"panes": [[3, {"launches": "many", "covered_s": 0.2}]]}}'
    with pytest.raises(ValueError, match=r"LaunchWindow\.panes: .*LaunchSums\.launches"):
        loads(LaunchWindow, raw)
    assert loads(LaunchWindow, raw.replace(b'"many"', b"7")).panes.panes[0][1].launches == 7

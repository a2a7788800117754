"""The view reader passes over the changelog's echo of this worker's own GPU writes (already
applied as written) and decodes everything else; the view comes out the same either way."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from streams import codec
from streams.deployments import resolve_deployments
from streams.ports import TableName
from streams.readers import ViewReader
from streams.state import fold_gpu_sample
from streams.view import ClusterView
from tests.streams.builders import T0_MS, make_sample, streams_config
from tests.streams.fakes import make_engine

pytestmark = pytest.mark.unit

GPUS, NODES = "app-gpus-changelog", "app-nodes-changelog"


def _reader(view: ClusterView) -> ViewReader:
    return ViewReader(streams_config(), GPUS, NODES, view, lambda: None)


def test_the_echo_of_a_flushed_record_is_not_decoded_and_changes_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cfg = streams_config()
    catalog, deployments = resolve_deployments(cfg)
    engine, tables, _ = make_engine(cfg, catalog, deployments)
    state, _ = fold_gpu_sample(None, make_sample("gpu-0"), "src", 1, T0_MS)
    assert state is not None
    engine._gpus["gpu-0"] = state
    engine._dirty_gpus.add("gpu-0")
    assert engine.flush() == 1
    written = tables.data[TableName.GPUS][b"gpu-0"]
    before = dict(engine.view.gpus)

    decoded: list[bytes] = []
    real_loads = codec.loads

    def counting_loads(cls: type[Any], raw: bytes) -> Any:
        decoded.append(raw)
        return real_loads(cls, raw)

    monkeypatch.setattr(codec, "loads", counting_loads)
    reader = _reader(engine.view)
    reader._apply(GPUS, written, b"gpu-0")
    assert decoded == [] and reader.records == 1
    assert engine.view.gpus == before

    # another writer's newer record under the same key is decoded and applied
    newer = replace(engine.view.gpus["gpu-0"], rev=engine.view.gpus["gpu-0"].rev + 1)
    reader._apply(GPUS, codec.dumps(newer), b"gpu-0")
    assert len(decoded) == 1 and engine.view.gpus["gpu-0"] == newer
    # and a record without a key, or under a key this worker never wrote, too
    reader._apply(GPUS, written, None)
    other = replace(newer, uuid="gpu-1", rev=1)
    reader._apply(GPUS, codec.dumps(other), b"gpu-1")
    assert len(decoded) == 3 and engine.view.gpus["gpu-1"] == other


def test_a_view_that_decodes_every_echo_ends_the_same() -> None:
    """What the reader would have done without the pass-over: the same view."""
    state, _ = fold_gpu_sample(None, make_sample("gpu-0"), "src", 1, T0_MS)
    assert state is not None
    first, second = replace(state, rev=1), replace(state, rev=2, last_seen_s=state.last_seen_s + 5)
    skipping, decoding = ClusterView(), ClusterView()
    reader_s, reader_d = _reader(skipping), _reader(decoding)
    for record in (first, second):
        raw = codec.dumps(record)
        skipping.written_gpu(b"gpu-0", raw, record)
        decoding.apply_gpu(record)
    # echoes arrive late, in order: the first one after the second write
    for record in (first, second):
        raw = codec.dumps(record)
        reader_s._apply(GPUS, raw, b"gpu-0")
        reader_d._apply(GPUS, raw, None)
    assert skipping == decoding
    assert skipping.gpus["gpu-0"] == second and skipping.version == decoding.version

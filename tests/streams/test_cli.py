"""`flexpipe streams` and `flexpipe audit` are wired into the one CLI."""

from __future__ import annotations

import pytest

from flexpipe.cli import build_parser

pytestmark = pytest.mark.unit


def test_streams_and_audit_subcommands_parse() -> None:
    parser = build_parser()
    args = parser.parse_args(["streams", "worker", "--worker-id", "w7"])
    assert args.handler.__name__ == "_streams" and args.worker_id == "w7"
    args = parser.parse_args(["audit", "tail", "--from-beginning", "--limit", "3"])
    assert args.handler.__name__ == "_audit" and args.limit == 3 and args.from_beginning
    assert parser.parse_args(["audit", "replay"]).action == "replay"


def test_the_worker_sets_the_young_generations_threshold_only() -> None:
    import gc

    from flexpipe.config import StreamsConfig
    from streams.worker import tune_gc

    before = gc.get_threshold()
    try:
        tune_gc(StreamsConfig().gc_young_objects)
        assert gc.get_threshold() == (50_000, *before[1:])
        gc.set_threshold(*before)
        tune_gc(0)  # Python's own
        assert gc.get_threshold() == before
    finally:
        gc.set_threshold(*before)

"""`python -m streams.worker` / `flexpipe streams worker`: run one stream-processing worker.

Creates the topics it needs, serves Prometheus metrics when ``streams.metrics_port`` is set,
and runs the Faust worker until SIGINT/SIGTERM. Start several (same config, same app id) to
share partitions; each deployment is decided by the worker owning its partition.

``--profile PATH`` runs the worker under cProfile and writes pstats to PATH when it stops: the
event-loop thread (faust, aiokafka, the folds) and the decision thread (the steps, see
:mod:`streams.decider`), each in its own thread's CPU time, merged: what
``python -m bench.pipeline --profile-worker`` reads to split a worker's CPU by package.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import pstats
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from prometheus_client import CollectorRegistry, start_http_server

from flexpipe.config import FlexPipeConfig, load_config
from flexpipe.errors import FlexPipeError

__all__ = ["EXIT_DECISIONS_FAILING", "main", "run_worker"]

EXIT_DECISIONS_FAILING = 3


def tune_gc(young_objects: int) -> None:
    """Set the cyclic collector's generation-0 threshold (``streams.gc_young_objects``; 0 keeps
    Python's); the older generations keep theirs.

    NOTE: the worker's state is immutable records replaced as telemetry folds: they live for
    seconds, so at Python's 700 they survived two young passes and piled into the oldest
    generation, whose full passes (19 in a 2-minute bench.pipeline run, 0.2-0.4 s each) stop
    the event loop and the decision thread alike. Freed by reference counting, nearly none of
    them is cyclic garbage; a larger young generation lets them die there.
    """
    if young_objects > 0:
        gc.set_threshold(young_objects, *gc.get_threshold()[1:])


def run_worker(cfg: FlexPipeConfig, worker_id: str | None = None) -> int:
    """Run a worker in this process until it is stopped; returns the exit code."""
    from faust.worker import Worker

    from streams.app import create_app, ensure_topics

    tune_gc(cfg.streams.gc_young_objects)
    asyncio.run(ensure_topics(cfg))
    registry = CollectorRegistry()
    if cfg.streams.metrics_port:
        start_http_server(cfg.streams.metrics_port, registry=registry)
    wiring = create_app(cfg, registry, worker_id=worker_id)
    worker = Worker(wiring.app, loglevel=cfg.streams.loglevel, quiet=True)
    # NOTE: faust's start-up spinner sets the root logger to DEBUG for good (its handler shows
    # every record), so every library's debug call built a record the WARN handler then dropped:
    # ~9 % of a busy worker's CPU in aiokafka's fetcher alone. No spinner, the configured level.
    worker.spinner = None
    try:
        worker.execute_from_commandline()  # NOTE: installs signal handlers; exits the process
    except SystemExit as exc:
        # NOTE: a crashed app stops the worker "cleanly" (exit 0); its supervisor must see why.
        if wiring.failures.exhausted:
            print(
                f"streams worker: error: {wiring.failures.consecutive} decision runs failed in a"
                " row (streams.max_tick_failures); see the log for each error",
                file=sys.stderr,
            )
            return EXIT_DECISIONS_FAILING
        return exc.code if isinstance(exc.code, int) else 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m streams.worker``."""
    parser = argparse.ArgumentParser(prog="python -m streams.worker", description=__doc__)
    parser.add_argument("--config", help="YAML config file (default $FLEXPIPE_CONFIG)")
    parser.add_argument("--worker-id", help="names this worker in decisions (default host-pid)")
    parser.add_argument(
        "--profile",
        type=Path,
        metavar="PATH",
        help="run under cProfile (each thread's CPU time) and write pstats to PATH on exit",
    )
    args = parser.parse_args(argv)
    # NOTE: thread CPU time: with process time, the decision thread's CPU would be charged to
    # whatever the loop thread was doing meanwhile (mostly waiting in select)
    profile = cProfile.Profile(time.thread_time) if args.profile else None
    steps = cProfile.Profile(time.thread_time)
    try:
        if profile is not None:
            from streams.decider import profile_steps

            profile_steps(steps)
            profile.enable()
        return run_worker(load_config(args.config), args.worker_id)
    except FlexPipeError as exc:
        print(f"streams worker: error: {exc}", file=sys.stderr)
        return 2
    finally:
        if profile is not None:
            profile.disable()
            stats = pstats.Stats(profile)
            if steps.getstats():
                stats.add(steps)
            stats.dump_stats(args.profile)


if __name__ == "__main__":
    sys.exit(main())

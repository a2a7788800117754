"""Process entry point of a runtime worker (``python -m runtime.cli``).

``flexpipe runtime`` takes the same options and calls :func:`run_worker`.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from collections.abc import Sequence

from flexpipe.config import FlexPipeConfig, load_config
from flexpipe.errors import FlexPipeError
from flexpipe.schemas import TransitionPhase
from runtime.flags import add_arguments, with_flags
from runtime.worker import RuntimeWorker


async def run_worker(cfg: FlexPipeConfig, args: argparse.Namespace) -> int:
    """Run a worker until SIGINT/SIGTERM; prints one ``ready`` line with the HTTP URL.

    The engine flags override the config's runtime keys; an invalid combination (torch without
    a ledger directory, one that cannot be written) stops the start, naming the key.
    """
    pause = TransitionPhase(args.pause_in) if args.pause_in else None
    worker = RuntimeWorker(
        with_flags(cfg, args),
        deployments=args.deployment,
        pause_in=pause,
        pause_from_seq=args.pause_from_seq,
        http_port=args.port,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with worker:
        print(
            f"runtime ready {worker.http_url} deployments={','.join(worker.deployments)}",
            flush=True,
        )
        await stop.wait()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m runtime.cli``: same options as ``flexpipe runtime``."""
    parser = argparse.ArgumentParser(
        prog="python -m runtime.cli", description=RuntimeWorker.__doc__
    )
    parser.add_argument("--config", default=None, help="YAML config (default $FLEXPIPE_CONFIG)")
    add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        return asyncio.run(run_worker(load_config(args.config), args))
    except FlexPipeError as exc:
        print(f"runtime: error: {exc}", flush=True)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())

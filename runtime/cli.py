"""Process entry point of a runtime worker (``python -m runtime.cli``).

``flexpipe runtime`` takes the same options and calls :func:`run_worker`.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from collections.abc import Sequence

from flexpipe.config import FlexPipeConfig, load_config, with_runtime
from flexpipe.errors import ConfigError, FlexPipeError
from flexpipe.schemas import TransitionPhase
from runtime.worker import RuntimeWorker


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options shared by ``python -m runtime.cli`` and ``flexpipe runtime``."""
    parser.add_argument("--deployment", action="append", default=None, help="repeatable")
    parser.add_argument("--port", type=int, default=None, help="HTTP port (0 = pick one)")
    parser.add_argument(
        "--pause-in",
        choices=[
            p.value
            for p in (TransitionPhase.PREPARE, TransitionPhase.SWITCH, TransitionPhase.CLEANUP)
        ],
        default=None,
        help="TEST HOOK: hold transitions just before this phase would finish",
    )
    parser.add_argument(
        "--pause-from-seq", type=int, default=0, help="TEST HOOK: hold only from this transition"
    )
    parser.add_argument(
        "--engine",
        choices=["sim", "torch"],
        default=None,
        help="sets runtime.engine: sim (SimEngine, the default) or torch (the torch reference "
        "engine on this host's CPU, a small stand-in model; needs --ledger-dir)",
    )
    parser.add_argument(
        "--ledger-dir",
        default=None,
        help="sets runtime.ledger_dir: the torch engine's token ledgers, one file per "
        "deployment; a restarted worker resumes its sequences from them",
    )


def with_flags(cfg: FlexPipeConfig, args: argparse.Namespace) -> FlexPipeConfig:
    """``cfg`` with the runtime keys that ``--engine`` / ``--ledger-dir`` set, validated."""
    # NOTE: getattr: `flexpipe runtime` builds its own parser, which may lack these flags
    flags = {
        "engine": getattr(args, "engine", None),
        "ledger_dir": getattr(args, "ledger_dir", None),
    }
    overrides = {key: value for key, value in flags.items() if value is not None}
    if not overrides:
        return cfg
    try:
        return with_runtime(cfg, **overrides)
    except ConfigError as exc:
        given = ", ".join("--" + key.replace("_", "-") for key in overrides)
        raise ConfigError(f"{exc} (flags given: {given})") from None


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

"""The runtime worker's command-line options, shared by ``python -m runtime.cli`` and
``flexpipe runtime`` (kept apart from :mod:`runtime.cli` so the ``flexpipe`` parser does not
import the worker to build its help).
"""

from __future__ import annotations

import argparse

from flexpipe.config import FlexPipeConfig, with_runtime
from flexpipe.errors import ConfigError
from flexpipe.schemas import TransitionPhase


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
    flags = {"engine": args.engine, "ledger_dir": args.ledger_dir}
    overrides = {key: value for key, value in flags.items() if value is not None}
    if not overrides:
        return cfg
    try:
        return with_runtime(cfg, **overrides)
    except ConfigError as exc:
        given = ", ".join("--" + key.replace("_", "-") for key in overrides)
        raise ConfigError(f"{exc} (flags given: {given})") from None

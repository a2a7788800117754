"""The runtime worker's engines, chosen by ``runtime.engine``: SimEngine, or the torch one.

``sim`` (default): every deployment on :class:`~runtime.engine.sim.SimEngine`. ``torch``: every
deployment on the torch reference engine (:mod:`runtime.engine.torch.factory`: a small stand-in
model, one rank process per GPU of the plan) over a durable token ledger,
``<runtime.ledger_dir>/<deployment>.ledger``. The ledgers are read back here, when the worker is
built — before its recovery replays the ownership journal's unfinished requests, which then
resume after their last emitted token.

torch is imported only when the torch engine is chosen (seconds of start-up otherwise paid by
every SimEngine worker).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import quote

from flexpipe.config import RuntimeConfig
from flexpipe.errors import ConfigError
from runtime.deployment import EngineFactory
from runtime.engine.base import Engine

if TYPE_CHECKING:
    from runtime.engine.torch.tokens import TokenLedger


def ledger_path(ledger_dir: Path, deployment: str) -> Path:
    """The token ledger file of ``deployment`` under ``ledger_dir``."""
    return ledger_dir / f"{quote(deployment, safe='')}.ledger"


@dataclass
class WorkerEngines:
    """The engine factories a worker serves with (``None``: SimEngine everywhere) and the token
    ledgers they write."""

    factories: Mapping[str, EngineFactory] | None = None
    ledgers: dict[str, TokenLedger] = field(default_factory=dict)

    def close(self, engines: Iterable[Engine]) -> None:
        """Stop the rank processes of the torch engines among ``engines`` (the replicas still
        installed), then flush and close the ledgers; idempotent."""
        if not self.ledgers:  # SimEngine: nothing held open
            return
        from runtime.engine.torch.engine import TorchEngine

        for engine in engines:
            if isinstance(engine, TorchEngine):
                engine.close()
        for ledger in self.ledgers.values():
            ledger.close()


def _checked_dir(rc: RuntimeConfig) -> Path:
    assert rc.ledger_dir is not None  # RuntimeConfig requires it with engine torch
    path = Path(rc.ledger_dir)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"config key runtime.ledger_dir: {path}: {exc.strerror}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"config key runtime.ledger_dir: {path}: not writable")
    return path


def worker_engines(rc: RuntimeConfig, deployments: Sequence[str]) -> WorkerEngines:
    """The engines ``rc.engine`` names for ``deployments``; torch: ledgers loaded from disk and
    the ranks' fork server started (it imports torch once, before the worker serves)."""
    if rc.engine == "sim":
        return WorkerEngines()
    ledger_dir = _checked_dir(rc)
    try:
        from runtime.engine.torch.factory import DEMO_MODEL, torch_engine_factory, warm_up
        from runtime.engine.torch.tokens import TokenLedger
    except ImportError as exc:
        raise ConfigError(f"config key runtime.engine: torch: cannot import ({exc})") from None
    factories: dict[str, EngineFactory] = {}
    ledgers = {}
    for deployment in deployments:
        path = ledger_path(ledger_dir, deployment)
        try:
            ledgers[deployment] = TokenLedger(DEMO_MODEL.vocab_size, path, fsync=rc.ledger_fsync)
        except OSError as exc:
            raise ConfigError(f"config key runtime.ledger_dir: {path}: {exc.strerror}") from None
        factories[deployment] = torch_engine_factory(ledgers[deployment])
    warm_up()
    return WorkerEngines(factories, ledgers)


__all__ = ["WorkerEngines", "ledger_path", "worker_engines"]

"""The runtime's clock: wall time scaled by a speed (1.0 in production, faster in simulations)."""

from __future__ import annotations

import time


class SimClock:
    """Simulated seconds since start: ``speed`` simulated seconds per wall second."""

    def __init__(self, speed: float = 1.0, t0: float | None = None) -> None:
        self.speed = speed
        # A shared t0 (time.monotonic()) lets several components run one simulated clock.
        self._t0 = time.monotonic() if t0 is None else t0

    def now_s(self) -> float:
        """The runtime clock now."""
        return (time.monotonic() - self._t0) * self.speed

    def wall_s(self, runtime_s: float) -> float:
        """Wall seconds that ``runtime_s`` seconds of the runtime clock take."""
        return runtime_s / self.speed

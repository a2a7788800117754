"""``python -m runtime.cli`` as a child process for the crash tests: its HTTP URL once ready,
its output drained, SIGKILL or SIGTERM."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from flexpipe.config import FlexPipeConfig
from tests.runtime.builders import DEPLOYMENT

ROOT = Path(__file__).resolve().parents[2]
# a fast simulated clock: shifts of SimEngine deployments take wall seconds
SIM_ENV = {
    "FLEXPIPE_RUNTIME__SIM_SPEED": "20",
    "FLEXPIPE_RUNTIME__TICK_S": "0.01",
    "FLEXPIPE_RUNTIME__CANARY_S": "1",
    "FLEXPIPE_RUNTIME__DRAIN_TIMEOUT_S": "20",
    "FLEXPIPE_RUNTIME__WORKER_ID": "crash-test",
}


class WorkerProcess:
    """``python -m runtime.cli`` as a child process, with its HTTP URL once ready.

    ``runtime_env`` holds the worker's runtime settings (environment variables); the broker
    and topics come from ``cfg``.
    """

    def __init__(
        self, cfg: FlexPipeConfig, *extra: str, runtime_env: Mapping[str, str] = SIM_ENV
    ) -> None:
        env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "FLEXPIPE_KAFKA__BOOTSTRAP_SERVERS": cfg.kafka.bootstrap_servers or "",
            "FLEXPIPE_TOPICS__PREFIX": cfg.topics.prefix,
            "FLEXPIPE_TOPICS__PARTITIONS": str(cfg.topics.partitions),
            **runtime_env,
        }
        args = [sys.executable, "-m", "runtime.cli", "--deployment", DEPLOYMENT, "--port", "0"]
        self.proc = subprocess.Popen(
            [*args, *extra],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.url = ""
        self.output: list[str] = []

    async def ready(self, timeout_s: float = 60.0) -> str:
        """Wait for the ready line; return the HTTP base URL."""

        def read() -> str:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                self.output.append(line)
                if line.startswith("runtime ready "):
                    return line.split()[2]
            raise AssertionError("worker exited before ready:\n" + "".join(self.output[-30:]))

        self.url = await asyncio.wait_for(asyncio.to_thread(read), timeout_s)
        asyncio.get_running_loop().run_in_executor(None, self._drain)
        return self.url

    def _drain(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:  # keep the pipe from filling up
            self.output.append(line)

    def kill9(self) -> None:
        """SIGKILL: no cleanup, no flush, nothing."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self, wait_s: float = 15.0) -> None:
        """SIGTERM and wait (SIGKILL if it hangs)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(wait_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

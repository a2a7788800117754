"""Stream workers as child processes, for the benchmark and the crash/rebalance tests.

:class:`WorkerProcess` writes the config to a YAML file, starts ``python -m streams.worker``,
scrapes its Prometheus endpoint, and stops it gracefully (SIGTERM) or kills it (SIGKILL, a
crash). Waiting is always for a condition with a deadline, never a fixed sleep.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO

import yaml

from flexpipe.config import FlexPipeConfig

__all__ = ["WorkerProcess", "free_port", "parse_metrics", "wait_for"]

PROJECT_ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def wait_for(
    condition: Callable[[], bool], timeout_s: float, what: str, poll_s: float = 0.1
) -> None:
    """Poll ``condition`` until it holds; ``TimeoutError`` naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(poll_s)


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text format → {"name{labels}": value} (comments dropped)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        try:
            out[name] = float(value)
        except ValueError:
            continue
    return out


class WorkerProcess:
    """One ``python -m streams.worker`` child with its own metrics port and log file."""

    def __init__(self, cfg: FlexPipeConfig, workdir: Path, worker_id: str) -> None:
        self.worker_id = worker_id
        self.port = free_port()
        streams = cfg.streams.model_copy(update={"metrics_port": self.port})
        self.cfg = cfg.model_copy(update={"streams": streams})
        workdir.mkdir(parents=True, exist_ok=True)
        self.config_path = workdir / f"{worker_id}.yaml"
        self.log_path = workdir / f"{worker_id}.log"
        self.config_path.write_text(yaml.safe_dump(self.cfg.model_dump(mode="json")))
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    def start(self, *extra_args: str) -> WorkerProcess:
        """Start the child (returns at once; see :meth:`wait_ready`); ``extra_args`` go to
        ``python -m streams.worker`` after the config and worker id."""
        self._log = self.log_path.open("ab")
        env = {**os.environ, "PYTHONPATH": str(PROJECT_ROOT)}
        env = {k: v for k, v in env.items() if not k.startswith("FLEXPIPE_")}
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "streams.worker",
                "--config",
                str(self.config_path),
                "--worker-id",
                self.worker_id,
                *extra_args,
            ],
            cwd=PROJECT_ROOT,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        return self

    @property
    def alive(self) -> bool:
        """Whether the child runs."""
        return self.proc is not None and self.proc.poll() is None

    def metrics(self, names: Sequence[str] = ()) -> dict[str, float]:
        """Scrape the child's metrics (only the samples ``names`` when given: the exporter then
        collects only those metrics); empty while it is not serving."""
        try:
            query = urllib.parse.urlencode([("name[]", n) for n in names])
            url = f"http://127.0.0.1:{self.port}/metrics" + (f"?{query}" if query else "")
            with urllib.request.urlopen(url, timeout=2) as resp:
                return parse_metrics(resp.read().decode())
        except OSError:
            return {}

    def metric(self, name: str, default: float = 0.0) -> float:
        """One sample by its full name (``name{labels}``)."""
        return self.metrics().get(name, default)

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        """Until the worker says it may decide (view caught up, warm-up passed)."""

        def ready() -> bool:
            if not self.alive:
                raise RuntimeError(f"worker {self.worker_id} exited; log {self.log_path}")
            return self.metric("flexpipe_streams_ready") == 1.0

        wait_for(ready, timeout_s, f"worker {self.worker_id} ready")

    def kill(self) -> None:
        """SIGKILL: a crash, no clean shutdown, nothing flushed."""
        if self.proc is not None and self.alive:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)
        self._close_log()

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM and wait (a clean leave: the group rebalances at once)."""
        if self.proc is not None and self.alive:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._close_log()

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    def log_tail(self, lines: int = 40) -> str:
        """The end of the child's log, for failure messages."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

"""A real single-node Apache Kafka (KRaft, combined broker+controller) on loopback.

Jars come from Maven Central through ``mvn`` (``deploy/kafka/pom.xml``) into a cache directory;
the broker runs as a plain ``java kafka.Kafka`` process whose pid, port and log live in a run
directory, so ``down`` stops exactly the process ``up`` started. A user with a real cluster sets
``kafka.bootstrap_servers`` and never starts this.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import logging
import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flexpipe.config import LocalKafkaConfig
from flexpipe.errors import FlexPipeError

PROJECT_ROOT = Path(__file__).resolve().parent.parent
POM = PROJECT_ROOT / "deploy" / "kafka" / "pom.xml"

_LOG4J2 = """\
status = warn
appender.file.type = File
appender.file.name = FILE
appender.file.fileName = {log}
appender.file.layout.type = PatternLayout
appender.file.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = INFO
rootLogger.appenderRef.file.ref = FILE
logger.state.name = state.change.logger
logger.state.level = WARN
"""

_SERVER = """\
process.roles=broker,controller
node.id=1
controller.quorum.bootstrap.servers=127.0.0.1:{cport}
listeners=PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{cport}
advertised.listeners=PLAINTEXT://127.0.0.1:{port}
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT
log.dirs={data}
num.partitions=1
offsets.topic.replication.factor=1
offsets.topic.num.partitions=10
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
transaction.state.log.num.partitions=4
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
group.initial.rebalance.delay.ms=0
auto.create.topics.enable=true
# NOTE: the cleaner's default 128 MiB dedupe buffer does not fit a small heap.
log.cleaner.dedupe.buffer.size=16777216
"""


class KafkaStartError(FlexPipeError):
    """The local broker could not be prepared or started."""


@dataclass(frozen=True, slots=True)
class BrokerStatus:
    """What ``status`` reports about the local broker."""

    running: bool
    pid: int | None
    bootstrap: str | None
    run_dir: Path
    log: Path


class LocalKafka:
    """Manage one named local broker under ``cfg.cache_dir``."""

    def __init__(self, cfg: LocalKafkaConfig, name: str = "default") -> None:
        self.cfg = cfg
        cache = Path(cfg.cache_dir)
        self.cache = cache if cache.is_absolute() else PROJECT_ROOT / cache
        self.libs = self.cache / f"libs-{cfg.version}"
        self.run_dir = self.cache / "run" / name
        self.pid_file = self.run_dir / "kafka.pid"
        self.port_file = self.run_dir / "kafka.port"
        self.log = self.run_dir / "server.log"

    # -- jars ---------------------------------------------------------------------------------
    def ensure_jars(self) -> Path:
        """Resolve the broker's jars into the cache (once; later calls are a file check)."""
        marker = self.libs / ".complete"
        if marker.exists():
            return self.libs
        if shutil.which("mvn") is None:
            raise KafkaStartError("mvn not found: install Maven (apt-get install maven)")
        tmp = self.libs.with_name(self.libs.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        cmd = [
            "mvn", "-q", "-B", "-f", str(POM), "dependency:copy-dependencies",
            f"-Dkafka.version={self.cfg.version}", "-DincludeScope=runtime",
            f"-DoutputDirectory={tmp}",
        ]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0 or not any(tmp.glob("kafka_2.13-*.jar")):
            tail = (proc.stdout + proc.stderr).strip().splitlines()[-5:]
            raise KafkaStartError("resolving Kafka jars with mvn failed: " + " | ".join(tail))
        shutil.rmtree(self.libs, ignore_errors=True)
        tmp.rename(self.libs)
        marker.touch()
        return self.libs

    # -- lifecycle ----------------------------------------------------------------------------
    def status(self) -> BrokerStatus:
        """Whether the broker this manager started is alive, and where it listens."""
        pid = _read_int(self.pid_file)
        alive = pid is not None and _is_our_broker(pid, self.run_dir)
        port = _read_int(self.port_file)
        return BrokerStatus(
            running=alive,
            pid=pid if alive else None,
            bootstrap=f"127.0.0.1:{port}" if alive and port else None,
            run_dir=self.run_dir,
            log=self.log,
        )

    def up(self, fresh: bool = False) -> str:
        """Start the broker (or find it running) and return its bootstrap address."""
        st = self.status()
        if st.running and st.bootstrap and not fresh:
            return st.bootstrap
        if st.running:
            self.down()
        if fresh:
            shutil.rmtree(self.run_dir, ignore_errors=True)
        libs = self.ensure_jars()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        port = _read_int(self.port_file) or self.cfg.port or _free_port()
        cport = _free_port()
        props = self._write_configs(port, cport)
        classpath = f"{libs}/*"
        self._format_storage(classpath, props)
        java = _java()
        cmd = [
            java, f"-Xmx{self.cfg.heap_mb}m", f"-Xms{min(self.cfg.heap_mb, 256)}m",
            "-XX:+UseG1GC", "-Djava.awt.headless=true",
            f"-Dlog4j2.configurationFile={self.run_dir / 'log4j2.properties'}",
            f"-Dflexpipe.run_dir={self.run_dir}",  # lets status/down recognise our process
            "-cp", classpath, "kafka.Kafka", str(props),
        ]  # fmt: skip
        with open(self.run_dir / "stdout.log", "ab") as out:
            proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.pid_file.write_text(str(proc.pid))
        self.port_file.write_text(str(port))
        bootstrap = f"127.0.0.1:{port}"
        self._wait_ready(proc, bootstrap)
        return bootstrap

    def down(self, timeout_s: float = 30.0) -> bool:
        """Stop the broker this manager started (by pid); True when one was stopped."""
        pid = _read_int(self.pid_file)
        if pid is None or not _is_our_broker(pid, self.run_dir):
            self.pid_file.unlink(missing_ok=True)
            return False
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and _alive(pid):
            time.sleep(0.1)
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
            while _alive(pid):
                time.sleep(0.05)
        self.pid_file.unlink(missing_ok=True)
        return True

    # -- helpers ------------------------------------------------------------------------------
    def _write_configs(self, port: int, cport: int) -> Path:
        data = self.run_dir / "data"
        props = self.run_dir / "server.properties"
        props.write_text(_SERVER.format(port=port, cport=cport, data=data))
        (self.run_dir / "log4j2.properties").write_text(_LOG4J2.format(log=self.log))
        return props

    def _format_storage(self, classpath: str, props: Path) -> None:
        if (self.run_dir / "data" / "meta.properties").exists():
            return
        cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        cmd = [
            _java(), "-Xmx256m", f"-Dlog4j2.configurationFile={self.run_dir / 'log4j2.properties'}",
            "-cp", classpath, "kafka.tools.StorageTool", "format",
            # NOTE: "=" form: a base64 id may start with "-" and read as an option.
            f"--cluster-id={cluster_id}", "-c", str(props), "--standalone",
        ]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise KafkaStartError(f"formatting KRaft storage failed: {proc.stdout}{proc.stderr}")

    def _wait_ready(self, proc: subprocess.Popen[bytes], bootstrap: str) -> None:
        deadline = time.monotonic() + self.cfg.start_timeout_s
        # NOTE: connection refusals are expected while the JVM starts; aiokafka would log each.
        quiet = logging.getLogger("aiokafka")
        level, quiet.level = quiet.level, logging.CRITICAL
        try:
            self._poll_ready(proc, bootstrap, deadline)
        finally:
            quiet.setLevel(level)

    def _poll_ready(self, proc: subprocess.Popen[bytes], bootstrap: str, deadline: float) -> None:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise KafkaStartError(
                    f"broker exited with {proc.returncode}; last log lines:\n{self._log_tail()}"
                )
            if _run_in_thread(broker_ready(bootstrap)):
                return
            time.sleep(0.25)
        self.down()
        raise KafkaStartError(f"broker not ready after {self.cfg.start_timeout_s:.0f}s")

    def _log_tail(self, lines: int = 15) -> str:
        text = ""
        for path in (self.run_dir / "stdout.log", self.log):
            if path.exists():
                text += "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) + "\n"
        return text


async def broker_ready(bootstrap: str, timeout_s: float = 2.0) -> bool:
    """True when the broker answers a metadata request (not merely accepts TCP)."""
    from aiokafka.admin import AIOKafkaAdminClient

    admin = AIOKafkaAdminClient(
        bootstrap_servers=bootstrap, request_timeout_ms=int(timeout_s * 1e3)
    )
    try:
        await asyncio.wait_for(admin.start(), timeout_s)
        await asyncio.wait_for(admin.describe_cluster(), timeout_s)
        return True
    except Exception:  # any failure means "not ready yet"
        return False
    finally:
        await admin.close()


def _run_in_thread(coro: Coroutine[Any, Any, bool]) -> bool:
    """Run a coroutine to completion on a private loop, even when the caller has a loop running."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coro).result()


def _java() -> str:
    home = os.environ.get("JAVA_HOME")
    if home and (Path(home) / "bin" / "java").exists():
        return str(Path(home) / "bin" / "java")
    found = shutil.which("java")
    if not found:
        raise KafkaStartError("java not found: install a JDK 17+ (apt-get install openjdk-17-jre)")
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child still "exists"; treat it as gone.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[-1][0] != "Z"
    except OSError:
        return False


def _is_our_broker(pid: int, run_dir: Path) -> bool:
    """Guard against pid reuse: the process must be kafka.Kafka started for this run dir."""
    if not _alive(pid):
        return False
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"kafka.Kafka" in cmdline and f"-Dflexpipe.run_dir={run_dir}".encode() in cmdline

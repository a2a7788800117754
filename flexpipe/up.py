"""`flexpipe up` (what `make run` runs): the whole loop on a simulated cluster, time-compressed.

A local Kafka (unless one is configured), the simulated node agents of a scenario, a faust stream
worker (its own process, as in production), a runtime worker with SimEngine (in this process), and
a load generator (short chat plus long-prompt summarisation) all run on one simulated clock. The
job prints a live gear timeline (:mod:`flexpipe.live`), then a summary, and writes
``out/report.md`` and ``out/timeline.png``. Topics get a per-run prefix so a run never reads
another run's data.

Start-up contract: the stream assumes each deployment's scenario *hint* is its current plan until
a transition confirms one; the runtime worker makes that true by loading the hint as transition 0
(a normal, persisted three-phase transition) before the load starts. The simulated cluster starts
empty and follows the runtime's placements, so its GPUs report what the runtime loaded.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError

from flexpipe.config import FlexPipeConfig
from flexpipe.errors import FlexPipeError
from flexpipe.kafka import client_kwargs, create_topics
from flexpipe.live import Timeline, status_loop
from flexpipe.mainjob import broker, publish, scenario_path
from flexpipe.report import RunRecord, Served, summary_lines, write_report
from gearbox.plans import DeploymentPlan
from probes.fleet import SimFleet
from probes.scenario import Scenario, load_scenario
from streams.app import app_id

DEFAULT_SCENARIO = "demo-shift"
# NOTE: measured on a busy 2-core machine: broker and stream-worker start take 10–15 s (one more
# worker start when it joined on stale metadata, ~10 s) and the report ~5 s, so 120 s of
# simulation keeps `make run` under three minutes.
DEFAULT_WALL_S = 120.0
LAUNCH_DRAIN_S = 5.0  # simulated agents drain launch maps every 5 s in the demo (200 ms live)
STATUS_EVERY_S = 120.0  # simulated seconds between live status blocks
START_DEADLINE_S = 60.0  # simulated seconds the starting plans may take before the load starts
GROUP_DEADLINE_S = 90.0  # wall seconds for the stream worker to join its consumer group
STALE_ASSIGNMENT_S = 5.0  # wall seconds a stable group may lack partitions before a restart
STREAMS_STARTS = 3  # stream-worker starts before `up` gives up
BROKER_PING_S = 2.0  # wall seconds between broker pings while the run lasts
BROKER_MISSES = 3  # pings missed in a row before the broker counts as gone


def run_config(cfg: FlexPipeConfig, address: str, scenario: Path, speed: float) -> FlexPipeConfig:
    """This run's config: its broker, a fresh topic prefix, the simulated clock's speed."""
    run_id = f"up{int(time.time())}"
    update: dict[str, Any] = {
        "kafka": cfg.kafka.model_copy(update={"bootstrap_servers": address}),
        "topics": cfg.topics.model_copy(update={"prefix": f"{cfg.topics.prefix}{run_id}."}),
        "runtime": cfg.runtime.model_copy(update={"sim_speed": speed, "http_port": 0}),
        "streams": cfg.streams.model_copy(update={"scenario": str(scenario)}),
    }
    return cfg.model_copy(update=update)


def config_env(cfg: FlexPipeConfig) -> dict[str, str]:
    """Environment overrides that give a child process the same config."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEXPIPE_")}
    flat = {
        "KAFKA__BOOTSTRAP_SERVERS": cfg.kafka.bootstrap_servers or "",
        "TOPICS__PREFIX": cfg.topics.prefix,
        "TOPICS__PARTITIONS": str(cfg.topics.partitions),
        "STREAMS__SCENARIO": cfg.streams.scenario or "",
        "INTERVALS__DECISION_S": str(cfg.intervals.decision_s),
        "STREAMS__LOGLEVEL": cfg.streams.loglevel,
    }
    return env | {f"FLEXPIPE_{k}": v for k, v in flat.items()}


def _died(proc: subprocess.Popen[bytes], log_path: Path) -> FlexPipeError:
    return FlexPipeError(f"the stream worker exited with code {proc.returncode}; see {log_path}")


class StaleAssignment(FlexPipeError):
    """The stream worker joined its group without the partitions it decides on."""


def assigned_partitions(group: Any, topic: str) -> set[int]:
    """Partitions of ``topic`` the members of a described consumer group hold."""
    from aiokafka.coordinator.protocol import ConsumerProtocolMemberAssignment

    out: set[int] = set()
    for member in group[5]:
        raw = member[-1]  # member_assignment is the last field in every protocol version
        if raw:
            for name, partitions in ConsumerProtocolMemberAssignment.decode(raw).assignment:
                if name == topic:
                    out.update(partitions)
    return out


async def wait_group_stable(
    cfg: FlexPipeConfig, proc: subprocess.Popen[bytes], log_path: Path
) -> None:
    """Wait until the stream worker joined its consumer group owning every triggers partition.

    NOTE: a worker that joins while freshly created topics are missing from the broker's
    metadata (a loaded machine) is assigned none of them and never decides; faust does not
    rebalance when they appear, so that is reported as :class:`StaleAssignment`.
    """
    from streams.app import triggers_topic

    admin = AIOKafkaAdminClient(**client_kwargs(cfg))
    await admin.start()
    wanted = set(range(cfg.topics.partitions))
    try:
        deadline = time.monotonic() + GROUP_DEADLINE_S
        stable_since: float | None = None
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise _died(proc, log_path)
            try:
                resp = await admin.describe_consumer_groups([app_id(cfg)])
            except KafkaError:  # the group coordinator appears a moment after the first join
                resp = []
            groups = resp[0].groups if resp else []
            if groups and groups[0][2] == "Stable":
                if assigned_partitions(groups[0], triggers_topic(cfg)) >= wanted:
                    return
                stable_since = stable_since or time.monotonic()
                if time.monotonic() - stable_since > STALE_ASSIGNMENT_S:
                    raise StaleAssignment(
                        f"the stream worker was assigned no triggers partition; see {log_path}"
                    )
            await asyncio.sleep(0.5)
        raise FlexPipeError(
            f"the stream worker did not join its consumer group within {GROUP_DEADLINE_S:.0f} s;"
            f" see {log_path}"
        )
    finally:
        await admin.close()


async def launch_streams(cfg: FlexPipeConfig, out_dir: Path) -> subprocess.Popen[bytes]:
    """Start the stream worker and wait until it owns its partitions; restart it (up to
    ``STREAMS_STARTS`` times in all) when it joined on stale topic metadata."""
    log_path = out_dir / "streams.log"
    for attempt in range(1, STREAMS_STARTS + 1):
        proc = start_streams(cfg, out_dir)
        try:
            await wait_group_stable(cfg, proc, log_path)
            return proc
        except StaleAssignment:
            stop_process(proc)
            if attempt == STREAMS_STARTS:
                raise
            print("up: the stream worker joined before its topics were visible; restarting it")
        except BaseException:
            stop_process(proc)
            raise
    raise AssertionError("unreachable")


def start_streams(cfg: FlexPipeConfig, out_dir: Path) -> subprocess.Popen[bytes]:
    """The faust worker as its own process, as it runs in a cluster; its log and its faust data
    directory go into ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "streams.log", "ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "flexpipe.cli", "streams", "worker", "--worker-id", "up"],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=config_env(cfg),
            cwd=out_dir,  # NOTE: faust writes its data directory into the working directory
            start_new_session=True,
        )


def stop_process(proc: subprocess.Popen[bytes], timeout_s: float = 20.0) -> None:
    """SIGTERM, then SIGKILL if it lingers."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def watch_broker(cfg: FlexPipeConfig) -> None:
    """Raise once the broker missed ``BROKER_MISSES`` pings in a row (it went away)."""
    admin = AIOKafkaAdminClient(**client_kwargs(cfg))
    await admin.start()
    missed = 0
    try:
        while missed < BROKER_MISSES:
            await asyncio.sleep(BROKER_PING_S)
            try:
                await asyncio.wait_for(admin.list_topics(), 2 * BROKER_PING_S)
                missed = 0
            except (KafkaError, OSError, TimeoutError):
                missed += 1
                # NOTE: every client now retries and logs each failed connect; this job says
                # once, below, what happened.
                logging.getLogger("aiokafka").setLevel(logging.CRITICAL)
        raise FlexPipeError(f"the Kafka broker at {cfg.kafka.bootstrap_servers} stopped answering")
    finally:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(admin.close(), BROKER_PING_S)


async def watch_process(proc: subprocess.Popen[bytes], log_path: Path) -> None:
    """Raise once the stream worker exits: it must outlive the run."""
    while proc.poll() is None:
        await asyncio.sleep(0.5)
    raise _died(proc, log_path)


async def supervise(main: asyncio.Task[Any], others: list[asyncio.Task[Any]]) -> None:
    """Wait for ``main``; the first failure of any task (``main`` included) is raised at once."""
    while not main.done():
        done, _ = await asyncio.wait([main, *others], return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            exc = None if task.cancelled() else task.exception()
            if exc is not None:
                raise exc
        others = [t for t in others if not t.done()]
    main.result()


def make_fleet(cfg: FlexPipeConfig, scenario: Scenario, seed: int) -> SimFleet:
    """The scenario's simulated node agents."""
    return SimFleet(
        scenario,
        seed=seed,
        sample_interval_s=cfg.intervals.sample_s,
        launch_interval_s=LAUNCH_DRAIN_S,
        heartbeat_s=cfg.intervals.heartbeat_s,
    )


def starting_plans(cfg: FlexPipeConfig, scenario: Scenario, seed: int) -> dict[str, DeploymentPlan]:
    """Each deployment's hint plan, computed as the stream computes it.

    NOTE: the same path as the stream worker — fold the agents' first round of telemetry, build
    the topology and its blocks, :func:`streams.deployments.hint_plan` — so the runtime's
    transition 0 loads exactly the plan id the stream assumes is serving.
    """
    from gearbox.blocks import build_blocks
    from gearbox.config import DEFAULT_CONFIG
    from streams.app import resolve_deployments
    from streams.deployments import hint_plan
    from streams.loop import view_timeout_s
    from streams.replay import Replayer
    from streams.snapshot import build_topology

    catalog, deployments = resolve_deployments(cfg)
    replayer = Replayer(cfg, catalog, deployments)
    for env in make_fleet(cfg, scenario, seed).events(0.0, cfg.intervals.sample_s):
        replayer.fold(env)
    now_s = replayer.clock_ms / 1000.0
    topology = build_topology(
        replayer.published, replayer.nodes, catalog, now_s, view_timeout_s(cfg)
    )
    blocks = build_blocks(topology, DEFAULT_CONFIG)
    plans = {d.name: hint_plan(deployments, d.name, topology, blocks) for d in deployments}
    return {name: plan for name, plan in plans.items() if plan is not None}


async def wait_serving(worker: Any, deadline_s: float) -> float:
    """Wait until every deployment serves a plan (or ``deadline_s`` passed); the clock then."""
    while worker.now_s() < deadline_s and any(
        rt.state.serving is None for rt in worker.runtimes.values()
    ):
        await asyncio.sleep(0.05)
    return float(worker.now_s())


async def drive_load(
    worker: Any,
    scenario: Scenario,
    seed: int,
    duration_s: float,
    record: RunRecord,
    stop: asyncio.Event,
) -> None:
    """Submit the scenario's requests at their simulated arrival times; record completions.

    The load starts once the starting plans serve (as one would switch traffic on), so the
    rejections counted are the control loop's, not the start-up's.
    """
    from runtime.loadgen import generate, rates_from_workload

    record.load_start_s = await wait_serving(worker, START_DEADLINE_S)
    arrivals = sorted(
        (
            (r, d.name)
            for d in scenario.deployments
            for r in generate(
                rates_from_workload(d.workload), seed=seed, duration_s=duration_s, prefix=d.name
            )
            if r.arrival_s >= record.load_start_s
        ),
        key=lambda x: (x[0].arrival_s, x[1]),
    )
    pending: set[asyncio.Task[None]] = set()
    for request, dep in arrivals:
        delay = (request.arrival_s - worker.now_s()) / worker.clock.speed
        if delay > 0:
            try:
                await asyncio.wait_for(stop.wait(), delay)
                break
            except TimeoutError:
                pass
        admission, fut = await worker.submit(dep, request)
        record.admissions[(dep, str(admission.reason))] += 1
        if fut is None:
            record.rejections.append((worker.now_s(), dep, str(admission.reason)))
            continue
        task = asyncio.create_task(_complete(dep, fut, record))
        pending.add(task)
        task.add_done_callback(pending.discard)
    for task in list(pending):
        task.cancel()


async def _complete(dep: str, fut: asyncio.Future[Any], record: RunRecord) -> None:
    done = await fut
    tbt_s = (done.finish_s - done.first_token_s) / max(1, done.output_tokens - 1)
    record.served.append(Served(dep, done.finish_s, done.ttft_s, tbt_s, done.output_tokens))


def _failure(me: asyncio.Task[Any] | None, exc: asyncio.CancelledError) -> BaseException:
    """What a CancelledError that is no SIGTERM means: Ctrl-C (re-raised), or a failure.

    NOTE: aiokafka clients can raise CancelledError while stopping against a broker that went
    away; the failure that ended the run is then its context.
    """
    if me is not None and me.cancelling():  # a real cancellation: asyncio.run's Ctrl-C
        return exc
    cause = exc.__context__
    return cause if isinstance(cause, FlexPipeError) else FlexPipeError(f"stopped: {exc!r}")


async def run_up(cfg: FlexPipeConfig, args: argparse.Namespace) -> int:
    """`flexpipe up`: see the module docstring."""
    wall0 = time.monotonic()
    path = scenario_path(args.scenario or DEFAULT_SCENARIO)
    scenario = load_scenario(path)
    duration_s = args.duration or scenario.duration_s
    speed = args.speed or duration_s / DEFAULT_WALL_S
    out_dir = Path(args.out).resolve()
    log_path = out_dir / "streams.log"
    out_dir.mkdir(parents=True, exist_ok=True)
    log_path.write_bytes(b"")  # this run's log only
    # NOTE: SIGTERM cancels the run, so the stream worker (its own session) and a broker this
    # job started are stopped on the way out instead of being left behind.
    terminated: list[bool] = []
    me = asyncio.current_task()

    def terminate() -> None:
        terminated.append(True)
        if me is not None:
            me.cancel()

    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, terminate)
    try:
        record = await _run_with_broker(cfg, scenario, path, args.seed, duration_s, speed, out_dir)
    except KafkaError as exc:
        raise FlexPipeError(f"Kafka: {exc}") from exc
    except asyncio.CancelledError as exc:
        if not terminated:
            raise _failure(me, exc) from None
        print("up: stopped (SIGTERM); the stream worker and the broker were stopped", flush=True)
        return 128 + signal.SIGTERM
    deployments = [d.name for d in scenario.deployments]
    print("\n".join(summary_lines(record, deployments, duration_s)))
    title = f"{scenario.name}, seed {args.seed}"
    md, png = write_report(record, deployments, duration_s, out_dir, title)
    print(f"\nreport: {md}  timeline: {png}  ({time.monotonic() - wall0:.0f} s wall)")
    return 0


async def _run_with_broker(
    cfg: FlexPipeConfig,
    scenario: Scenario,
    path: Path,
    seed: int,
    duration_s: float,
    speed: float,
    out_dir: Path,
) -> RunRecord:
    """Broker, topics and stream worker around :func:`run_loop`; all stopped afterwards."""
    log_path = out_dir / "streams.log"
    async with broker(cfg) as address:
        cfg = run_config(cfg, address, path.resolve(), speed)
        await create_topics(cfg)
        streams = await launch_streams(cfg, out_dir)
        try:
            print(
                f"up: {scenario.name} (simulated cluster, SimEngine), {duration_s / 60:.0f}"
                f" simulated min at {speed:.0f}× (seed {seed}); stream worker pid"
                f" {streams.pid}, log {log_path}",
                flush=True,
            )
            return await run_loop(cfg, scenario, seed, duration_s, speed, streams, log_path)
        finally:
            stop_process(streams)
            # NOTE: the worker's tables live in memory; faust leaves an empty data dir behind.
            shutil.rmtree(out_dir / f"{app_id(cfg)}-data", ignore_errors=True)


async def run_loop(
    cfg: FlexPipeConfig,
    scenario: Scenario,
    seed: int,
    duration_s: float,
    speed: float,
    streams: subprocess.Popen[bytes],
    log_path: Path,
) -> RunRecord:
    """Agents, runtime worker and load on one simulated clock, for ``duration_s``."""
    from runtime.offsets import SimClock
    from runtime.worker import RuntimeWorker
    from streams.catalog import scenario_catalog

    plans = starting_plans(cfg, scenario, seed)
    fleet = make_fleet(cfg, scenario, seed)
    for name in plans:  # nothing runs until the runtime loaded it (transition 0)
        fleet.cluster.place(name, [])
    t0 = time.monotonic()
    clock = SimClock(speed, t0)
    worker = RuntimeWorker(
        cfg,
        deployments=[d.name for d in scenario.deployments],
        models=scenario_catalog(scenario).models,
        clock=clock,
        event_epoch_ms=scenario.epoch_ms,
        start_plans=plans,
    )
    timeline = Timeline(cfg, scenario.epoch_ms, fleet, clock.now_s)
    stop = asyncio.Event()
    async with worker:
        helpers = [
            asyncio.create_task(timeline.follow(stop)),
            asyncio.create_task(
                drive_load(worker, scenario, seed, duration_s, timeline.record, stop)
            ),
            asyncio.create_task(status_loop(timeline, worker, STATUS_EVERY_S, stop)),
        ]
        agents = asyncio.create_task(
            publish(cfg, fleet.events(0.0, duration_s), speed, scenario.epoch_ms, t0=t0)
        )
        watchdogs = [
            asyncio.create_task(watch_process(streams, log_path)),
            asyncio.create_task(watch_broker(cfg)),
        ]
        try:
            await supervise(agents, [*watchdogs, *helpers])
        finally:
            stop.set()
            for task in (agents, *watchdogs):
                task.cancel()
            # NOTE: even on a failure the helpers end before the worker and the broker stop, so
            # no consumer is left polling a broker that went away.
            results = await asyncio.gather(*helpers, return_exceptions=True)
        for result in results:
            if isinstance(result, Exception):
                raise result
    return timeline.record

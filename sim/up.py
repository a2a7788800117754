"""`flexpipe up` (what `make run` runs): the whole loop on a simulated cluster, time-compressed.

A local Kafka (unless one is configured), the simulated node agents of a scenario, a faust stream
worker (its own process, as in production: :mod:`sim.streamproc`), a runtime worker with
SimEngine (in this process; ``--engine torch``: the torch reference engine, :mod:`sim.torchup`),
and a load generator (short chat plus long-prompt summarisation) all run on one simulated clock.
The job prints a live gear timeline (:mod:`sim.live`), then a summary, checks its own outcome
(:mod:`sim.outcome`, :mod:`sim.invariants`) and writes ``out/summary.json``, ``out/report.md``
and ``out/timeline.png``; it exits 1 naming the invariant that broke. Topics get a per-run
prefix so a run never reads another run's data.

The run's config — the scenario's deployments and catalog (:mod:`sim.catalog`) over the given
config — is written to ``out/flexpipe.yaml``; the stream worker reads it, as a deployed worker
reads its ConfigMap.

Start-up contract: the stream assumes each deployment's *hint* plan (:mod:`gearbox.starting`) is
its current plan until a transition confirms one; the runtime worker makes that true by loading
the same plan as transition 0 (a normal, persisted three-phase transition) before the load
starts. The simulated cluster starts empty and follows the runtime's placements, so its GPUs
report what the runtime loaded.

End of a run: the agents' timeline is over, the load stops (its sequences are accounted for at
that instant), the runtime gets ``DRAIN_S`` wall seconds to finish the transitions in flight,
and the run's topics are read back for the checks. ``--chaos`` (:mod:`sim.chaos`) runs on a
broker of its own, kills the stream worker once and stops the broker during a shift.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import shutil
import signal
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError

from flexpipe.config import FlexPipeConfig
from flexpipe.errors import FlexPipeError
from flexpipe.kafka import client_kwargs, create_topics, delete_topics_with_prefix
from flexpipe.kafka_local import LocalKafka
from gearbox.plans import DeploymentPlan
from sim.catalog import with_scenario, write_config
from sim.chaos import Chaos, chaos_plan
from sim.fleet import SimFleet
from sim.live import Timeline, status_loop
from sim.ondemand import OnDemandLedger, follow_memory, footprints_of, on_demand_figures
from sim.outcome import RunOutcome, SequenceLedger, conclude, gather
from sim.record import RunRecord, Served
from sim.run import broker, dedicated_broker, publish_buffered
from sim.scenario import load_scenario, scenario_path
from sim.spec import Scenario
from sim.streamproc import StreamWorker, cancel_quietly, free_port
from streams.app import app_id

if TYPE_CHECKING:  # NOTE: sim.torchup imports torch (seconds); only --engine torch loads it
    from sim.torchup import TorchServing

DEFAULT_SCENARIO = "demo-shift"
RUN_CONFIG = "flexpipe.yaml"  # the run's config file in the out directory, read by the workers
# NOTE: measured on a busy 2-core machine: broker and stream-worker start take 10–15 s (one more
# worker start when it joined on stale metadata, ~10 s), the drain, read-back and report ~10 s,
# so 120 s of simulation keeps `make run` under three minutes.
DEFAULT_WALL_S = 120.0
LAUNCH_DRAIN_S = 5.0  # simulated agents drain launch maps every 5 s in the demo (200 ms live)
STATUS_EVERY_S = 120.0  # simulated seconds between live status blocks
START_DEADLINE_S = 60.0  # simulated seconds the starting plans may take before the load starts
BROKER_PING_S = 2.0  # wall seconds between broker pings while the run lasts
BROKER_MISSES = 3  # pings missed in a row before the broker counts as gone
DRAIN_S = 30.0  # wall seconds the runtime may take to finish its transitions at the end
QUIET_EXTRA_S = 2.0  # on demand: wall seconds of quiet past a serving report before the checks
# NOTE: Kafka's own recovery after a broker restart (metadata, leaders, the consumer group's
# rejoin) takes wall seconds at any clock speed; at 20× the 40 simulated seconds allowed for an
# answer are 2 wall seconds, so a chaos run keeps the simulated clock at 5× (8 wall seconds).
CHAOS_SPEED = 5.0
CHAOS_SESSION_S = 6.0  # consumer-group session under chaos: a killed worker is evicted quickly


def run_config(
    cfg: FlexPipeConfig, address: str, scenario: Scenario, speed: float, *, chaos: bool = False
) -> FlexPipeConfig:
    """This run's config: the scenario's deployments and catalog (:mod:`sim.catalog`), its
    broker, a fresh topic prefix, the simulated clock's speed, a port for the stream worker's
    metrics (its failed ticks are read there)."""
    run_id = f"up{int(time.time())}"
    streams: dict[str, Any] = {"metrics_port": free_port()}
    if chaos:
        # NOTE: the killed worker's partitions move to its successor once its session expires.
        streams["session_timeout_s"] = min(cfg.streams.session_timeout_s, CHAOS_SESSION_S)
    update: dict[str, Any] = {
        "kafka": cfg.kafka.model_copy(update={"bootstrap_servers": address}),
        "topics": cfg.topics.model_copy(update={"prefix": f"{cfg.topics.prefix}{run_id}."}),
        "runtime": cfg.runtime.model_copy(update={"sim_speed": speed, "http_port": 0}),
        "streams": cfg.streams.model_copy(update=streams),
    }
    return with_scenario(cfg, scenario).model_copy(update=update)


async def watch_broker(cfg: FlexPipeConfig, planned: asyncio.Event | None = None) -> None:
    """Raise once the broker missed ``BROKER_MISSES`` pings in a row (it went away); while
    ``planned`` is set (chaos stopped it on purpose) misses do not count."""
    admin = AIOKafkaAdminClient(**client_kwargs(cfg))
    await admin.start()
    missed = 0
    quiet = logging.getLogger("aiokafka")
    try:
        while missed < BROKER_MISSES:
            await asyncio.sleep(BROKER_PING_S)
            if planned is not None and planned.is_set():
                missed = 0
                continue
            try:
                await asyncio.wait_for(admin.list_topics(), 2 * BROKER_PING_S)
                missed = 0
            except (KafkaError, OSError, TimeoutError):
                missed += 1
                # NOTE: every client now retries and logs each failed connect; this job says
                # once, below, what happened.
                quiet.setLevel(logging.CRITICAL)
        raise FlexPipeError(f"the Kafka broker at {cfg.kafka.bootstrap_servers} stopped answering")
    finally:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(admin.close(), BROKER_PING_S)


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
    """Each deployment's starting plan, computed as the stream computes it.

    NOTE: the stream's own view of the agents' first round of telemetry — folded through
    :class:`streams.replay.Replayer`, its topology and blocks — and the one starting rule
    (:func:`gearbox.starting.starting_plans`), so the runtime's transition 0 loads exactly the
    plan id the stream assumes is serving.
    """
    from gearbox.blocks import build_blocks
    from gearbox.starting import starting_plans as plans_on
    from streams.deployments import resolve_deployments
    from streams.replay import Replayer
    from streams.snapshot import build_topology
    from streams.step import view_timeout_s

    catalog, deployments = resolve_deployments(cfg)
    replayer = Replayer(cfg, catalog, deployments)
    for env in make_fleet(cfg, scenario, seed).events(0.0, cfg.intervals.sample_s):
        replayer.fold(env)
    now_s = replayer.clock_ms / 1000.0
    topology = build_topology(
        replayer.published, replayer.nodes, catalog, now_s, view_timeout_s(cfg)
    )
    blocks = build_blocks(topology, cfg.gearbox)
    plans = plans_on(deployments, topology, blocks)
    return {name: plan for name, plan in plans.items() if plan is not None}


async def wait_serving(worker: Any, deadline_s: float) -> float:
    """Wait until every deployment serves a plan (or ``deadline_s`` passed); the clock then.
    On-demand deployments start cold: they are not waited for."""
    while worker.now_s() < deadline_s and any(
        rt.state.serving is None and rt.core.hold_s is None for rt in worker.runtimes.values()
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
    ledger: SequenceLedger,
    torch: TorchServing | None = None,
    on_demand: OnDemandLedger | None = None,
) -> None:
    """Submit the scenario's requests at their simulated arrival times; record completions.

    The load starts once the starting plans serve (as one would switch traffic on), so the
    rejections counted are the control loop's, not the start-up's. Every admitted sequence goes
    into ``ledger``, which takes its figures when the load stops; ``on_demand`` follows the
    on-demand deployments' requests (a request held for a load may still be refused).
    """
    from sim.loadgen import generate, output_tokens, rates_from_workload

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
    for request, dep in arrivals:
        if torch is not None:
            request = torch.shape(request)
        delay = worker.clock.wall_s(request.arrival_s - worker.now_s())
        if delay > 0:
            try:
                await asyncio.wait_for(stop.wait(), delay)
                break
            except TimeoutError:
                pass
        admission, fut = await worker.submit(dep, request)
        record.admissions[(dep, str(admission.reason))] += 1
        tracked = on_demand if on_demand is not None and dep in on_demand.slo_ms else None
        if tracked is not None:
            # the answer's simulated length (the ledger's truth), not the cap the client stated
            tracked.offer(dep, output_tokens(request))
        if fut is None:
            record.rejections.append((worker.now_s(), dep, str(admission.reason)))
            if tracked is not None:
                tracked.refuse(dep, request.arrival_s, worker.now_s(), str(admission.reason))
            continue
        ledger.admit(dep, request.request_id, fut)
        task = asyncio.create_task(
            _complete(
                dep, request, fut, record, torch, (tracked, worker.now_s) if tracked else None
            )
        )
        ledger.waiters.add(task)
        task.add_done_callback(ledger.waiters.discard)
    record.load_end_s = worker.now_s()
    ledger.load_ended(worker)


async def _complete(
    dep: str,
    request: Any,
    fut: asyncio.Future[Any],
    record: RunRecord,
    torch: TorchServing | None = None,
    on_demand: tuple[OnDemandLedger, Callable[[], float]] | None = None,
) -> None:
    from runtime.types import RequestRefused

    try:
        done = await fut
    except RequestRefused as refused:  # held for its model's load, then refused
        now_s = on_demand[1]() if on_demand is not None else request.arrival_s
        record.admissions[(dep, str(refused.reason))] += 1
        record.rejections.append((now_s, dep, str(refused.reason)))
        if on_demand is not None:
            on_demand[0].refuse(dep, request.arrival_s, now_s, str(refused.reason))
        return
    if torch is not None:
        torch.completed(dep, done)
    tbt_s = (done.finish_s - done.first_token_s) / max(1, done.output_tokens - 1)
    record.served.append(
        Served(dep, done.finish_s, done.ttft_s, tbt_s, done.output_tokens, request.request_id)
    )
    if on_demand is not None:
        on_demand[0].finished(
            dep, request.arrival_s, done.finish_s, done.ttft_s, tbt_s, done.output_tokens
        )


async def drain(worker: Any, timeout_s: float, quiet_s: float = 0.0) -> None:
    """Wait (at most ``timeout_s`` wall seconds) until no runtime has a transition in flight
    or waiting, nor a request held for a model's load, for ``quiet_s`` wall seconds in a row;
    the checks then name any left unfinished.

    NOTE: ``quiet_s`` for on-demand models: a request held at the load's end is a load the
    stream decides next, from a serving report up to ``runtime.serving_publish_s`` (runtime
    seconds) old.
    """
    deadline = time.monotonic() + timeout_s
    quiet_since: float | None = None
    while time.monotonic() < deadline:
        busy = any(
            rt.state.active is not None or rt.state.pending is not None or rt.core.held()
            for rt in worker.runtimes.values()
        )
        now = time.monotonic()
        quiet_since = None if busy else (quiet_since if quiet_since is not None else now)
        if quiet_since is not None and now - quiet_since >= quiet_s:
            return
        await asyncio.sleep(0.1)


def _failure(me: asyncio.Task[Any] | None, exc: asyncio.CancelledError) -> BaseException:
    """What a CancelledError that is no SIGTERM means: Ctrl-C (re-raised), or a failure.

    NOTE: aiokafka clients can raise CancelledError while stopping against a broker that went
    away; the failure that ended the run is then its context.
    """
    if me is not None and me.cancelling():  # a real cancellation: asyncio.run's Ctrl-C
        return exc
    cause = exc.__context__
    return cause if isinstance(cause, FlexPipeError) else FlexPipeError(f"stopped: {exc!r}")


def torch_engine_config(cfg: FlexPipeConfig) -> FlexPipeConfig:
    """The run's config when the torch engine serves: no TTFT deadline unless one is set.

    NOTE: the stand-in model runs on this host's CPU at the run's speed, not on the simulated
    deployments' GPUs: its first tokens say nothing about their TTFT SLOs, so no request is
    refused for missing one (beside a benchmark, 2,549 of a 7B's 3,875 requests were, and the
    70B's shift carried none across). An explicit ``runtime.ttft_deadline_s`` still applies.
    """
    if cfg.runtime.ttft_deadline_s is not None:
        return cfg
    runtime = cfg.runtime.model_copy(update={"ttft_deadline_s": 0.0})
    return cfg.model_copy(update={"runtime": runtime})


async def run_up(cfg: FlexPipeConfig, args: argparse.Namespace) -> int:
    """`flexpipe up`: see the module docstring."""
    wall0 = time.monotonic()
    path = scenario_path(args.scenario or DEFAULT_SCENARIO)
    scenario = load_scenario(path)
    duration_s = args.duration or scenario.duration_s
    chaos = bool(getattr(args, "chaos", False))
    torch: TorchServing | None = None
    if getattr(args, "engine", "sim") == "torch":
        from sim.torchup import TorchServing

        torch = TorchServing()
        cfg = torch_engine_config(cfg)
    speed = args.speed or (CHAOS_SPEED if chaos else duration_s / DEFAULT_WALL_S)
    out_dir = Path(args.out).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "streams.log").write_bytes(b"")  # this run's log only
    (out_dir / "summary.json").unlink(missing_ok=True)  # NOTE: never a previous run's verdict
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
        outcome = await _run_with_broker(
            cfg,
            scenario,
            args.seed,
            duration_s,
            speed,
            out_dir,
            chaos,
            torch,
            keep_topics=bool(getattr(args, "keep_topics", False)),
        )
    except KafkaError as exc:
        raise FlexPipeError(f"Kafka: {exc}") from exc
    except asyncio.CancelledError as exc:
        if not terminated:
            raise _failure(me, exc) from None
        print("up: stopped (SIGTERM); the stream worker and the broker were stopped", flush=True)
        return 128 + signal.SIGTERM
    outcome.meta = {
        "scenario": scenario.name,
        "seed": args.seed,
        "duration_s": duration_s,
        "speed": round(speed, 2),
        "chaos": chaos,
    }
    title = f"{scenario.name}, seed {args.seed}" + (", chaos" if chaos else "")
    code = conclude(outcome, scenario, duration_s, out_dir, title)
    if torch is not None:
        code = max(code, torch.report())
    print(f"({time.monotonic() - wall0:.0f} s wall)")
    return code


@contextlib.asynccontextmanager
async def _kafka(cfg: FlexPipeConfig, chaos: bool) -> AsyncIterator[tuple[str, LocalKafka | None]]:
    """The run's broker: the usual one, or under chaos one of its own that it may stop."""
    if not chaos:
        async with broker(cfg) as address:
            yield address, None
        return
    async with dedicated_broker(cfg, f"up-chaos-{os.getpid()}") as local:
        yield local.status().bootstrap or "", local


async def _run_with_broker(
    cfg: FlexPipeConfig,
    scenario: Scenario,
    seed: int,
    duration_s: float,
    speed: float,
    out_dir: Path,
    chaos: bool,
    torch: TorchServing | None = None,
    keep_topics: bool = False,
) -> RunOutcome:
    """Broker, topics and stream worker around :func:`run_loop`; all stopped afterwards, and the
    run's topics deleted unless ``keep_topics`` (a chaos run's broker is removed whole)."""
    async with _kafka(cfg, chaos) as (address, local):
        cfg = run_config(cfg, address, scenario, speed, chaos=chaos)
        config_path = write_config(cfg, out_dir / RUN_CONFIG)
        await create_topics(cfg)
        streams = StreamWorker(cfg, out_dir, config_path)
        await streams.launch()
        try:
            print(
                f"up: {scenario.name} (simulated cluster, "
                f"{'torch engine on CPU' if torch else 'SimEngine'}), {duration_s / 60:.0f}"
                f" simulated min at {speed:.0f}× (seed {seed}); stream worker pid"
                f" {streams.pid}, log {streams.log_path}" + ("; chaos" if chaos else ""),
                flush=True,
            )
            outcome = await run_loop(cfg, scenario, seed, duration_s, speed, streams, local, torch)
        finally:
            streams.stop()
            # NOTE: the worker's tables live in memory; faust leaves an empty data dir behind.
            shutil.rmtree(out_dir / f"{app_id(cfg)}-data", ignore_errors=True)
        if not keep_topics and local is None:
            # NOTE: what the checks need was read back; left behind, every run's ~110
            # partitions pile up and each later broker start recovers them all.
            deleted = await delete_topics_with_prefix(cfg, cfg.topics.prefix)
            print(
                f"up: deleted this run's {len(deleted)} topics ({cfg.topics.prefix}*;"
                " --keep-topics keeps them)",
                flush=True,
            )
        elif local is None:
            print(f"up: kept this run's topics ({cfg.topics.prefix}*)", flush=True)
        return outcome


async def run_loop(
    cfg: FlexPipeConfig,
    scenario: Scenario,
    seed: int,
    duration_s: float,
    speed: float,
    streams: StreamWorker,
    local: LocalKafka | None,
    torch: TorchServing | None = None,
) -> RunOutcome:
    """Agents, runtime worker and load on one simulated clock, for ``duration_s``; then the
    drain and the read-back (with chaos when ``local`` is the run's own broker)."""
    from runtime.clock import SimClock
    from runtime.worker import RuntimeWorker

    plans = starting_plans(cfg, scenario, seed)
    fleet = make_fleet(cfg, scenario, seed)
    for name in plans:  # nothing runs until the runtime loaded it (transition 0)
        fleet.cluster.place(name, [])
    t0 = time.monotonic()
    clock = SimClock(speed, t0)
    worker = RuntimeWorker(
        cfg,  # serves cfg.deployments, with cfg.catalog's model shapes
        clock=clock,
        event_epoch_ms=scenario.epoch_ms,
        start_plans=plans,
        engine_factories=torch.factories([d.name for d in scenario.deployments]) if torch else None,
    )
    wall0 = time.time() - (time.monotonic() - t0)  # the wall clock at simulated time 0
    timeline = Timeline(
        cfg, scenario.epoch_ms, fleet, clock.now_s, lambda ms: (ms / 1000.0 - wall0) * speed
    )
    ledger = SequenceLedger()
    slo = {d.name: d.slo_ms(cfg.gearbox) for d in cfg.deployments if d.residency == "on_demand"}
    on_demand = OnDemandLedger(slo) if slo else None
    chaos = (
        Chaos(chaos_plan(duration_s), streams, local, worker, clock.now_s, cfg) if local else None
    )
    stop = asyncio.Event()
    async with worker:
        helpers = [
            asyncio.create_task(timeline.follow(stop)),
            asyncio.create_task(
                drive_load(
                    worker,
                    scenario,
                    seed,
                    duration_s,
                    timeline.record,
                    stop,
                    ledger,
                    torch,
                    on_demand,
                )
            ),
            asyncio.create_task(status_loop(timeline, worker, STATUS_EVERY_S, stop)),
        ]
        if on_demand is not None:
            helpers.append(
                asyncio.create_task(
                    follow_memory(worker, fleet, cfg, footprints_of(cfg), on_demand, stop)
                )
            )
        agents = asyncio.create_task(
            publish_buffered(cfg, fleet.events(0.0, duration_s), speed, scenario.epoch_ms, t0)
        )
        planned = chaos.broker_planned if chaos else None
        watchdogs = [
            asyncio.create_task(streams.watch()),
            asyncio.create_task(streams.scrape_loop()),
            asyncio.create_task(watch_broker(cfg, planned)),
        ]
        faults = asyncio.create_task(chaos.run()) if chaos else None
        try:
            await supervise(agents, [*watchdogs, *helpers, *([faults] if faults else [])])
            stop.set()
            await supervise(helpers[1], watchdogs)  # the load stops: its ledger is taken
            if faults is not None and chaos is not None:
                await chaos.settle(faults)
            report_s = worker.clock.wall_s(cfg.runtime.serving_publish_s)
            quiet_s = 0.0 if on_demand is None else report_s + QUIET_EXTRA_S
            await supervise(asyncio.create_task(drain(worker, DRAIN_S, quiet_s)), watchdogs)
            timeline.record.sequences = ledger.settle(worker)
        finally:
            await ledger.close()
            stop.set()
            for task in (agents, *watchdogs, *([faults] if faults else [])):
                await cancel_quietly(task)
            # NOTE: even on a failure the helpers end before the worker and the broker stop, so
            # no consumer is left polling a broker that went away.
            results = await asyncio.gather(*helpers, return_exceptions=True)
        for result in results:
            if isinstance(result, Exception):
                raise result
        active = tuple(d for d, rt in worker.runtimes.items() if rt.state.active is not None)
        outcome = await gather(cfg, timeline.record, scenario.epoch_ms, clock.now_s())
        if on_demand is not None:
            outcome.on_demand = on_demand_figures(on_demand, outcome.transitions, worker)
    outcome.active_at_exit = active
    outcome.failed_ticks, outcome.failed_ticks_source = await streams.failed_ticks()
    outcome.outages = list(chaos.outages) if chaos else []
    return outcome

"""Runtime worker: the thin Kafka/asyncio/HTTP shell around :class:`runtime.host.RuntimeHost`.

On start it reads the cluster-event log (latest GPU state), the transitions log and the
ownership journal, resumes or rolls back what was in flight and replays unfinished sequences; a
deployment given a starting plan that the log knows nothing of loads it as transition 0 (see
:meth:`DeploymentRuntime.adopt`). Then it consumes decisions for its deployments, ticks every
runtime, persists each transition record (waiting for the broker's ack before the machine moves
on), journals sequence ownership, publishes serving load, and serves the HTTP API. All policy
lives in the runtimes. Engines: ``runtime.engine`` (:mod:`runtime.engines`; SimEngine, or the
torch reference engine whose token ledgers are read back before the recovery).

Run it in-process (``async with RuntimeWorker(cfg) as w``) or as a process:
``python -m runtime.cli --deployment NAME`` / ``flexpipe runtime --deployment NAME``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

from aiohttp import web
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.errors import KafkaError

from flexpipe import envelope
from flexpipe.config import FlexPipeConfig, RuntimeConfig
from flexpipe.errors import FlexPipeError, ValidationError
from flexpipe.kafka import create_topics, make_consumer, make_producer, partition_for
from flexpipe.schemas import (
    ClusterEvent,
    ControlCommand,
    GearDecision,
    GearTransition,
    GpuSample,
    TransitionPhase,
)
from flexpipe.topics import Topic, topic_name
from gearbox.model import ModelSpec
from gearbox.plans import DeploymentPlan
from gearbox.presets import LINK_CLASSES
from gearbox.residency import kv_floor_tokens
from runtime.admission import default_memory_wait_s, ttft_deadline_s
from runtime.clock import SimClock
from runtime.deployment import DeploymentRuntime, EngineFactory, Outbox, RuntimeSettings
from runtime.engine.paging import KvAdmission
from runtime.engines import WorkerEngines, worker_engines
from runtime.executor import ExecutorSettings
from runtime.host import DecisionOutcome, RuntimeHost
from runtime.http import build_app
from runtime.journal import catch_up, ownership_topic, read_to_end
from runtime.metrics import RuntimeMetrics
from runtime.offsets import OffsetTracker
from runtime.ownership import encode_event
from runtime.transition import TransitionPolicy
from runtime.types import (
    Admission,
    Completion,
    Reason,
    Request,
    RequestRefused,
    ServingSettings,
)
from runtime.vmm.cuda import local_gpu_ordinals
from runtime.vmm.manager import (
    BackendFactory,
    ReservationManager,
    cuda_backend_factory,
    host_backend_factory,
)

log = logging.getLogger("flexpipe.runtime")


def runtime_settings(rc: RuntimeConfig) -> RuntimeSettings:
    """The runtimes' tuning from the validated config section."""
    return RuntimeSettings(
        policy=TransitionPolicy(
            rc.prepare_timeout_s,
            rc.switch_timeout_s,
            rc.cleanup_timeout_s,
            rc.max_phase_retries,
            rc.retry_backoff_s,
        ),
        executor=ExecutorSettings(
            canary_s=rc.canary_s,
            short_sequence_tokens=rc.short_sequence_tokens,
            max_handovers_per_poll=rc.max_handovers_per_tick,
            drain_timeout_s=rc.drain_timeout_s,
            handover_wait_s=rc.handover_wait_s,
            inter_domain_link=LINK_CLASSES[rc.inter_domain_link],
        ),
        serving=ServingSettings(
            rc.watermark, rc.max_queue_per_replica, KvAdmission(rc.kv_admission)
        ),
        canary_share=rc.canary_share,
    )


class RuntimeWorker:
    """Runtime worker for the configured deployments (see the module docstring)."""

    def __init__(
        self,
        cfg: FlexPipeConfig,
        *,
        deployments: Sequence[str] | None = None,
        pause_in: TransitionPhase | None = None,
        pause_from_seq: int = 0,
        http_port: int | None = None,
        models: Mapping[str, ModelSpec] | None = None,
        clock: SimClock | None = None,
        event_epoch_ms: int | None = None,
        start_plans: Mapping[str, DeploymentPlan] | None = None,
        engine_factories: Mapping[str, EngineFactory] | None = None,
    ) -> None:
        self.cfg = cfg
        self.rc = cfg.runtime
        # Served: the names given, else runtime.deployments, else every configured deployment.
        self.deployments = tuple(
            deployments or self.rc.deployments or (d.name for d in cfg.deployments)
        )
        if not self.deployments:
            raise FlexPipeError(
                "runtime: no deployments (set deployments, runtime.deployments or --deployment)"
            )
        # Model shapes by the name plans carry: gearbox's presets and the config's catalog.
        models = cfg.catalog.model_specs() if models is None else models
        self.clock = clock or SimClock(self.rc.sim_speed)
        # With an epoch, event times follow the runtime clock (a simulated cluster's time line);
        # without, they are wall-clock times as on a real cluster.
        self._event_epoch_ms = event_epoch_ms
        # Each deployment's configured starting plan (the stream's hint), adopted on a fresh log.
        self._start_plans = dict(start_plans or {})
        # runtime.engine; factories passed in (a benchmark's) take precedence
        self._engines = (
            WorkerEngines() if engine_factories else worker_engines(self.rc, self.deployments)
        )
        self.host = RuntimeHost(
            self.deployments,
            runtime_settings(self.rc),
            vmm=ReservationManager(_backend_factory(self.rc)),
            models=models,
            pause_in=pause_in,
            pause_from_seq=pause_from_seq,
            engine_factories=engine_factories or self._engines.factories,  # default SimEngine
            hold_s={
                d.name: self.rc.model_load_wait_s
                for d in cfg.deployments
                if d.residency == "on_demand"
            },
            memory_wait_s={
                d.name: (
                    self.rc.memory_wait_s
                    if self.rc.memory_wait_s is not None
                    else default_memory_wait_s(d.slo_ms(cfg.gearbox)[0] / 1000.0)
                )
                for d in cfg.deployments
            },
            ttft_deadline_s={
                d.name: ttft_deadline_s(self.rc.ttft_deadline_s, d.slo_ms(cfg.gearbox)[0] / 1000.0)
                for d in cfg.deployments
            },
            kv_floor_tokens={
                d.name: kv_floor_tokens(d.prompt_tokens + d.output_tokens, cfg.placement)
                for d in cfg.deployments
                if d.residency == "on_demand"
            },
        )
        self.pool = self.host.pool
        self.inventory = self.host.inventory
        self.vmm = self.host.vmm
        self.runtimes = self.host.runtimes
        self.metrics = RuntimeMetrics()
        self.source = f"{self.rc.worker_id}/runtime"
        self.http_port = self.rc.http_port if http_port is None else http_port
        self._offsets = OffsetTracker()
        self._waiters: dict[tuple[str, str], asyncio.Future[Completion]] = {}
        self._unacked: dict[str, list[GearTransition]] = {d: [] for d in self.deployments}
        self._plan_ids: dict[str, str | None] = dict.fromkeys(self.deployments)
        # Created in start(): aiokafka clients bind to the running event loop.
        self._producer_: AIOKafkaProducer | None = None
        self._control_: AIOKafkaProducer | None = None
        self._consumers: list[AIOKafkaConsumer] = []
        self._decisions: AIOKafkaConsumer | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._runner: web.AppRunner | None = None
        self._last_seq = 0
        # deployments whose first request waits for a load: their serving report goes out now
        self._demand: set[str] = set()
        self._demand_event = asyncio.Event()

    async def __aenter__(self) -> RuntimeWorker:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    @property
    def _producer(self) -> AIOKafkaProducer:
        assert self._producer_ is not None, "worker not started"
        return self._producer_

    @property
    def _control(self) -> AIOKafkaProducer:
        assert self._control_ is not None, "worker not started"
        return self._control_

    @property
    def http_url(self) -> str:
        """Base URL of the HTTP API."""
        return f"http://{self.rc.http_host}:{self.http_port}"

    def _event_time_ms(self) -> int:
        if self._event_epoch_ms is None:
            return int(time.time() * 1000)
        return self._event_epoch_ms + round(self.clock.now_s() * 1000)

    def _seq(self) -> int:
        """Per-source envelope sequence: microseconds, bumped to stay increasing across restarts."""
        self._last_seq = max(self._last_seq + 1, time.time_ns() // 1000)
        return self._last_seq

    # ---- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        """Create topics, recover, start consuming, ticking, publishing and serving HTTP."""
        try:
            await self._start()
        except BaseException:
            await self.stop()
            raise

    async def _start(self) -> None:
        await create_topics(self.cfg)
        self._producer_ = make_producer(self.cfg)
        self._control_ = make_producer(self.cfg)  # control never shares a connection with data
        await self._producer.start()
        await self._control.start()
        cluster = await self._catch_up_cluster()
        await self._recover()
        # NOTE: static membership — a restarted worker (same id) takes its place in the group
        # at once instead of waiting out the dead process's session; the group name carries
        # the topic prefix so deployments sharing a broker never share offsets.
        group = f"{self.cfg.topics.prefix}flexpipe-runtime-{self.rc.worker_id}"
        decisions = make_consumer(
            self.cfg,
            topic_name(self.cfg, Topic.DECISIONS),
            group_id=group,
            group_instance_id=group,
        )
        gpus = make_consumer(
            self.cfg, topic_name(self.cfg, Topic.GPU), group_id=None, auto_offset_reset="latest"
        )
        for consumer in (decisions, gpus):
            await consumer.start()
        self._consumers += [decisions, gpus]
        self._decisions = decisions
        await self._start_http()
        for coro in (
            self._tick_loop(),
            self._decision_loop(decisions),
            self._cluster_loop(cluster),
            self._gpu_loop(gpus),
            self._serving_loop(),
        ):
            self._tasks.append(asyncio.create_task(coro))
        log.info(
            "runtime worker %s serving %s on %s", self.rc.worker_id, self.deployments, self.http_url
        )

    async def stop(self) -> None:
        """Stop tasks, HTTP, consumers and producers (pending completions are cancelled)."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks.clear()
        for fut in self._waiters.values():
            fut.cancel()
        if self._runner is not None:
            await self._runner.cleanup()
        for consumer in self._consumers:
            await consumer.stop()
        self._consumers.clear()
        for producer in (self._producer_, self._control_):
            if producer is not None:
                await producer.stop()
        self._producer_ = self._control_ = None
        self._engines.close(
            rt.core.engine(rid) for rt in self.runtimes.values() for rid in rt.core.replica_ids()
        )

    async def _start_http(self) -> None:
        app = build_app(self, self.rc.control_token, request_timeout_s=self.rc.request_timeout_s)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.rc.http_host, self.http_port)
        await site.start()
        if self.http_port == 0:  # bound by the OS: read the port back
            sockets: Any = getattr(site._server, "sockets", None) or []
            self.http_port = sockets[0].getsockname()[1] if sockets else self.http_port

    # ---- recovery ------------------------------------------------------------------------------

    async def _catch_up_cluster(self) -> AIOKafkaConsumer:
        """Replay the cluster-event log into the inventory (no side effects), then go live."""
        topic = topic_name(self.cfg, Topic.CLUSTER)
        consumer = make_consumer(self.cfg, topic, group_id=None)
        await consumer.start()
        self._consumers.append(consumer)
        events = [e for _, v in await catch_up(consumer, topic) if (e := _payload(v, ClusterEvent))]
        self.host.catch_up(events)
        return consumer

    async def _recover(self) -> None:
        raw = await read_to_end(self.cfg, topic_name(self.cfg, Topic.TRANSITIONS))
        records = [r for _, v in raw if (r := _payload(v, GearTransition)) is not None]
        journal = await read_to_end(self.cfg, ownership_topic(self.cfg))
        now = self.clock.now_s()
        replayed = self.host.recover(records, journal, now)
        for deployment, rt in self.runtimes.items():
            start = self._start_plans.get(deployment)
            if start is not None and rt.adopt(start, now):
                log.info("%s: loading starting plan %s (transition 0)", deployment, start.plan_id)
            log.info(
                "recovered %s: plan %s, %d sequences replayed",
                deployment,
                rt.state.serving_plan_id,
                replayed[deployment],
            )
        await self._flush()

    # ---- loops ---------------------------------------------------------------------------------

    async def _tick_loop(self) -> None:
        while True:
            now = self.clock.now_s()
            try:
                for rt in self.runtimes.values():
                    rt.tick(now)
                await self._flush()
            except Exception:  # NOTE: a bug in one tick must not stop serving; it is logged
                log.exception("runtime tick failed")
            await asyncio.sleep(self.rc.tick_s)

    async def _flush(self) -> None:
        """Deliver every runtime's outbox; persist transition records one by one, in order."""
        sends: list[asyncio.Future[Any]] = []
        for deployment, rt in self.runtimes.items():
            while True:
                sends += await self._deliver(deployment, rt.drain())
                pending = self._unacked[deployment]
                if not pending:
                    break
                try:
                    await self._persist(pending[0])
                except KafkaError as exc:  # the broker is away: retry on the next tick
                    log.warning("transition record not persisted yet: %s", exc)
                    break
                rt.on_persisted(pending.pop(0), self.clock.now_s())
            self._update_gauges(deployment, rt)
        for result in await asyncio.gather(*sends, return_exceptions=True):
            if isinstance(result, BaseException):
                log.warning("ownership journal write failed: %s", result)
        await self._commit_offsets()

    async def _deliver(self, deployment: str, out: Outbox) -> list[asyncio.Future[Any]]:
        """Queue records for persisting, journal ownership, resolve completions and offsets."""
        self._unacked[deployment].extend(out.records)
        sends = []
        topic = ownership_topic(self.cfg)
        now_ms = int(time.time() * 1000)
        for event in out.ownership:
            key, value = encode_event(
                deployment, event, source=self.source, seq=self._seq(), now_ms=now_ms
            )
            # NOTE: same key, same partition, one idempotent producer: a tombstone can never
            # overtake its admission record.
            try:
                sends.append(await self._producer.send(topic, value, key=key))
            except KafkaError as exc:
                log.warning("ownership journal write not queued: %s", exc)
        for done in out.completions:
            fut = self._waiters.pop((deployment, done.request_id), None)
            if fut is not None and not fut.done():
                fut.set_result(done)
        for request_id, reason in out.refused:
            self.metrics.requests.labels(deployment, reason).inc()
            fut = self._waiters.pop((deployment, request_id), None)
            if fut is not None and not fut.done():
                fut.set_exception(RequestRefused(request_id, reason))
        for resolved in out.resolved:
            self.metrics.decisions.labels(deployment, resolved.outcome).inc()
            self._offsets.done(resolved.ref)
        return sends

    async def _persist(self, record: GearTransition) -> None:
        env = envelope.make(
            record, event_time_ms=self._event_time_ms(), source=self.source, seq=self._seq()
        )
        key = f"{record.deployment}/{record.transition_seq}".encode()
        topic = topic_name(self.cfg, Topic.TRANSITIONS)
        # NOTE: keyed per transition so compaction keeps each one's last record, but written to
        # the deployment's own partition (as its serving reports): the stream worker that owns
        # the deployment is the one that folds it. Hashing this key spread them over workers.
        partitions = await self._producer.partitions_for(topic)
        partition = partition_for(record.deployment, len(partitions))
        await self._producer.send_and_wait(
            topic, envelope.encode(env), key=key, partition=partition
        )
        self.metrics.on_record(record)
        log.info(
            "transition %s #%d %s %s (attempt %d) %s",
            record.deployment,
            record.transition_seq,
            record.phase,
            record.status,
            record.attempt,
            record.detail,
        )

    def _update_gauges(self, deployment: str, rt: DeploymentRuntime) -> None:
        plan_id = rt.state.serving_plan_id
        self.metrics.set_serving_plan(deployment, plan_id, self._plan_ids[deployment])
        self._plan_ids[deployment] = plan_id
        active = rt.state.active
        self.metrics.set_phase(deployment, str(active.phase) if active else None)
        ex = rt.executor.status()
        self.metrics.migration_queue.labels(deployment).set(ex["migration_queue"] + ex["staged"])
        self.metrics.owned.labels(deployment).set(len(rt.core.router.ownership()))
        self.metrics.kv_bytes.labels(deployment).set(rt.core.kv_bytes())
        self.metrics.preemptions.labels(deployment).set(rt.core.preemptions)
        self.metrics.oom.set(self.pool.oom_events)

    async def _commit_offsets(self) -> None:
        if self._decisions is None:
            return
        commits = self._offsets.commits()
        if commits:
            with contextlib.suppress(KafkaError):
                await self._decisions.commit(commits)

    async def _decision_loop(self, consumer: AIOKafkaConsumer) -> None:
        while True:
            batches = await consumer.getmany(timeout_ms=500)
            for tp, messages in batches.items():
                for msg in messages:
                    ref = self._offsets.add(tp, msg.offset)
                    decision = _payload(msg.value, GearDecision)
                    if decision is None:
                        self._offsets.done(ref)  # malformed: nothing to do
                        continue
                    try:
                        outcome = self.host.on_decision(decision, self.clock.now_s(), ref)
                    except Exception:  # NOTE: one bad decision must not stop the loop
                        log.exception("decision %s failed", decision.decision_id)
                        outcome = DecisionOutcome.NOT_OURS
                    if outcome is DecisionOutcome.HELD:
                        # A hold (hysteresis, cooldown, no better plan): audit trail only.
                        self.metrics.decisions.labels(decision.deployment, "held").inc()
                    if outcome is not DecisionOutcome.FED:
                        self._offsets.done(ref)

    async def _cluster_loop(self, consumer: AIOKafkaConsumer) -> None:
        async for msg in consumer:
            event = _payload(msg.value, ClusterEvent)
            if event is not None:
                self.host.on_cluster_event(event)

    async def _gpu_loop(self, consumer: AIOKafkaConsumer) -> None:
        async for msg in consumer:
            sample = _payload(msg.value, GpuSample)
            if sample is not None:
                self.host.on_gpu_sample(sample)

    async def _serving_loop(self) -> None:
        topic = topic_name(self.cfg, Topic.SERVING)
        # NOTE: runtime-clock seconds, like the windows the stream folds the reports into: at
        # 15x, a period in wall seconds left the stream 75 simulated seconds behind the load
        every_s = self.clock.wall_s(self.rc.serving_publish_s)
        due = time.monotonic() + every_s
        while True:
            only: list[str] | None = None
            try:
                # NOTE: a request waiting for a model to load is reported at once, not up to
                # serving_publish_s later: the load decision waits for it. The others keep
                # their period.
                await asyncio.wait_for(self._demand_event.wait(), max(0.0, due - time.monotonic()))
                only, self._demand = sorted(self._demand), set()
                self._demand_event.clear()
            except TimeoutError:
                due = time.monotonic() + every_s
            for load in self.host.serving_reports(self.clock.now_s(), only):
                env = envelope.make(
                    load, event_time_ms=self._event_time_ms(), source=self.source, seq=self._seq()
                )
                with contextlib.suppress(KafkaError):
                    key = load.deployment.encode()
                    await self._producer.send(topic, envelope.encode(env), key=key)

    # ---- the HTTP layer's view -----------------------------------------------------------------

    async def submit(
        self, deployment: str, request: Request
    ) -> tuple[Admission, asyncio.Future[Completion] | None]:
        """Admit a request now; the future resolves when it completes."""
        rt = self.runtimes[deployment]
        admission = rt.submit(request, self.clock.now_s())
        self.metrics.requests.labels(deployment, admission.reason).inc()
        if not admission.admitted:
            return admission, None
        held = Reason.HELD_FOR_LOAD
        if admission.reason is held and len(rt.core.held(held)) == 1:
            self._demand.add(deployment)
            self._demand_event.set()
        fut: asyncio.Future[Completion] = asyncio.get_running_loop().create_future()
        self._waiters[(deployment, request.request_id)] = fut
        return admission, fut

    def now_s(self) -> float:
        """The runtime clock."""
        return self.clock.now_s()

    def status(self, *, ownership: bool = False) -> dict[str, Any]:
        """Worker and per-deployment state for ``/status``."""
        now = self.clock.now_s()
        return {
            "worker_id": self.rc.worker_id,
            "simulated": True,  # the cluster; the engine is runtime.engine's
            "engine": self.rc.engine,
            "now_s": now,
            "paused": any(rt.executor.paused for rt in self.runtimes.values()),
            "deployments": {
                d: rt.status(now, ownership=ownership) for d, rt in self.runtimes.items()
            },
        }

    async def publish_control(self, command: ControlCommand) -> None:
        """Publish an operator command on the control topic (its own producer)."""
        env = envelope.make(
            command, event_time_ms=self._event_time_ms(), source=self.source, seq=self._seq()
        )
        topic = topic_name(self.cfg, Topic.CONTROL)
        await self._control.send_and_wait(
            topic, envelope.encode(env), key=command.deployment.encode()
        )


def _backend_factory(rc: RuntimeConfig) -> BackendFactory:
    if rc.vmm_backend == "host":
        return host_backend_factory
    ordinals = local_gpu_ordinals()
    if not ordinals:
        log.warning("vmm_backend cuda: no NVIDIA GPU/driver here; host accounting for every GPU")
    return cuda_backend_factory(ordinals)


def _payload(raw: bytes | None, kind: type[Any]) -> Any | None:
    """The payload when ``raw`` is a valid envelope of ``kind``; ``None`` otherwise."""
    try:
        env = envelope.decode(raw)
    except ValidationError:
        return None
    return env.payload if isinstance(env.payload, kind) else None

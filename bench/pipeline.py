"""Stream-processing throughput and trigger-to-decision latency, one worker, the real broker.

``python -m bench.pipeline`` starts the local broker unless one is configured, starts one
stream worker (``python -m streams.worker``) and drives it with a synthetic 1,000-GPU cluster
(125 nodes of 8): NVML-style samples and kernel-launch counts (1 sample per 5 launch reports, as
1 Hz NVML + 5 Hz launch counts), event time = now, sent as agents with ``--batch-per-node`` send
them: one :class:`~flexpipe.schemas.NodeSamples` message per node carrying its 8 GPUs' samples
(or launch counts); ``--per-gpu`` sends one message per GPU sample or report instead. Events are
counted per GPU sample or report either way. The benchmark also stands in for the runtime:
every decision it reads back is answered with a transition DONE carrying the decision's plan, so
each deployment serves a plan the stream knows.

Phases, each with the load it applies printed in the result:

1. **capacity** — offers ``--offered`` telemetry events/s for ``--duration-s`` but never lets more
   than ``--max-backlog`` events (one second of the nominal load) wait unfolded (the driver pauses
   while the worker's own ``flexpipe_streams_events_total`` trails what was sent by that), so an
   overloaded worker is measured at saturation with a bounded backlog instead of hanging the run.
   ``events_per_s`` is what the worker folded per second.
2. **latency** — offers ``min(0.7 × capacity, goal)`` events/s (the p99 is measured while the
   worker keeps up; ``--latency-events-per-s`` fixes the rate instead, so that paired runs of
   two versions offer the same load however their capacity phases came out) plus
   ``--triggers-per-s`` **forced-switch triggers**: each preempts one GPU of the plan a
   deployment serves (read back from the decisions topic), which makes that plan
   infeasible; the GPU is released once the trigger was answered, and no sooner than
   ``--release-after-s`` after it (a worker that trails by more than that would otherwise fold
   the release before deciding, and rightly hold a plan whose GPUs are all back). A deployment
   gets its next trigger only once the previous one was answered, so every trigger is matched to
   the first forced decision of its deployment published after it:
   ``p99_decision_latency_ms`` is trigger event time → that decision's record timestamp, over at
   least ``--min-triggers`` triggers. Unanswered triggers are counted and count as misses. A
   trigger whose GPUs had already left the deployment's plan when it was sent (a decision
   published before it, which this stand-in had not read yet) disturbs no plan: it is counted
   as ``forced_triggers_void``, neither timed nor a miss.

Baselines measured in the same run: the article's **5 s polling loop**, run for real beside the
stream (a consumer of the cluster topic polled every 5 s; its figure is event time → the poll that
first saw the preemption, a lower bound of that loop's decision latency since it decides
nothing), and a bare aiokafka consumer that only decodes the telemetry (the client + broker ceiling
on this machine). ``calibration_ms`` times a fixed pure-Python workload (:mod:`bench.calibrate`).

``--profile-worker`` runs the worker under cProfile (:mod:`bench.worker_profile`) and prints its
CPU split by package and its top functions before the JSON; the profiler slows the worker, so a
profiled run's figures are not comparable with an unprofiled one's.

Goals: ≥ 10,000 events/s per worker, p99 ≤ 200 ms over ≥ 1,000 forced-switch triggers. The last
line printed is the JSON result; the exit status is 1 (after the JSON) when a goal was missed or
the backlog did not drain, and the miss is named on stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from bench.calibrate import calibration_ms
from bench.common import bench_broker, print_result
from bench.worker_profile import profile_lines
from flexpipe import envelope
from flexpipe.config import DeploymentConfig, FlexPipeConfig
from flexpipe.kafka import make_consumer, make_producer
from flexpipe.schemas import (
    ClusterEvent,
    ClusterEventType,
    DomainInfo,
    GpuSample,
    KernelLaunches,
    NodeSamples,
    SampleReason,
)
from flexpipe.topics import Topic, topic_name
from streams.app import ensure_topics
from streams.harness import WorkerProcess

GIB = 1024**3
GPUS_PER_NODE = 8
POLL_BASELINE_S = 5.0  # the article's Prometheus-polling scheduler
GOAL_EVENTS_PER_S = 10_000
GOAL_P99_MS = 200.0
STEADY_SHARE = 0.7  # the latency phase offers this share of the measured capacity
WARM_ROUND_S = 3.0
_GPU_ID = re.compile(rb"GPU-\d{5}")


@dataclass
class Cluster:
    """A synthetic cluster: one NVLink domain per node, RDMA between nodes."""

    num_gpus: int
    seq: dict[str, int] = field(default_factory=dict)

    @property
    def nodes(self) -> list[str]:
        """Node names."""
        return [f"node-{n}" for n in range(self.num_gpus // GPUS_PER_NODE)]

    def next_seq(self, source: str) -> int:
        """Per-source sequence number."""
        self.seq[source] = self.seq.get(source, 0) + 1
        return self.seq[source]

    def sample(self, i: int, t_ms: int) -> tuple[str, bytes, bytes]:
        """GPU ``i``'s sample as (topic, key, value) on the GPU topic."""
        node = f"node-{i // GPUS_PER_NODE}"
        uuid = f"GPU-{i:05d}"
        used = (i % 5) * 4 * GIB
        s = GpuSample(
            gpu_uuid=uuid, node=node, name="H100 80GB HBM3", reason=SampleReason.DELTA,
            memory_total_bytes=80 * GIB, memory_used_bytes=used, memory_free_bytes=80 * GIB - used,
            gpu_class="h100-sxm", domain=f"nv-{node}", index=i % GPUS_PER_NODE,
            sm_util_pct=float(10 * (i % 7)), power_w=350.0, temperature_c=55.0,
        )  # fmt: skip
        source = f"{node}/bench"
        env = envelope.make(s, event_time_ms=t_ms, source=source, seq=self.next_seq(source))
        return "gpu", uuid.encode(), envelope.encode(env)

    def launches(self, i: int, t_ms: int) -> tuple[str, bytes, bytes]:
        """GPU ``i``'s kernel-launch counts on the launches topic."""
        node = f"node-{i // GPUS_PER_NODE}"
        uuid = f"GPU-{i:05d}"
        k = KernelLaunches(uuid, node, 0.2, 400 + i % 50, (400 + i % 50) / 0.2)
        source = f"{node}/bench-ebpf"
        env = envelope.make(k, event_time_ms=t_ms, source=source, seq=self.next_seq(source))
        return "launches", uuid.encode(), envelope.encode(env)

    def node_batch(self, first: int, launches: bool, t_ms: int) -> tuple[str, bytes, bytes]:
        """One node's samples (or launch counts) for GPUs ``first`` .. ``first + 7`` as one
        NodeSamples message on the node topic."""
        node = f"node-{first // GPUS_PER_NODE}"
        gpus = range(first, first + GPUS_PER_NODE)
        if launches:
            items = [envelope.decode(self.launches(i, t_ms)[2]).payload for i in gpus]
            batch, source = NodeSamples(node, launches=tuple(items)), f"{node}/bench-ebpf"
        else:
            items = [envelope.decode(self.sample(i, t_ms)[2]).payload for i in gpus]
            batch, source = NodeSamples(node, samples=tuple(items)), f"{node}/bench"
        env = envelope.make(batch, event_time_ms=t_ms, source=source, seq=self.next_seq(source))
        return "node", node.encode(), envelope.encode(env)

    def cluster_event(self, ev: ClusterEvent, t_ms: int) -> tuple[str, bytes, bytes]:
        """A cluster event from the scheduler."""
        env = envelope.make(
            ev, event_time_ms=t_ms, source="scheduler/bench", seq=self.next_seq("scheduler")
        )
        return "cluster", ev.node.encode(), envelope.encode(env)

    def node_up(self, node: str, t_ms: int) -> tuple[str, bytes, bytes]:
        """NODE_UP with the node's NVLink domain and the RDMA network between nodes."""
        domains = (
            DomainInfo(f"nv-{node}", "nvlink", 450.0),
            DomainInfo("inter-domain", "rdma", 25.0),
        )
        return self.cluster_event(
            ClusterEvent(ClusterEventType.NODE_UP, node, domains=domains), t_ms
        )

    def gpu_event(
        self, kind: ClusterEventType, gpus: tuple[str, ...], t_ms: int
    ) -> tuple[str, bytes, bytes]:
        """PREEMPT or RELEASE of GPUs (``GPU-nnnnn``) of one node."""
        node = f"node-{int(gpus[0][4:]) // GPUS_PER_NODE}"
        return self.cluster_event(ClusterEvent(kind, node, gpus), t_ms)

    def node_gpus(self, node: int) -> tuple[str, ...]:
        """The GPUs of ``node-<node>``."""
        first = node * GPUS_PER_NODE
        return tuple(f"GPU-{i:05d}" for i in range(first, first + GPUS_PER_NODE))


def _config(cfg: FlexPipeConfig, num_deployments: int) -> FlexPipeConfig:
    deployments = tuple(
        DeploymentConfig(
            name=f"dep-{d}",
            model="llama-2-70b" if d % 2 == 0 else "llama-2-7b",
            block=f"nv-node-{d}",
            tp=8 if d % 2 == 0 else 2,
            arrival_rps=4.0,
        )
        for d in range(num_deployments)
    )
    streams = cfg.streams.model_copy(update={"loglevel": "warn"})
    topics = cfg.topics.model_copy(update={"prefix": f"bench{os.getpid()}."})
    update = {"deployments": deployments, "streams": streams, "topics": topics}
    # NOTE: model_copy does not validate; validating here names a bad key before a worker starts
    return FlexPipeConfig.model_validate(cfg.model_copy(update=update).model_dump())


def _now_ms() -> int:
    return round(time.time() * 1000)


_TOPICS = {
    "gpu": Topic.GPU,
    "launches": Topic.LAUNCHES,
    "node": Topic.NODE,
    "cluster": Topic.CLUSTER,
}


async def _send_all(
    producer: Any, cfg: FlexPipeConfig, batch: list[tuple[str, bytes, bytes]]
) -> None:
    futures = [
        await producer.send(topic_name(cfg, _TOPICS[t]), value, key=key) for t, key, value in batch
    ]
    await asyncio.gather(*futures)


@dataclass
class Runtime:
    """The benchmark's stand-in for the runtime, fed from the decisions topic: each decision's
    plan is confirmed at once (transition DONE), so it is the plan the deployment serves."""

    serving: dict[str, tuple[str, ...]] = field(default_factory=dict)  # deployment → its GPUs
    # NOTE: a deployment starts on its configured block (node-<d>); until its first decision
    # names a plan, a trigger preempts that whole block
    forced_ms: dict[str, list[int]] = field(default_factory=dict)  # forced decisions' timestamps
    # deployment → (timestamp, GPUs) of each decision that named a plan, in the order read
    planned: dict[str, list[tuple[int, frozenset[str]]]] = field(default_factory=dict)
    decisions: int = 0
    seq: int = 0

    def on_decision(self, raw: bytes, timestamp_ms: int) -> bytes | None:
        """Read one decisions-topic record; returns the transition DONE to publish, if any."""
        try:
            env = orjson.loads(raw)
            p = env["payload"]
            deployment = p["deployment"]
        except (orjson.JSONDecodeError, KeyError, TypeError):
            return None
        self.decisions += 1
        # NOTE: any forced decision answers a trigger: one deferred while the worker's input
        # trailed the clock is decided by the next tick (trigger "timer") or a later event
        if p.get("forced"):
            self.forced_ms.setdefault(deployment, []).append(timestamp_ms)
        plan = (p.get("decision") or {}).get("to_plan")
        if not plan or not p.get("to_plan_id"):
            return None
        gpus = tuple(dict.fromkeys(g.decode() for g in _GPU_ID.findall(orjson.dumps(plan))))
        self.serving[deployment] = gpus
        self.planned.setdefault(deployment, []).append((timestamp_ms, frozenset(gpus)))
        self.seq += 1
        done = {
            "deployment": deployment, "transition_seq": p["seq"],
            "decision_id": p["decision_id"], "phase": "done", "status": "completed",
            "from_plan_id": p.get("from_plan_id"), "to_plan_id": p["to_plan_id"], "attempt": 1,
            "duration_ms": None, "detail": "bench.pipeline runtime stand-in", "plan": plan,
        }  # fmt: skip
        return orjson.dumps(
            {
                "v": envelope.SCHEMA_VERSION, "kind": "gear.transition", "event_time_ms": _now_ms(),
                "source": "bench/runtime", "seq": self.seq, "payload": done,
            }
        )  # fmt: skip

    def answer_after(self, deployment: str, t_ms: int) -> int | None:
        """Timestamp of the first forced decision of ``deployment`` at or after ``t_ms``."""
        return next((ts for ts in self.forced_ms.get(deployment, ()) if ts >= t_ms), None)

    def left_before(self, deployment: str, t_ms: int, gpus: tuple[str, ...]) -> bool:
        """Whether the plan ``deployment`` was decided onto last before ``t_ms`` holds none of
        ``gpus``: a trigger that took them then disturbed no plan (the worker had decided away
        from them before this stand-in read that decision), so no forced switch answers it."""
        before = [g for ts, g in self.planned.get(deployment, ()) if ts < t_ms]
        return bool(before) and before[-1].isdisjoint(gpus)


async def follow_decisions(cfg: FlexPipeConfig, runtime: Runtime, stop: asyncio.Event) -> None:
    """Read the decisions topic as it grows and answer each decision like a runtime."""
    consumer = make_consumer(cfg, topic_name(cfg, Topic.DECISIONS), group_id=None)
    producer = make_producer(cfg, linger_ms=0)
    await consumer.start()
    await producer.start()
    transitions = topic_name(cfg, Topic.TRANSITIONS)
    try:
        while not stop.is_set():
            batch = await consumer.getmany(timeout_ms=50, max_records=1000)
            for records in batch.values():
                for rec in records:
                    done = runtime.on_decision(rec.value, rec.timestamp)
                    if done is not None:
                        await producer.send(transitions, done, key=rec.key)
    finally:
        await producer.stop()
        await consumer.stop()


async def poll_baseline(cfg: FlexPipeConfig, stop: asyncio.Event) -> list[float]:
    """The 5 s polling loop, for real: every 5 s read what the cluster topic got since the last
    poll; each preemption's latency is its event time → the poll that saw it."""
    consumer = make_consumer(cfg, topic_name(cfg, Topic.CLUSTER), group_id=None)
    await consumer.start()
    latencies: list[float] = []
    try:
        await consumer.getmany(timeout_ms=1000)  # fetched once: only what comes later counts
        next_poll = time.monotonic() + POLL_BASELINE_S
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), max(0.0, next_poll - time.monotonic()))
            if stop.is_set():
                break
            next_poll += POLL_BASELINE_S
            # NOTE: one poll reads everything the topic holds now (fetches until one comes
            # back empty), as a scrape reads the current state
            while batch := await consumer.getmany(timeout_ms=100, max_records=100_000):
                seen_ms = _now_ms()
                for records in batch.values():
                    for rec in records:
                        env = orjson.loads(rec.value)
                        if env["payload"]["type"] == ClusterEventType.PREEMPT.value:
                            latencies.append(float(seen_ms - env["event_time_ms"]))
        return latencies
    finally:
        await consumer.stop()


BACKLOG_METRICS = (
    "flexpipe_streams_events_total",
    "flexpipe_streams_ready",
    "flexpipe_streams_decisions_total",
)


class Backlog:
    """The worker's folded-events counter, scraped in the background (scraping blocks)."""

    def __init__(self, worker: WorkerProcess) -> None:
        self.worker = worker
        self.folded = 0.0
        self.ready = 0.0
        self.decided = False

    async def run(self, stop: asyncio.Event) -> None:
        """Scrape every 0.25 s until ``stop``."""
        while not stop.is_set():
            # NOTE: only what the driver reads: a whole scrape four times a second was 3-4 %
            # of the worker's CPU (py-spy), load the benchmark itself put on what it measures
            m = await asyncio.to_thread(self.worker.metrics, BACKLOG_METRICS)
            if m:
                self.folded = _events(m)
                self.ready = m.get("flexpipe_streams_ready", 0.0)
                self.decided = any(k.startswith("flexpipe_streams_decisions_total") for k in m)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.25)


def _events(m: dict[str, float]) -> float:
    return m.get('flexpipe_streams_events_total{kind="gpu.sample"}', 0.0) + m.get(
        'flexpipe_streams_events_total{kind="kernel.launches"}', 0.0
    )


@dataclass
class Triggers:
    """Forced-switch triggers: preempt one GPU of a deployment's serving plan."""

    runtime: Runtime
    deployments: tuple[str, ...]
    release_after_s: float
    # (deployment, event time, GPUs preempted) of each trigger sent
    sent: list[tuple[str, int, tuple[str, ...]]] = field(default_factory=list)
    skipped: int = 0  # a deployment's turn passed: previous trigger unanswered or no plan known
    starting: dict[str, tuple[str, ...]] = field(default_factory=dict)  # deployment → block GPUs
    # (monotonic time, deployment, trigger event time, GPUs) of each preemption not released
    preempted: list[tuple[float, str, int, tuple[str, ...]]] = field(default_factory=list)
    turn: int = 0
    # deployment → its last trigger (event time, GPUs), until a later one
    _waiting: dict[str, tuple[int, tuple[str, ...]]] = field(default_factory=dict)

    def due(self, cluster: Cluster, t_ms: int) -> list[tuple[str, bytes, bytes]]:
        """The next trigger (and the releases now due), as messages to send."""
        out = []
        now = time.monotonic()
        held = []
        for entry in self.preempted:
            at, dep, sent_ms, gpus = entry
            # NOTE: only once answered: until then the plan stays infeasible, so a forced
            # decision is the one right answer however far the worker trails
            if self.settled(dep, sent_ms, gpus) and now - at >= self.release_after_s:
                out.append(cluster.gpu_event(ClusterEventType.RELEASE, gpus, t_ms))
            else:
                held.append(entry)
        self.preempted = held
        dep = self.deployments[self.turn % len(self.deployments)]
        self.turn += 1
        pending = self._waiting.get(dep)
        if pending is not None and not self.settled(dep, *pending):
            self.skipped += 1
            return out
        taken = {g for *_, gpus in self.preempted for g in gpus}
        serving = self.runtime.serving.get(dep)
        if serving is None:  # still on its starting block: take the block
            victims = tuple(g for g in self.starting.get(dep, ()) if g not in taken)
        else:  # one GPU of the plan it serves
            free = [g for g in serving if g not in taken]
            victims = (free[self.turn % len(free)],) if free else ()
        if not victims:
            self.skipped += 1
            return out
        out.append(cluster.gpu_event(ClusterEventType.PREEMPT, victims, t_ms))
        self.preempted.append((now, dep, t_ms, victims))
        self.sent.append((dep, t_ms, victims))
        self._waiting[dep] = (t_ms, victims)
        return out

    def settled(self, dep: str, t_ms: int, gpus: tuple[str, ...]) -> bool:
        """Whether the trigger sent at ``t_ms`` taking ``gpus`` was answered, or needs no answer
        (:meth:`Runtime.left_before`: void)."""
        runtime = self.runtime
        return runtime.answer_after(dep, t_ms) is not None or runtime.left_before(dep, t_ms, gpus)

    def latencies(self) -> tuple[list[float], int, int]:
        """(latency of each answered trigger in ms, how many went unanswered, how many were
        void: unanswered, and their GPUs no longer in the deployment's plan when sent)."""
        out, missing, void = [], 0, 0
        for dep, t_ms, gpus in self.sent:
            ts = self.runtime.answer_after(dep, t_ms)
            if ts is not None:
                out.append(float(ts - t_ms))
            elif self.runtime.left_before(dep, t_ms, gpus):
                void += 1
            else:
                missing += 1
        return out, missing, void


@dataclass
class PhaseResult:
    """What one phase applied and measured."""

    offered_per_s: float
    folded_per_s: float
    sent: int
    seconds: float
    cpu_s: float
    backlog_end: int  # events sent but not folded when offering stopped
    paused_s: float  # time the driver held back because the backlog hit its bound


async def drive(
    cfg: FlexPipeConfig,
    cluster: Cluster,
    backlog: Backlog,
    offered: float,
    args: argparse.Namespace,
    triggers: Triggers | None = None,
) -> PhaseResult:
    """Offer telemetry at ``offered`` events/s (and triggers); stop after ``--duration-s``, or
    for a trigger phase once ``--min-triggers`` were sent (``--max-duration-s`` at most)."""
    producer = make_producer(cfg, linger_ms=5)
    await producer.start()
    folded0, cpu0 = backlog.folded, _cpu_s(backlog.worker)
    sent, cursor, paused = 0, 0, 0.0
    max_backlog = args.max_backlog
    start = last = time.monotonic()
    next_trigger = start
    try:
        while True:
            now = time.monotonic()
            elapsed, step_s, last = now - start, now - last, now
            if triggers is None and elapsed >= args.duration_s:
                break
            if triggers is not None and (
                len(triggers.sent) >= args.min_triggers or elapsed >= args.max_duration_s
            ):
                break
            batch: list[tuple[str, bytes, bytes]] = []
            t_ms = _now_ms()
            due = int((elapsed - paused) * offered) - sent
            if sent - (backlog.folded - folded0) > max_backlog:
                paused += step_s  # the worker trails by the bound: hold the offer back
                due = 0
            step = GPUS_PER_NODE if args.batched else 1
            for _ in range(max(0, due) // step):
                gpu = cursor % cluster.num_gpus
                # five launch reports for every sample, as 1 Hz NVML + 5 Hz launch counts
                launches = (cursor // cluster.num_gpus) % 6 != 0
                if args.batched:
                    batch.append(cluster.node_batch(gpu, launches, t_ms))
                else:
                    make = cluster.launches if launches else cluster.sample
                    batch.append(make(gpu, t_ms))
                cursor += step
            sent += len(batch) * step
            if triggers is not None and time.monotonic() >= next_trigger:
                batch += triggers.due(cluster, t_ms)
                next_trigger += 1.0 / args.triggers_per_s
            if batch:
                await _send_all(producer, cfg, batch)
            await asyncio.sleep(0.005)
    finally:
        await producer.stop()
    seconds = time.monotonic() - start
    folded = backlog.folded - folded0
    return PhaseResult(
        offered_per_s=sent / seconds,
        folded_per_s=folded / seconds,
        sent=sent,
        seconds=seconds,
        cpu_s=_cpu_s(backlog.worker) - cpu0,
        backlog_end=max(0, round(sent - folded)),
        paused_s=paused,
    )


async def drained(backlog: Backlog, target: float, timeout_s: float) -> int:
    """Wait (at most ``timeout_s``) until the worker folded ``target`` events; the backlog left."""
    deadline = time.monotonic() + timeout_s
    while backlog.folded < target and time.monotonic() < deadline:
        await asyncio.sleep(0.25)
    return max(0, round(target - backlog.folded))


async def raw_consumer_rate(cfg: FlexPipeConfig, limit: int) -> float:
    """Baseline: a bare aiokafka consumer that decodes the telemetry topics, events/s (a node
    batch counts its items)."""
    topics = [topic_name(cfg, t) for t in (Topic.GPU, Topic.LAUNCHES, Topic.NODE)]
    consumer = make_consumer(cfg, *topics, group_id=f"bench-raw-{os.getpid()}")
    await consumer.start()
    count = 0
    try:
        await consumer.getmany(timeout_ms=5000, max_records=1)  # join and fetch once
        start = time.monotonic()
        while count < limit:
            batch = await consumer.getmany(timeout_ms=1000, max_records=10_000)
            if not batch:
                break
            for records in batch.values():
                for rec in records:
                    payload = envelope.decode(rec.value).payload
                    if isinstance(payload, NodeSamples):
                        count += len(payload.samples) + len(payload.launches)
                    else:
                        count += 1
        return count / max(1e-9, time.monotonic() - start)
    finally:
        await consumer.stop()


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def warm_up(
    cfg: FlexPipeConfig,
    cluster: Cluster,
    backlog: Backlog,
    runtime: Runtime,
    timeout_s: float,
    batched: bool,
) -> None:
    """Topology plus rounds of samples until the worker is ready and decided once."""
    producer = make_producer(cfg)
    await producer.start()
    try:
        await _send_all(producer, cfg, [cluster.node_up(n, _now_ms()) for n in cluster.nodes])
        deadline = time.monotonic() + timeout_s
        next_note = time.monotonic() + 15.0
        while time.monotonic() < deadline:
            t_ms = _now_ms()
            if batched:
                round_ = [
                    cluster.node_batch(i, False, t_ms)
                    for i in range(0, cluster.num_gpus, GPUS_PER_NODE)
                ]
            else:
                round_ = [cluster.sample(i, t_ms) for i in range(cluster.num_gpus)]
            await _send_all(producer, cfg, round_)
            if backlog.ready == 1.0 and runtime.decisions > 0:
                return
            if time.monotonic() >= next_note:
                next_note += 15.0
                print(
                    f"warming up: worker ready={backlog.ready:g}, folded={backlog.folded:.0f},"
                    f" decisions read={runtime.decisions}, serving={sorted(runtime.serving)}",
                    file=sys.stderr,
                )
            # NOTE: a light round (every GPU per WARM_ROUND_S, well inside the heartbeat): the
            # worker must catch up to become ready, also beside busy loops
            await asyncio.sleep(WARM_ROUND_S)
        raise TimeoutError(
            f"worker not ready (or no decision yet) after {timeout_s:.0f} s;"
            f" log:\n{backlog.worker.log_tail()}"
        )
    finally:
        await producer.stop()


def _cpu_s(worker: WorkerProcess) -> float:
    """CPU seconds (user + system) the worker process has used."""
    if worker.proc is None:
        return 0.0
    try:
        fields = Path(f"/proc/{worker.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def run(args: argparse.Namespace, cfg: FlexPipeConfig) -> dict[str, Any]:
    """Warm up, the capacity phase, the latency phase with triggers and the polling baseline."""
    cfg = _config(cfg, args.deployments)
    await ensure_topics(cfg)
    cluster = Cluster(args.gpus)
    runtime = Runtime()
    stop = asyncio.Event()
    with tempfile.TemporaryDirectory(prefix="bench-pipeline-") as tmp:
        profile = Path(tmp) / "worker.pstats"
        extra = ("--profile", str(profile)) if args.profile_worker else ()
        worker = WorkerProcess(cfg, Path(tmp), "bench-worker").start(*extra)
        backlog = Backlog(worker)
        tasks = [
            asyncio.create_task(backlog.run(stop)),
            asyncio.create_task(follow_decisions(cfg, runtime, stop)),
        ]
        try:
            await warm_up(cfg, cluster, backlog, runtime, args.ready_timeout_s, args.batched)
            print(
                f"capacity phase: {args.duration_s:g} s at {args.offered:g} events/s offered"
                f" (worker pid {worker.proc.pid if worker.proc else None})",
                file=sys.stderr,
            )
            capacity = await drive(cfg, cluster, backlog, args.offered, args)
            print("latency phase", file=sys.stderr)
            target = backlog.folded + capacity.backlog_end
            capacity_left = await drained(backlog, target, args.drain_timeout_s)
            steady_rate = args.latency_events_per_s or min(
                STEADY_SHARE * capacity.folded_per_s, GOAL_EVENTS_PER_S
            )
            before_latency = await asyncio.to_thread(worker.metrics)
            poller = asyncio.create_task(poll_baseline(cfg, stop))
            names = tuple(d.name for d in cfg.deployments)
            triggers = Triggers(runtime, names, args.release_after_s)
            # the configured blocks (nv-node-<d>, see _config) the deployments start on
            triggers.starting = {name: cluster.node_gpus(d) for d, name in enumerate(names)}
            steady = await drive(cfg, cluster, backlog, steady_rate, args, triggers)
            target = backlog.folded + steady.backlog_end
            steady_left = await drained(backlog, target, args.drain_timeout_s)
            await _answered(triggers, args.answer_timeout_s)
            stop.set()
            poll_latencies = await poller
            metrics = await asyncio.to_thread(worker.metrics)
        finally:
            stop.set()
            await asyncio.gather(*tasks, return_exceptions=True)
            worker.stop()
            if args.profile_worker and profile.exists():
                print("\n".join(profile_lines(profile)), file=sys.stderr)
                if args.profile_out is not None:
                    shutil.copyfile(profile, args.profile_out)
    raw_rate = await raw_consumer_rate(cfg, 100_000)
    latencies, unanswered, void = triggers.latencies()
    # NOTE: an unanswered trigger is a miss: it counts as slower than any answered one
    ranked = latencies + [float("inf")] * unanswered
    return {
        "events_per_s": round(capacity.folded_per_s),
        "events_per_worker_cpu_s": round(capacity.folded_per_s * capacity.seconds / capacity.cpu_s)
        if capacity.cpu_s > 0
        else None,
        "offered_events_per_s": round(capacity.offered_per_s),
        "offered_events_per_s_asked": round(args.offered),
        "capacity_phase_s": round(capacity.seconds, 1),
        "capacity_paused_s": round(capacity.paused_s, 1),
        "backlog_after_capacity_events": capacity.backlog_end,
        "backlog_left_after_drain_events": capacity_left + steady_left,
        "p99_decision_latency_ms": _ms(_percentile(ranked, 0.99)),
        "p50_decision_latency_ms": _ms(_percentile(ranked, 0.50)),
        "max_decision_latency_ms": _ms(max(ranked, default=float("nan"))),
        "forced_triggers": len(triggers.sent) - void,
        "forced_triggers_unanswered": unanswered,
        # NOTE: the GPUs it took had left the deployment's plan before it was sent (a decision
        # this stand-in had not read yet): no plan disturbed, nothing to answer, not timed
        "forced_triggers_void": void,
        "trigger_turns_skipped": triggers.skipped,
        "triggers_per_s": args.triggers_per_s,
        "latency_at_events_per_s": round(steady.folded_per_s),
        "latency_phase_offered_events_per_s": round(steady.offered_per_s),
        "latency_phase_s": round(steady.seconds, 1),
        "decisions_read": runtime.decisions,
        "decision_processing_s_mean": _mean_seconds(
            metrics, "flexpipe_streams_decision_processing_seconds"
        ),
        # NOTE: the latency phase's own: the capacity phase folds cluster events behind a backlog
        "topology_stages_ms": _stages_ms(
            _minus(metrics, before_latency), "flexpipe_streams_topology_stage_seconds"
        ),
        "skipped_in_latency_phase": _by_label(
            _minus(metrics, before_latency), "flexpipe_streams_triggers_skipped_total", "why"
        ),
        "polling_baseline_p99_ms": _ms(_percentile(poll_latencies, 0.99)),
        "polling_baseline_p50_ms": _ms(_percentile(poll_latencies, 0.50)),
        "polling_baseline_preemptions": len(poll_latencies),
        "baseline_raw_consumer_events_per_s": round(raw_rate),
        "telemetry_messages": "per GPU" if not args.batched else "per node (NodeSamples, 8 GPUs)",
        "gpus": args.gpus,
        "deployments": args.deployments,
        "cpus": os.cpu_count(),
        "load_average_1m": round(os.getloadavg()[0], 2),
        "calibration_ms": calibration_ms(),
        "goal_events_per_s": GOAL_EVENTS_PER_S,
        "goal_p99_decision_latency_ms": GOAL_P99_MS,
        "goal_forced_triggers": args.min_triggers,
    }


def _ms(value: float) -> float | None:
    return None if value != value or value == float("inf") else round(value, 1)  # NaN, inf


def _mean_seconds(metrics: dict[str, float], name: str) -> float | None:
    total = sum(v for k, v in metrics.items() if k.startswith(f"{name}_sum"))
    count = sum(v for k, v in metrics.items() if k.startswith(f"{name}_count"))
    return round(total / count, 4) if count else None


def _minus(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    """Counters and histogram series of ``after`` less their value in ``before``."""
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def _by_label(metrics: dict[str, float], name: str, label: str) -> dict[str, float]:
    """The series of counter ``name`` by the value of ``label`` (non-zero ones)."""
    pattern = re.compile(rf'{label}="(?P<v>[^"]+)"')
    out: dict[str, float] = {}
    for key, value in metrics.items():
        if key.startswith(f"{name}{{") and (m := pattern.search(key)) and value:
            out[m["v"]] = out.get(m["v"], 0.0) + value
    return dict(sorted(out.items()))


_STAGE = re.compile(r'stage="(?P<stage>[^"]+)"')
_LE = re.compile(r'le="(?P<le>[^"]+)"')


def _stages_ms(metrics: dict[str, float], name: str) -> dict[str, dict[str, float | None]]:
    """Each stage of the worker's histogram ``name``: count, mean, p50 and p99 (interpolated
    inside its bucket, as Prometheus' ``histogram_quantile``), in ms."""
    buckets: dict[str, list[tuple[float, float]]] = {}
    for key, value in metrics.items():
        if not key.startswith(f"{name}_bucket{{"):
            continue
        label, le = _STAGE.search(key), _LE.search(key)
        if label and le:
            buckets.setdefault(label["stage"], []).append((float(le["le"]), value))
    out: dict[str, dict[str, float | None]] = {}
    for stage, rows in sorted(buckets.items()):
        rows.sort()
        count = rows[-1][1]
        total = metrics.get(f'{name}_sum{{stage="{stage}"}}', 0.0)
        out[stage] = {
            "count": count,
            "mean": _ms(1000 * total / count) if count else None,
            "p50": _ms(1000 * _bucket_quantile(rows, 0.50)),
            "p99": _ms(1000 * _bucket_quantile(rows, 0.99)),
        }
    return out


def _bucket_quantile(rows: list[tuple[float, float]], q: float) -> float:
    count = rows[-1][1] if rows else 0.0
    if not count:
        return float("nan")
    rank = q * count
    lower, below = 0.0, 0.0
    for le, cumulative in rows:
        if cumulative >= rank:
            if le == float("inf"):
                return lower  # past the last finite bucket: its bound, a lower bound
            return lower + (le - lower) * (rank - below) / max(cumulative - below, 1e-12)
        lower, below = le, cumulative
    return lower


async def _answered(triggers: Triggers, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and triggers.latencies()[1]:
        await asyncio.sleep(0.1)


def misses(result: dict[str, Any]) -> list[str]:
    """Each goal the result missed, named."""
    out = []
    if result["events_per_s"] < GOAL_EVENTS_PER_S:
        out.append(f"events_per_s {result['events_per_s']} < {GOAL_EVENTS_PER_S}")
    p99 = result["p99_decision_latency_ms"]
    if p99 is None or p99 > GOAL_P99_MS:
        out.append(f"p99_decision_latency_ms {p99} > {GOAL_P99_MS:g}")
    if result["forced_triggers"] < result["goal_forced_triggers"]:
        wanted = result["goal_forced_triggers"]
        out.append(f"forced_triggers {result['forced_triggers']} < {wanted}")
    if result["forced_triggers_unanswered"]:
        out.append(f"forced_triggers_unanswered {result['forced_triggers_unanswered']}")
    if result["backlog_left_after_drain_events"]:
        out.append(f"backlog_left_after_drain_events {result['backlog_left_after_drain_events']}")
    return out


def main() -> int:
    """Entry point of ``python -m bench.pipeline``."""
    parser = argparse.ArgumentParser(prog="python -m bench.pipeline", description=__doc__)
    parser.add_argument("--gpus", type=int, default=1000)
    parser.add_argument("--deployments", type=int, default=4)
    parser.add_argument("--offered", type=float, default=12_000.0, help="telemetry events/s")
    parser.add_argument("--duration-s", type=float, default=20.0, help="capacity phase")
    parser.add_argument(
        "--max-backlog", type=int, default=6000, help="events sent but not folded, at most"
    )
    parser.add_argument("--triggers-per-s", type=float, default=8.0)
    parser.add_argument("--min-triggers", type=int, default=1000)
    parser.add_argument(
        "--latency-events-per-s",
        type=float,
        default=None,
        help="telemetry events/s in the latency phase (default: 0.7 x capacity, 10,000 at most)",
    )
    parser.add_argument("--max-duration-s", type=float, default=300.0, help="latency phase cap")
    parser.add_argument(
        "--release-after-s",
        type=float,
        default=2.0,
        help="a preempted GPU is released once its trigger was answered, no sooner than this",
    )
    parser.add_argument("--ready-timeout-s", type=float, default=180.0)
    parser.add_argument("--drain-timeout-s", type=float, default=60.0)
    parser.add_argument("--answer-timeout-s", type=float, default=10.0)
    parser.add_argument(
        "--per-gpu",
        dest="batched",
        action="store_false",
        help="one message per GPU sample or launch report (default: one per node, NodeSamples)",
    )
    parser.add_argument(
        "--profile-worker",
        action="store_true",
        help="run the worker under cProfile and print where its CPU went (slows it)",
    )
    parser.add_argument(
        "--profile-out",
        type=Path,
        metavar="PATH",
        help="with --profile-worker: also keep the worker's pstats file at PATH",
    )
    args = parser.parse_args()
    with bench_broker("pipeline") as cfg:
        result = asyncio.run(run(args, cfg))
    missed = misses(result)
    result["completed"] = True
    result["missed"] = missed
    for miss in missed:
        print(f"bench.pipeline: missed: {miss}", file=sys.stderr)
    print_result(result)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())

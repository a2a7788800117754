"""One validated configuration object per process: YAML file plus environment overrides.

Load it once at the entry point with :func:`load_config`; nothing reads the environment at import
time. Environment variables override the file: ``FLEXPIPE_KAFKA__BOOTSTRAP_SERVERS=host:9092``
sets ``kafka.bootstrap_servers`` (double underscore separates nesting). Any bad key or value raises
:class:`ConfigError` with one line naming it.

Besides each component's own section, three describe the world every component shares:
``deployments`` (what is served and decided for, with an optional starting-plan hint),
``catalog`` (GPU classes, links and model shapes beyond gearbox's presets) and ``gearbox`` (the
decision's knobs, :class:`gearbox.config.GearboxConfig` itself, checked by its own bounds).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import pydantic
import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from flexpipe.errors import ConfigError
from gearbox.config import DEFAULT_CONFIG, DEFAULT_PLACEMENT_CONFIG, GearboxConfig, PlacementConfig
from gearbox.model import ModelSpec
from gearbox.presets import GPU_CLASSES, LINK_CLASSES, MODEL_ALIASES, MODELS
from gearbox.types import GpuClass, LinkClass

ENV_PREFIX = "FLEXPIPE_"
CONFIG_ENV = "FLEXPIPE_CONFIG"  # path of the YAML file when --config is not given


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class KafkaConfig(_Section):
    """How to reach the broker. Without ``bootstrap_servers`` FlexPipe starts its local Kafka."""

    bootstrap_servers: str | None = Field(None, description="host:port[,host:port]; None = local")
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] | None = None
    sasl_username: str | None = None
    sasl_password: str | None = None
    ssl_cafile: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    client_id: str = "flexpipe"
    request_timeout_ms: int = Field(30_000, ge=1_000, le=600_000)

    @model_validator(mode="after")
    def _sasl_needs_credentials(self) -> KafkaConfig:
        if self.security_protocol.startswith("SASL") and not (
            self.sasl_mechanism and self.sasl_username and self.sasl_password
        ):
            raise ValueError(
                "security_protocol SASL_* needs sasl_mechanism, sasl_username and sasl_password"
            )
        return self


class LocalKafkaConfig(_Section):
    """The self-started single-node KRaft broker used in development, CI and `make run`."""

    port: int = Field(0, ge=0, le=65535, description="0 = pick a free port")
    heap_mb: int = Field(512, ge=256, le=8192)
    version: str = Field("4.1.1", pattern=r"^4\.\d+\.\d+$")
    cache_dir: str = ".cache/kafka"
    start_timeout_s: float = Field(90.0, gt=0)


class TopicsConfig(_Section):
    """Topic naming and layout."""

    prefix: str = Field("", pattern=r"^[A-Za-z0-9._-]*$")
    partitions: int = Field(6, ge=1, le=1024)
    replication_factor: int = Field(1, ge=1, le=16)


class IntervalsConfig(_Section):
    """Clocks of the loop, in seconds."""

    sample_s: float = Field(1.0, gt=0, le=60)
    launch_drain_s: float = Field(0.2, gt=0, le=10)
    heartbeat_s: float = Field(15.0, gt=0, le=300)
    heartbeat_timeout_s: float = Field(45.0, gt=0, le=900)
    decision_s: float = Field(15.0, ge=10, le=30)

    @model_validator(mode="after")
    def _timeout_after_heartbeat(self) -> IntervalsConfig:
        if self.heartbeat_timeout_s <= self.heartbeat_s:
            raise ValueError("heartbeat_timeout_s must exceed heartbeat_s, or every GPU looks dead")
        return self


class DeploymentConfig(_Section):
    """A deployment: its model, starting plan hint and nominal load.

    The stream decides for it; a runtime worker serves it. Without ``block`` there is no hint:
    the deployment has no plan until gearbox picks one.
    """

    name: str = Field(..., pattern=r"^[A-Za-z0-9._-]+$", description="deployment name (topic key)")
    model: str = Field(..., description="model key: a gearbox preset or alias, or catalog.models")
    block: str | None = Field(None, description="domain of the starting plan; None = gearbox picks")
    tp: int = Field(1, ge=1, le=64)
    pp: int = Field(1, ge=1, le=16)
    replicas: int = Field(1, ge=1, le=256)
    arrival_rps: float = Field(1.0, ge=0, description="nominal load until serving telemetry")
    prompt_tokens: float = Field(512.0, ge=1)
    output_tokens: float = Field(256.0, ge=1)
    # A request meets the deployment's SLO when its TTFT and its mean gap between output tokens
    # are within these; None = gearbox's ttft_slo_ms / tbt_slo_ms.
    ttft_slo_ms: float | None = Field(None, gt=0, description="TTFT SLO; None = gearbox's")
    tbt_slo_ms: float | None = Field(None, gt=0, description="TBT SLO; None = gearbox's")
    residency: Literal["resident", "on_demand"] = Field(
        "resident",
        description="on_demand: no plan until a request arrives (one TP1 replica placed by "
        "gearbox.residency, block pins its domain); evicted when cold and its GPU is needed",
    )
    affinity: tuple[str, ...] = Field((), description="on_demand: prefer these' nodes")
    anti_affinity: tuple[str, ...] = Field((), description="on_demand: never these' nodes")

    @model_validator(mode="after")
    def _on_demand_shape(self) -> DeploymentConfig:
        if self.residency == "on_demand" and (self.tp, self.pp, self.replicas) != (1, 1, 1):
            raise ValueError(
                "residency: on_demand loads one TP1 replica (tp, pp and replicas must be 1)"
            )
        if self.residency == "resident" and (self.affinity or self.anti_affinity):
            raise ValueError("affinity: only on_demand deployments are placed by affinity")
        return self

    def slo_ms(self, gearbox: GearboxConfig) -> tuple[float, float]:
        """(TTFT, TBT) SLOs in ms, gearbox's where this deployment sets none."""
        return (
            self.ttft_slo_ms if self.ttft_slo_ms is not None else gearbox.ttft_slo_ms,
            self.tbt_slo_ms if self.tbt_slo_ms is not None else gearbox.tbt_slo_ms,
        )


class GpuClassConfig(_Section):
    """A GPU class by its datasheet figures; its key in ``catalog.gpu_classes`` names it."""

    peak_bf16_tflops: float = Field(..., gt=0, description="dense bf16 tensor-core peak")
    memory_bytes: int = Field(..., gt=0)
    memory_bandwidth_gbps: float = Field(..., gt=0, description="DRAM bandwidth, GB/s")

    def spec(self, name: str) -> GpuClass:
        """The gearbox value called ``name``."""
        return GpuClass(name, self.peak_bf16_tflops, self.memory_bytes, self.memory_bandwidth_gbps)


class LinkClassConfig(_Section):
    """An interconnect's per-GPU, per-direction bandwidth and one-hop latency."""

    bandwidth_gbps: float = Field(..., gt=0, description="GB/s per GPU per direction")
    latency_us: float = Field(..., ge=0)

    def spec(self, name: str) -> LinkClass:
        """The gearbox value called ``name``."""
        return LinkClass(name, self.bandwidth_gbps, self.latency_us)


class ModelConfig(_Section):
    """A dense decoder's shape, in Hugging Face ``config.json`` terms, for a model that is no
    gearbox preset; its key in ``catalog.models`` is its name in plans."""

    num_params: int = Field(..., gt=0)
    num_layers: int = Field(..., gt=0)
    hidden_size: int = Field(..., gt=0)
    num_heads: int = Field(..., gt=0)
    num_kv_heads: int = Field(..., gt=0, description="must divide num_heads")
    head_dim: int = Field(..., gt=0)
    dtype_bytes: Literal[1, 2, 4] = 2

    @model_validator(mode="after")
    def _kv_heads_divide_heads(self) -> ModelConfig:
        self.spec("check")  # NOTE: ModelSpec's own checks, raising ValueError naming the field
        return self

    def spec(self, name: str) -> ModelSpec:
        """The gearbox value called ``name``."""
        return ModelSpec(name=name, **self.model_dump())


class CatalogConfig(_Section):
    """Hardware and model keys beyond gearbox's presets (:mod:`gearbox.presets`), which they
    extend and, on a clash, replace."""

    gpu_classes: dict[str, GpuClassConfig] = Field(default_factory=dict)
    links: dict[str, LinkClassConfig] = Field(default_factory=dict)
    models: dict[str, ModelConfig] = Field(default_factory=dict)

    def gpu_class_specs(self) -> dict[str, GpuClass]:
        """Presets, then the configured classes, by key."""
        return {**GPU_CLASSES, **{k: c.spec(k) for k, c in self.gpu_classes.items()}}

    def link_specs(self) -> dict[str, LinkClass]:
        """Presets, then the configured links, by key."""
        return {**LINK_CLASSES, **{k: c.spec(k) for k, c in self.links.items()}}

    def model_specs(self) -> dict[str, ModelSpec]:
        """Presets and their aliases, then the configured models, by key."""
        return {**MODELS, **MODEL_ALIASES, **{k: m.spec(k) for k, m in self.models.items()}}


class StreamsConfig(_Section):
    """The stream processors (`flexpipe streams worker`); the decision interval is
    ``intervals.decision_s``."""

    app_id: str = Field("flexpipe-streams", pattern=r"^[A-Za-z0-9._-]+$")
    worker_id: str | None = Field(None, description="names this worker in decisions; None = pid")
    # NOTE: a burst of topology events from one failure reaches the worker within a few ms
    # (one fetch); the window is added to every forced decision's latency, and a round it
    # fails to merge costs one more decision step (~10 ms CPU on 1,000 GPUs). 25 ms was a
    # quarter of bench.pipeline's median trigger-to-decision latency.
    debounce_ms: float = Field(10.0, ge=0, le=5000, description="topology-event debounce")
    warmup_s: float = Field(5.0, ge=0, le=600, description="event time seen before deciding")
    load_window_s: float = Field(60.0, gt=0, le=3600, description="serving-load hopping window")
    load_step_s: float = Field(10.0, gt=0, le=3600)
    gpu_window_s: float = Field(10.0, gt=0, le=3600, description="kernel-launch hopping window")
    gpu_step_s: float = Field(2.0, gt=0, le=3600)
    view_refresh_s: float = Field(5.0, gt=0, le=300, description="max staleness of shared view")
    flush_interval_s: float = Field(0.5, gt=0, le=30, description="wall s between table flushes")
    max_future_skew_s: float = Field(300.0, gt=0, description="reject events this far ahead")
    transition_timeout_s: float = Field(
        300.0,
        gt=0,
        le=86_400,
        description="event time a switch stays in flight without DONE/ROLLED_BACK before the "
        "next switch may be decided",
    )
    cluster_peek: bool = Field(
        True,
        description="fold the owned cluster partitions' events through a consumer of the "
        "worker's own, ahead of Faust's delivery of the telemetry backlog (streams.peek): a "
        "forced switch no longer waits for the backlog; off = Faust's delivery alone",
    )
    gc_young_objects: int = Field(
        50_000,
        ge=0,
        le=10_000_000,
        description="tracked objects allocated (net) between the cyclic garbage collector's "
        "young-generation passes (Python's generation-0 threshold; 0 = Python's default, 700): "
        "at 700, short-lived table entries reach the oldest generation, whose full passes over "
        "the worker's ~450,000 objects stopped it (decision thread too) for 0.2-0.4 s",
    )
    metrics_port: int = Field(0, ge=0, le=65535, description="Prometheus port; 0 = off")
    data_dir: str | None = Field(
        None,
        description="Faust's local data directory (tables live in memory and are restored "
        "from their changelogs, so nothing there outlives the process); None = a temporary "
        "directory removed at exit",
    )
    session_timeout_s: float = Field(30.0, ge=3, le=300, description="consumer group session")
    ready_timeout_s: float = Field(
        60.0, gt=0, le=3600, description="wait for every topic in producer metadata, then exit"
    )
    max_tick_failures: int = Field(
        50, ge=1, le=100_000, description="consecutive failed decision ticks before exiting"
    )
    loglevel: Literal["crit", "error", "warn", "info", "debug"] = "warn"

    @model_validator(mode="after")
    def _windows_and_names(self) -> StreamsConfig:
        for size, step, name in (
            (self.load_window_s, self.load_step_s, "load"),
            (self.gpu_window_s, self.gpu_step_s, "gpu"),
        ):
            panes = size / step
            if step > size or abs(panes - round(panes)) > 1e-9:
                raise ValueError(
                    f"{name}_window_s must be a whole multiple of {name}_step_s: hopping windows "
                    "are built from step-sized panes"
                )
        return self


class RuntimeConfig(_Section):
    """Runtime workers (``runtime/``): deployments served, HTTP API, transitions, admission.

    Transition knobs (``*_timeout_s``, ``canary_s``, ``drain_timeout_s``, ``retry_backoff_s``)
    and ``serving_publish_s`` are in runtime-clock seconds, which run ``sim_speed`` times faster
    than the wall clock; ``tick_s`` and ``request_timeout_s`` are wall seconds.
    """

    worker_id: str = Field("runtime-0", pattern=r"^[A-Za-z0-9._-]+$")
    deployments: tuple[str, ...] = Field((), description="served; env: comma-separated list")
    http_host: str = "127.0.0.1"
    http_port: int = Field(8470, ge=0, le=65535, description="0 = pick a free port")
    control_token: str | None = Field(
        None, description="bearer token for /control/*; unset = control endpoints refuse all"
    )
    watermark: float = Field(0.85, gt=0.0, le=1.0, description="pre-OOM committed-memory mark")
    canary_share: float = Field(0.1, ge=0.0, le=1.0)
    canary_s: float = Field(2.0, ge=0.0)
    prepare_timeout_s: float = Field(120.0, gt=0.0)
    switch_timeout_s: float = Field(120.0, gt=0.0)
    cleanup_timeout_s: float = Field(120.0, gt=0.0)
    max_phase_retries: int = Field(2, ge=0, le=10)
    retry_backoff_s: float = Field(1.0, ge=0.0)
    drain_timeout_s: float = Field(60.0, gt=0.0)
    handover_wait_s: float = Field(
        60.0,
        gt=0.0,
        description="runtime s a handover's prepare waits for the deployment it takes GPUs "
        "from to move off them, then fails (retried, then rolled back)",
    )
    short_sequence_tokens: int = Field(32, ge=0, description="finish on the old plan below this")
    max_handovers_per_tick: int = Field(64, ge=1)
    max_queue_per_replica: int = Field(1024, ge=1)
    kv_admission: Literal["incremental", "max_tokens"] = Field(
        "incremental",
        description="KV a request commits when admitted: incremental = its prompt's pages + "
        "one, grown as it generates (youngest preempted when a page is refused); max_tokens = "
        "prompt + the client's stated max_tokens",
    )
    inter_domain_link: Literal[
        "nvlink", "nvlink-a100", "rdma", "pcie-local", "pcie", "ethernet"
    ] = Field("ethernet", description="link class between blocks (KV hand-over)")
    vmm_backend: Literal["host", "cuda"] = Field(
        "host", description="cuda: CUDA VMM on local GPUs (host accounting for any other)"
    )
    sim_speed: float = Field(1.0, gt=0.0, le=1000.0, description="runtime s per wall s")
    tick_s: float = Field(0.02, gt=0.0, le=1.0)
    serving_publish_s: float = Field(5.0, gt=0.0, description="runtime s between serving reports")
    request_timeout_s: float = Field(300.0, gt=0.0)
    model_load_wait_s: float = Field(
        120.0,
        gt=0.0,
        description="runtime s a request for an on-demand model that is not loaded waits for "
        "its load, then 429 model_loading",
    )
    memory_wait_s: float | None = Field(
        None,
        ge=0.0,
        description="runtime s a request the pre-OOM watermark refuses only for the moment "
        "(other sequences' KV fills the GPU) may wait for memory, less its first token's time, "
        "then 429 throttled_watermark; None = half each deployment's TTFT SLO "
        "(runtime.admission); 0 = refused at once",
    )
    ttft_deadline_s: float | None = Field(
        None,
        ge=0.0,
        description="runtime s a new request may go without a first token (queued or "
        "prefilling) before it is refused with 429 ttft_deadline: past its TTFT SLO it cannot "
        "count as goodput and would delay every later request; None = each deployment's TTFT "
        "SLO; 0 = never (it waits as long as the queue takes)",
    )
    engine: Literal["sim", "torch"] = Field(
        "sim",
        description="sim: SimEngine (default); torch: the torch reference engine (a small "
        "stand-in model on this host's CPU, runtime/engine/torch) over durable token ledgers",
    )
    ledger_dir: Path | None = Field(
        None,
        description="engine torch: one token ledger file per deployment here; a restarted "
        "worker resumes every unfinished sequence after its last emitted token",
    )
    ledger_fsync: bool = Field(
        False, description="fsync the ledger once per engine step (survives a host crash)"
    )

    @field_validator("deployments", mode="before")
    @classmethod
    def _split_env_list(cls, value: object) -> object:
        if isinstance(value, str):
            return tuple(part.strip() for part in value.split(",") if part.strip())
        return value

    @model_validator(mode="after")
    def _drain_inside_cleanup(self) -> RuntimeConfig:
        if self.drain_timeout_s >= self.cleanup_timeout_s:
            raise ValueError(
                "drain_timeout_s must be below cleanup_timeout_s, or every slow drain turns "
                "into a failed cleanup instead of a forced one"
            )
        return self

    @model_validator(mode="after")
    def _wait_inside_prepare(self) -> RuntimeConfig:
        if self.handover_wait_s >= self.prepare_timeout_s:
            raise ValueError(
                "handover_wait_s must be below prepare_timeout_s: the wait is part of the "
                "prepare phase, which must still load the weights"
            )
        return self

    @model_validator(mode="after")
    def _ledger_with_torch(self) -> RuntimeConfig:
        if self.engine == "torch" and self.ledger_dir is None:
            raise ValueError(
                "ledger_dir: required with engine torch: without the emitted tokens on disk a "
                "restarted worker generates every recovered sequence again from its prompt"
            )
        if self.engine == "sim" and self.ledger_dir is not None:
            raise ValueError(
                "ledger_dir: only engine torch keeps a token ledger (SimEngine "
                "generates counts, not token ids)"
            )
        return self


class FlexPipeConfig(_Section):
    """The whole process configuration."""

    kafka: KafkaConfig = KafkaConfig()
    local_kafka: LocalKafkaConfig = LocalKafkaConfig()
    topics: TopicsConfig = TopicsConfig()
    intervals: IntervalsConfig = IntervalsConfig()
    runtime: RuntimeConfig = RuntimeConfig()
    streams: StreamsConfig = StreamsConfig()
    deployments: tuple[DeploymentConfig, ...] = ()
    catalog: CatalogConfig = CatalogConfig()
    gearbox: GearboxConfig = DEFAULT_CONFIG
    placement: PlacementConfig = DEFAULT_PLACEMENT_CONFIG  # on-demand models (gearbox.residency)

    @model_validator(mode="after")
    def _deployments_unique_and_known(self) -> FlexPipeConfig:
        names = [d.name for d in self.deployments]
        if len(set(names)) != len(names):
            raise ValueError("deployments: names must be unique (they key the decisions topic)")
        known = self.catalog.model_specs()
        for d in self.deployments:
            for other in (*d.affinity, *d.anti_affinity):
                if other not in names:
                    raise ValueError(
                        f"deployments: {d.name}: affinity names unknown deployment {other!r}"
                    )
            if d.model not in known:
                raise ValueError(
                    f"deployments: {d.name}: unknown model {d.model!r} (known: "
                    f"{', '.join(sorted(known))}; add its shape under catalog.models)"
                )
        return self


def load_config(
    path: str | Path | None = None, env: Mapping[str, str] | None = None
) -> FlexPipeConfig:
    """Read the YAML file (``path`` or ``$FLEXPIPE_CONFIG``), apply env overrides, validate."""
    env = os.environ if env is None else env
    path = path or env.get(CONFIG_ENV) or None
    data: dict[str, Any] = {}
    if path:
        data = _read_yaml(Path(path))
    for key, value in sorted(env.items()):
        if key.startswith(ENV_PREFIX) and key != CONFIG_ENV:
            _set_path(data, key[len(ENV_PREFIX) :].lower().split("__"), value, key)
    try:
        return FlexPipeConfig.model_validate(data)
    except pydantic.ValidationError as exc:
        raise ConfigError(_describe(exc)) from None


def with_runtime(cfg: FlexPipeConfig, **overrides: object) -> FlexPipeConfig:
    """``cfg`` with ``runtime`` fields replaced (a process's flags over its config file),
    validated as a whole section: an error names the ``runtime.<key>`` at fault."""
    data = {**cfg.runtime.model_dump(), **overrides}
    try:
        runtime = RuntimeConfig.model_validate(data)
    except pydantic.ValidationError as exc:
        raise ConfigError(_describe(exc, ("runtime",))) from None
    return cfg.model_copy(update={"runtime": runtime})


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        loaded = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ConfigError(f"config file {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(
            f"config file {path}: not valid YAML ({exc})".replace("\n", " ")
        ) from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"config file {path}: top level must be a mapping")
    return loaded


def _set_path(data: dict[str, Any], parts: list[str], value: str, env_key: str) -> None:
    node = data
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{env_key}: {part} is not a section")
        node = child
    # NOTE: env values stay strings; pydantic's lax mode turns "9092" into 9092 for int fields.
    node[parts[-1]] = value


def _describe(exc: pydantic.ValidationError, section: tuple[str, ...] = ()) -> str:
    err = exc.errors(include_url=False)[0]
    loc = [*section, *(str(p) for p in err["loc"])]
    msg = err["msg"]
    if err["type"] in ("extra_forbidden", "unexpected_keyword_argument"):
        return f"config key {'.'.join(loc)}: unknown key"
    if err["type"] == "value_error":
        # NOTE: a validator's message that starts with a field's name ("hysteresis: must be
        # within ...", as gearbox's and the sections' checks write them) names the key.
        msg = msg.removeprefix("Value error, ")
        field, sep, rest = msg.partition(": ")
        if sep and field.isidentifier():
            loc, msg = ([*loc, field] if loc and loc[-1] != field else [field]), rest
    key = ".".join(loc) or "config"
    given = err.get("input")
    shown = "" if isinstance(given, dict | list | tuple) else f" (got {given!r})"
    return f"config key {key}: {msg}{shown}"

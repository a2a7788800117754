"""One validated configuration object per process: YAML file plus environment overrides.

Load it once at the entry point with :func:`load_config`; nothing reads the environment at import
time. Environment variables override the file: ``FLEXPIPE_KAFKA__BOOTSTRAP_SERVERS=host:9092``
sets ``kafka.bootstrap_servers`` (double underscore separates nesting). Any bad key or value raises
:class:`ConfigError` with one line naming it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import pydantic
import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from flexpipe.errors import ConfigError

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


class FlexPipeConfig(_Section):
    """The whole process configuration."""

    kafka: KafkaConfig = KafkaConfig()
    local_kafka: LocalKafkaConfig = LocalKafkaConfig()
    topics: TopicsConfig = TopicsConfig()
    intervals: IntervalsConfig = IntervalsConfig()


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


def _describe(exc: pydantic.ValidationError) -> str:
    err = exc.errors(include_url=False)[0]
    key = ".".join(str(p) for p in err["loc"]) or "config"
    if err["type"] == "extra_forbidden":
        return f"config key {key}: unknown key"
    given = err.get("input")
    shown = "" if isinstance(given, dict) else f" (got {given!r})"
    return f"config key {key}: {err['msg']}{shown}"

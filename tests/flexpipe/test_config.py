"""Config loading: file plus env overrides; every bad key or value named in one line."""

from __future__ import annotations

from pathlib import Path

import pytest

from flexpipe.cli import main
from flexpipe.config import load_config
from flexpipe.errors import ConfigError
from gearbox.config import DEFAULT_CONFIG, GearboxConfig
from gearbox.presets import MODEL_70B_GQA

pytestmark = pytest.mark.unit


def test_defaults_without_file_or_env() -> None:
    cfg = load_config(env={})
    assert cfg.kafka.bootstrap_servers is None
    assert cfg.intervals.heartbeat_s == 15.0
    assert cfg.intervals.decision_s == 15.0


def test_env_overrides_file(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("kafka:\n  bootstrap_servers: file:9092\ntopics:\n  partitions: 4\n")
    cfg = load_config(path, env={"FLEXPIPE_KAFKA__BOOTSTRAP_SERVERS": "env:9092"})
    assert cfg.kafka.bootstrap_servers == "env:9092"
    assert cfg.topics.partitions == 4


def test_config_path_from_env(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("topics:\n  prefix: prod.\n")
    assert load_config(env={"FLEXPIPE_CONFIG": str(path)}).topics.prefix == "prod."


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"FLEXPIPE_KAFKA__BOGUS": "1"}, "config key kafka.bogus: unknown key"),
        ({"FLEXPIPE_TOPICS__PARTITIONS": "many"}, "config key topics.partitions:"),
        ({"FLEXPIPE_INTERVALS__DECISION_S": "5"}, "config key intervals.decision_s:"),
        ({"FLEXPIPE_KAFKA__SECURITY_PROTOCOL": "SASL_SSL"}, "needs sasl_mechanism"),
        ({"FLEXPIPE_INTERVALS__HEARTBEAT_TIMEOUT_S": "10"}, "heartbeat_timeout_s must exceed"),
        ({"FLEXPIPE_TOPICS__PREFIX": "bad prefix!"}, "config key topics.prefix:"),
    ],
)
def test_bad_values_name_the_key(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(env=env)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_bad_yaml_and_missing_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("kafka: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad, env={})
    with pytest.raises(ConfigError, match="No such file"):
        load_config(tmp_path / "missing.yaml", env={})
    listy = tmp_path / "list.yaml"
    listy.write_text("- 1\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(listy, env={})


def test_cli_reports_bad_config_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("topics:\n  partitions: 0\n")
    monkeypatch.delenv("FLEXPIPE_CONFIG", raising=False)
    code = main(["--config", str(path), "kafka", "status"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1
    assert "config key topics.partitions" in err


WORLD = """\
deployments:
  - {name: chat, model: llama-70b-class, block: A, tp: 8, arrival_rps: 3.5}
  - {name: tiny, model: tiny-1b}
catalog:
  gpu_classes:
    h100-sxm: {peak_bf16_tflops: 900, memory_bytes: 85899345920, memory_bandwidth_gbps: 3000}
  links:
    slow: {bandwidth_gbps: 1.5, latency_us: 50}
  models:
    tiny-1b: {num_params: 1000000000, num_layers: 16, hidden_size: 2048, num_heads: 16,
              num_kv_heads: 4, head_dim: 128}
gearbox:
  hysteresis: 1.45
  cooldown_s: 300
"""


def test_world_sections_from_a_file(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(WORLD)
    cfg = load_config(path, env={"FLEXPIPE_GEARBOX__TTFT_SLO_MS": "1500"})
    assert [d.name for d in cfg.deployments] == ["chat", "tiny"]
    assert cfg.deployments[0].tp == 8 and cfg.deployments[1].block is None
    assert cfg.gearbox == GearboxConfig(hysteresis=1.45, cooldown_s=300.0, ttft_slo_ms=1500.0)
    models = cfg.catalog.model_specs()
    assert models["tiny-1b"].name == "tiny-1b" and models["tiny-1b"].num_kv_heads == 4
    assert models["llama-70b-class"] == MODEL_70B_GQA  # presets and aliases stay
    assert cfg.catalog.gpu_class_specs()["h100-sxm"].peak_bf16_tflops == 900.0  # replaced
    assert cfg.catalog.link_specs()["slow"].latency_us == 50.0
    assert cfg.catalog.link_specs()["nvlink"].bandwidth_gbps == 450.0


def test_defaults_are_gearbox_defaults_and_no_deployments() -> None:
    cfg = load_config(env={})
    assert cfg.gearbox == DEFAULT_CONFIG and cfg.deployments == ()
    assert cfg.catalog.model_specs()["llama-2-13b"].num_layers == 40


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("gearbox: {hysteresis: 2.0}", "config key gearbox.hysteresis: must be within [1.3, 1.5]"),
        ("gearbox: {bogus: 1}", "config key gearbox.bogus: unknown key"),
        ("gearbox: {cooldown_s: soon}", "config key gearbox.cooldown_s: Input should be"),
        ("gearbox: {noise_margin: 1.3}", "config key gearbox.noise_margin: must be <="),
        ("streams: {scenario: x.yaml}", "config key streams.scenario: unknown key"),
        ("deployments: [{name: a, model: nope}]", "config key deployments: a: unknown model"),
        (
            "deployments: [{name: a, model: llama-2-7b}, {name: a, model: llama-2-7b}]",
            "config key deployments: names must be unique",
        ),
        ("deployments: [{name: a, model: llama-2-7b, tp: 0}]", "config key deployments.0.tp:"),
        (
            "catalog: {models: {m: {num_params: 1, num_layers: 1, hidden_size: 128, "
            "num_heads: 3, num_kv_heads: 2, head_dim: 128}}}",
            "config key catalog.models.m.num_kv_heads: must divide num_heads=3",
        ),
        (
            "catalog: {gpu_classes: {g: {peak_bf16_tflops: -1, memory_bytes: 1, "
            "memory_bandwidth_gbps: 1}}}",
            "config key catalog.gpu_classes.g.peak_bf16_tflops:",
        ),
        ("catalog: {links: {l: {bandwidth_gbps: 1}}}", "config key catalog.links.l.latency_us:"),
    ],
)
def test_bad_world_sections_name_the_key(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(text + "\n")
    with pytest.raises(ConfigError) as err:
        load_config(path, env={})
    assert message in str(err.value)
    assert "\n" not in str(err.value)

"""Config loading: file plus env overrides; every bad key or value named in one line."""

from __future__ import annotations

from pathlib import Path

import pytest

from flexpipe.cli import main
from flexpipe.config import load_config
from flexpipe.errors import ConfigError

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

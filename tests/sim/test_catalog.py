"""A scenario as config: the deployments and catalog sections the product reads instead."""

from __future__ import annotations

from pathlib import Path

import pytest

from flexpipe.config import load_config
from gearbox.presets import MODEL_7B_MHA
from gearbox.starting import PlanHint
from sim.catalog import scenario_config, with_scenario, write_config
from sim.scenario import parse_scenario
from streams.deployments import resolve_deployments
from streams.snapshot import NominalLoad
from tests.fixtures.scenarios.builders import at, tiny, tiny_raw

pytestmark = pytest.mark.unit

GIB = 2**30


def test_sections_describe_the_deployments_and_the_hardware() -> None:
    sections = scenario_config(tiny())
    (chat,) = sections["deployments"]
    assert chat == {
        "name": "chat",
        "model": "llama-7b-class",
        "block": "A",
        "tp": 4,
        "pp": 1,
        "replicas": 1,
        "arrival_rps": 8.5,
        "prompt_tokens": pytest.approx((8.0 * 600 + 0.5 * 4000) / 8.5),
        "output_tokens": pytest.approx((8.0 * 200 + 0.5 * 300) / 8.5),
    }
    classes = sections["catalog"]["gpu_classes"]
    assert classes["big"] == {
        "peak_bf16_tflops": 989.0,
        "memory_bytes": 80 * GIB,
        "memory_bandwidth_gbps": 3350.0,
    }
    assert set(classes) == {"big", "small"}
    assert {"nvlink", "pcie"} <= set(sections["catalog"]["links"])
    assert sections["catalog"]["models"] == {}  # a preset alias needs no shape


def test_the_stream_sees_the_scenario_through_config() -> None:
    cfg = with_scenario(load_config(env={}), tiny())
    catalog, (chat,) = resolve_deployments(cfg)
    assert chat.model == MODEL_7B_MHA and chat.hint == PlanHint("A", 4, 1, 1)
    assert chat.nominal == NominalLoad(8.5, (8.0 * 600 + 0.5 * 4000) / 8.5, 1750.0 / 8.5)
    assert catalog.gpu_class("big", 1).memory_bytes == 80 * GIB
    assert catalog.gpu_class("h100-sxm", 1).peak_bf16_tflops == 989.0  # presets stay


def test_a_model_that_is_no_preset_gets_a_valid_shape() -> None:
    model = {"preset": "custom-13b", "params_b": 13.0, "num_layers": 40}
    raw = at(tiny_raw(), "deployments.chat.model", {**model, "kv_bytes_per_token": 819_200})
    scenario = parse_scenario(raw, source="tiny")
    shape = scenario_config(scenario)["catalog"]["models"]["custom-13b"]
    assert shape["num_params"] == 13_000_000_000 and shape["num_layers"] == 40
    _, (chat,) = resolve_deployments(with_scenario(load_config(env={}), scenario))
    assert chat.model.name == "custom-13b" and chat.model.num_layers == 40
    assert chat.model.num_heads % chat.model.num_kv_heads == 0


def test_with_scenario_replaces_deployments_and_keeps_configured_entries(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(
        "deployments: [{name: old, model: llama-2-7b}]\n"
        "catalog: {links: {slow: {bandwidth_gbps: 1.0, latency_us: 9.0}}}\n"
    )
    cfg = with_scenario(load_config(path, env={}), tiny())
    assert [d.name for d in cfg.deployments] == ["chat"]
    assert {"slow", "nvlink"} <= set(cfg.catalog.links)


def test_the_run_config_file_reads_back_equal_without_secrets(tmp_path: Path) -> None:
    env = {
        "FLEXPIPE_KAFKA__SECURITY_PROTOCOL": "SASL_SSL",
        "FLEXPIPE_KAFKA__SASL_MECHANISM": "PLAIN",
        "FLEXPIPE_KAFKA__SASL_USERNAME": "u",
        "FLEXPIPE_KAFKA__SASL_PASSWORD": "hunter2",
        "FLEXPIPE_GEARBOX__COOLDOWN_S": "90",
    }
    cfg = with_scenario(load_config(env=env), tiny())
    path = write_config(cfg, tmp_path / "out" / "flexpipe.yaml")
    assert "hunter2" not in path.read_text()
    again = load_config(path, env={"FLEXPIPE_KAFKA__SASL_PASSWORD": "hunter2"})
    assert again == cfg and again.gearbox.cooldown_s == 90.0

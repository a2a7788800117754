"""A runtime worker takes what it serves and the model shapes from the config's shared sections."""

from __future__ import annotations

from pathlib import Path

import pytest

from flexpipe.config import load_config
from flexpipe.errors import FlexPipeError
from gearbox.presets import MODEL_70B_GQA
from runtime.worker import RuntimeWorker

pytestmark = pytest.mark.unit

WORLD = """\
deployments:
  - {name: chat, model: llama-70b-class, block: A, tp: 8}
  - {name: tiny, model: tiny-1b}
catalog:
  models:
    tiny-1b: {num_params: 1000000000, num_layers: 16, hidden_size: 2048, num_heads: 16,
              num_kv_heads: 4, head_dim: 128}
"""


def test_serves_every_configured_deployment_with_catalog_models(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(WORLD)
    worker = RuntimeWorker(load_config(path, env={}))
    assert worker.deployments == ("chat", "tiny")
    models = worker.runtimes["tiny"].models
    assert models["tiny-1b"].num_kv_heads == 4
    assert models[MODEL_70B_GQA.name] == MODEL_70B_GQA  # plans name presets by their model name


def test_runtime_section_or_argument_narrows_what_is_served(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(WORLD)
    env = {"FLEXPIPE_RUNTIME__DEPLOYMENTS": "tiny"}
    assert RuntimeWorker(load_config(path, env=env)).deployments == ("tiny",)
    assert RuntimeWorker(load_config(path, env={}), deployments=["chat"]).deployments == ("chat",)


def test_nothing_to_serve_is_an_error() -> None:
    with pytest.raises(FlexPipeError, match="no deployments"):
        RuntimeWorker(load_config(env={}))


def test_memory_wait_defaults_to_half_each_deployments_ttft_slo(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(WORLD.replace("model: tiny-1b}", "model: tiny-1b, ttft_slo_ms: 500}"))
    worker = RuntimeWorker(load_config(path, env={}))
    assert worker.runtimes["chat"].core.memory_wait_s == 1.0  # gearbox's TTFT SLO: 2 s
    assert worker.runtimes["tiny"].core.memory_wait_s == 0.25
    env = {"FLEXPIPE_RUNTIME__MEMORY_WAIT_S": "0"}
    assert RuntimeWorker(load_config(path, env=env)).runtimes["tiny"].core.memory_wait_s == 0.0
    with pytest.raises(FlexPipeError, match="memory_wait_s"):
        load_config(path, env={"FLEXPIPE_RUNTIME__MEMORY_WAIT_S": "-1"})

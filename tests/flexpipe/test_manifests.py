"""The Kubernetes manifests parse and run commands the CLI accepts."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from flexpipe.cli import build_parser
from flexpipe.config import load_config

pytestmark = pytest.mark.unit
K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"


def containers() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            spec = (doc or {}).get("spec", {}).get("template", {}).get("spec", {})
            out += [(f"{path.name}/{c['name']}", c) for c in spec.get("containers", [])]
    return out


def test_there_are_containers() -> None:
    assert {name.split("/")[0] for name, _ in containers()} >= {
        "agent-daemonset.yaml",
        "streams-deployment.yaml",
        "runtime-deployment.yaml",
    }


@pytest.mark.parametrize(("where", "container"), containers(), ids=lambda v: str(v)[:40])
def test_container_args_parse(where: str, container: dict[str, Any]) -> None:
    args = [re.sub(r"\$\(\w+\)", "x", a) for a in container["args"]]
    build_parser().parse_args(args)


def test_configmap_is_a_valid_config(tmp_path: Path) -> None:
    doc = yaml.safe_load((K8S / "config.yaml").read_text())
    path = tmp_path / "flexpipe.yaml"
    path.write_text(doc["data"]["flexpipe.yaml"])
    cfg = load_config(path, env={"FLEXPIPE_KAFKA__SASL_PASSWORD": "secret"})
    assert cfg.topics.replication_factor == 3
    served = {
        c["args"][c["args"].index("--deployment") + 1]
        for _, c in containers()
        if "--deployment" in c["args"]
    }
    assert served and served <= {d.name for d in cfg.deployments}  # every served one is decided for

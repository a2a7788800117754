"""Every metric an alert or a dashboard panel queries is one the code exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry

from probes.agent import AgentMetrics
from probes.publisher import PublisherMetrics
from runtime.metrics import RuntimeMetrics
from streams.metrics import StreamsMetrics

pytestmark = pytest.mark.unit
DASHBOARDS = Path(__file__).resolve().parents[2] / "dashboards"
_NAME = re.compile(r"\b(flexpipe_[a-z0-9_]+|backend_up)\b")
_SUFFIXES = ("_bucket", "_count", "_sum", "_total", "_created")


def exported_names() -> set[str]:
    registry = CollectorRegistry()
    AgentMetrics(registry)
    PublisherMetrics(registry)
    StreamsMetrics(registry)
    RuntimeMetrics(registry)
    return {metric.name for metric in registry.collect()}


def base(name: str) -> str:
    for suffix in _SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def queried_names() -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    rules = yaml.safe_load((DASHBOARDS / "alerts.yaml").read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            found[f"alert {rule['alert']}"] = set(_NAME.findall(rule["expr"]))
    for path in DASHBOARDS.glob("*.json"):
        for panel in json.loads(path.read_text())["panels"]:
            exprs = " ".join(t["expr"] for t in panel.get("targets", []))
            found[f"{path.name}: {panel['title']}"] = set(_NAME.findall(exprs))
    return found


def test_every_queried_metric_is_exported() -> None:
    exported = exported_names()
    missing = {
        where: sorted(n for n in names if base(n) not in exported)
        for where, names in queried_names().items()
    }
    assert not {k: v for k, v in missing.items() if v}, missing


def test_dashboard_queries_something() -> None:
    queried = queried_names()
    assert sum(1 for names in queried.values() if names) >= 20

"""Scenario catalogue for the simulated cluster, and the rules that validate a scenario file.

The YAML files here ship with the package; :mod:`probes.scenario` holds the typed specs and the
public ``load_scenario``/``parse_scenario`` entry points.
"""

from __future__ import annotations

from pathlib import Path

SCENARIO_DIR = Path(__file__).parent
SEED_FRAGMENTED = SCENARIO_DIR / "seed-fragmented.yaml"
"""The article's cluster: blocks A 12 / B 9 / C 6 GPUs, 8 hours, three preemptions on A."""

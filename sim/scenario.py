"""Scenario files: the shipped catalogue (``sim/scenarios/*.yaml``) and loading one.

:mod:`sim.spec` holds the typed specs, :mod:`sim.rules` the rules that validate a file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from flexpipe.errors import ValidationError
from sim.rules import build
from sim.spec import Scenario

SCENARIO_DIR = Path(__file__).parent / "scenarios"
SEED_FRAGMENTED = SCENARIO_DIR / "seed-fragmented.yaml"
"""The article's cluster: blocks A 12 / B 9 / C 6 GPUs, 8 hours, three preemptions on A."""


def load_scenario(path: str | Path) -> Scenario:
    """Read and validate a scenario file; every problem is a ValidationError naming its entry."""
    p = Path(path)
    try:
        raw = yaml.safe_load(p.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ValidationError("", f"cannot read scenario {p}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise ValidationError("", f"{p}: not valid YAML{where}") from None
    return parse_scenario(raw, source=str(p))


def parse_scenario(raw: Any, *, source: str = "<mapping>") -> Scenario:
    """Validate a scenario already parsed from YAML/JSON (see :func:`load_scenario`)."""
    try:
        return build(raw, source)
    except ValidationError as exc:
        raise ValidationError(exc.field, f"{exc.reason} (in {source})") from None


def scenario_path(name: str | None) -> Path:
    """A scenario file path; a bare name picks one shipped in ``sim/scenarios``."""
    if name and (Path(name).exists() or "/" in name):
        return Path(name)
    stem = name or "seed-fragmented"
    return SCENARIO_DIR / f"{stem.removesuffix('.yaml')}.yaml"

"""Unit: which bench.fragmented run is held to issue 12's wall-clock budget."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.fragmented import budget_applies
from sim.scenario import SEED_FRAGMENTED

pytestmark = pytest.mark.unit

EIGHT_HOURS = 8 * 3600.0


def test_the_issues_run_is_held_to_the_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    assert budget_applies(SEED_FRAGMENTED, 5, EIGHT_HOURS, EIGHT_HOURS, True)
    # the same file named relative to the repository root is the same run
    monkeypatch.chdir(SEED_FRAGMENTED.parents[2])
    relative = Path("sim") / "scenarios" / SEED_FRAGMENTED.name
    assert budget_applies(relative, 6, EIGHT_HOURS, EIGHT_HOURS, True)


@pytest.mark.parametrize(
    ("seeds", "duration_s", "oracle"),
    [(4, EIGHT_HOURS, True), (5, 3600.0, True), (5, EIGHT_HOURS, False)],
)
def test_a_smaller_run_is_not(seeds: int, duration_s: float, oracle: bool) -> None:
    assert not budget_applies(SEED_FRAGMENTED, seeds, duration_s, EIGHT_HOURS, oracle)


def test_another_scenario_is_not() -> None:
    other = SEED_FRAGMENTED.with_name("mixed-failures.yaml")
    assert other.exists()
    assert not budget_applies(other, 5, EIGHT_HOURS, EIGHT_HOURS, True)

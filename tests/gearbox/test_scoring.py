"""Unit: the request profile the cost model is evaluated at (its memo key)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from gearbox import DEFAULT_CONFIG
from gearbox.scoring import request_profile
from tests.gearbox.builders import make_load

pytestmark = pytest.mark.unit


def test_means_are_costed_in_steps_so_drifting_loads_share_a_profile() -> None:
    assert DEFAULT_CONFIG.profile_step_tokens == 16
    drifting = {request_profile(make_load(prompt_tokens=p), DEFAULT_CONFIG) for p in (801, 805)}
    assert drifting == {(800, 192)}  # 200 / 16 = 12.5 rounds to even
    assert request_profile(make_load(prompt_tokens=3.0, output_tokens=7.0), DEFAULT_CONFIG) == (
        16,
        16,
    )  # never below one step


def test_a_step_of_one_costs_whole_tokens() -> None:
    whole = replace(DEFAULT_CONFIG, profile_step_tokens=1)
    assert request_profile(make_load(prompt_tokens=801.4, output_tokens=1.2), whole) == (801, 1)


def test_the_step_is_bounded() -> None:
    with pytest.raises(ValueError, match="profile_step_tokens"):
        replace(DEFAULT_CONFIG, profile_step_tokens=0)

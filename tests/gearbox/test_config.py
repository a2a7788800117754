"""Config models: defaults, bounds, cross-field rules, round trip."""

from __future__ import annotations

import pytest

from gearbox import DEFAULT_CONFIG, GearboxConfig, PlacementConfig


@pytest.mark.unit
def test_defaults_follow_the_article() -> None:
    assert DEFAULT_CONFIG.hysteresis == 1.4
    assert DEFAULT_CONFIG.cooldown_s >= 90
    assert DEFAULT_CONFIG.reverse_cooldown_factor > 1
    placement = PlacementConfig()
    assert placement.memory_k == 1.3
    assert (placement.weight_affinity, placement.weight_free_memory) == (0.5, 0.3)
    assert placement.weight_utilisation == 0.2


@pytest.mark.unit
def test_out_of_range_names_field_range_and_value() -> None:
    with pytest.raises(ValueError, match=r"^hysteresis: must be within \[1.3, 1.5\], got 2.0$"):
        GearboxConfig(hysteresis=2.0)
    with pytest.raises(ValueError, match="memory_utilisation"):
        GearboxConfig(memory_utilisation=0.0)
    with pytest.raises(ValueError, match="oom_watermark"):
        PlacementConfig(oom_watermark=1.5)
    with pytest.raises(ValueError, match=r"^displace_in_use: must be true or false, got 1$"):
        PlacementConfig(displace_in_use=1)  # type: ignore[arg-type]


@pytest.mark.unit
def test_cross_field_rules_say_why() -> None:
    with pytest.raises(ValueError, match=r"min_pd_link_gbps.*KV hand-off"):
        GearboxConfig(min_pp_link_gbps=20.0, min_pd_link_gbps=10.0)
    with pytest.raises(ValueError, match="sum to 1"):
        PlacementConfig(weight_affinity=0.6)


@pytest.mark.unit
def test_configs_round_trip() -> None:
    custom = GearboxConfig(hysteresis=1.3, cooldown_s=120.0, max_tp=8)
    assert GearboxConfig.from_dict(custom.to_dict()) == custom
    assert PlacementConfig.from_dict(PlacementConfig().to_dict()) == PlacementConfig()


@pytest.mark.unit
def test_cooldown_outlasts_the_load_window_and_the_drain() -> None:
    """A second switch must be judged on load that has seen the first one drain (finding 4)."""
    from flexpipe.config import FlexPipeConfig  # the tests may look outside gearbox

    cfg = FlexPipeConfig()
    settle_s = cfg.streams.load_window_s + cfg.runtime.drain_timeout_s
    assert DEFAULT_CONFIG.cooldown_s >= settle_s
    assert DEFAULT_CONFIG.cooldown_s * DEFAULT_CONFIG.reverse_cooldown_factor >= 2 * settle_s

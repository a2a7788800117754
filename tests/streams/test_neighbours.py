"""The neighbours a switch weighs: built from the plans, serving and gear tables."""

from __future__ import annotations

import pytest

from gearbox.correction import DEPLOYMENT_WIDE, Correction, Corrections
from gearbox.history import GearState
from gearbox.presets import MODEL_7B_MHA
from gearbox.starting import PlanHint
from streams.deployments import Deployment
from streams.neighbours import neighbours_view
from streams.snapshot import NominalLoad
from streams.step import PlanState
from streams.windows import HoppingWindow
from tests.gearbox.builders import deployment, tp_plan
from tests.streams.builders import T0_MS

pytestmark = pytest.mark.unit


def _dep(name: str) -> Deployment:
    hint = PlanHint("A", 1, 1, 1)
    return Deployment(name, "llama-2-7b", MODEL_7B_MHA, hint, NominalLoad(1, 100, 100))


def test_each_neighbour_carries_its_own_learned_factors() -> None:
    deps = (_dep("deciding"), _dep("learned"), _dep("fresh"), _dep("unplaced"))
    plans = {
        name: PlanState(current=deployment(tp_plan((f"{name}-g0",), MODEL_7B_MHA), name=name))
        for name in ("deciding", "learned", "fresh")
    }
    learned = Corrections(entries=(Correction(DEPLOYMENT_WIDE, 2.5, 100.0, 30),))
    gears = {"learned": GearState(corrections=learned), "deciding": GearState()}
    window = HoppingWindow(60.0, 15.0)
    out = neighbours_view(deps, plans, {}, gears.get, window, T0_MS / 1000, "deciding")
    by_name = {n.deployment: n for n in out}
    # the deciding deployment and one without a plan are no neighbours
    assert set(by_name) == {"learned", "fresh"}
    assert by_name["learned"].corrections == learned
    assert by_name["learned"].gpu_uuids == frozenset({"learned-g0"})
    # no gear state readable here: the plain model's figures
    assert by_name["fresh"].corrections == Corrections()

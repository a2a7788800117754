"""The other resident deployments a switch weighs (:class:`gearbox.joint.Neighbour`).

Built by the live decider and the replay alike from the plans and serving tables they hold,
so both give :func:`streams.step.step` the same inputs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from gearbox.correction import Corrections
from gearbox.history import GearState
from gearbox.joint import Neighbour
from streams.deployments import Deployment
from streams.load import ServingWindows, serving_aggregate
from streams.ondemand import PlanView, is_on_demand
from streams.snapshot import build_load
from streams.windows import HoppingWindow

__all__ = ["neighbours_view"]


def neighbours_view(
    deployments: Sequence[Deployment],
    plans: Mapping[str, PlanView],
    serving: Mapping[str, ServingWindows],
    gear_of: Callable[[str], GearState | None],
    window: HoppingWindow,
    now_s: float,
    deciding: str,
) -> tuple[Neighbour, ...]:
    """Every resident deployment but ``deciding`` with a plan in ``plans``: its model, its load
    over the window (the nominal load while the window holds no reports), the GPUs its plans
    hold, its learned TTFT factors (``gear_of(name)``'s; none when it is None) and, when it is
    settled (the runtime confirmed the plan the loop assumes, no switch in flight), that plan:
    only then may a handover move it. Only the neighbours' gear states are read.

    NOTE: on-demand deployments share GPUs by residency rounds, not gear plans: not included.
    """
    out = []
    for dep in deployments:
        plan = plans.get(dep.name)
        if plan is None or dep.name == deciding or is_on_demand(dep):
            continue
        held = [p for p in (plan.current, plan.confirmed) if p is not None]
        if not held:
            continue
        aggregate = serving_aggregate(serving.get(dep.name, ServingWindows()), window, now_s)
        load, _ = build_load(aggregate, dep.nominal, dep.model, now_s)
        gpus = frozenset().union(*(p.gpu_uuids for p in held))
        gear = gear_of(dep.name)
        learned = gear.corrections if gear is not None else Corrections()
        settled = (
            plan.in_flight is None
            and plan.current is not None
            and (plan.confirmed is not None and plan.confirmed.plan_id == plan.current.plan_id)
        )
        movable = plan.current if settled else None
        out.append(Neighbour(dep.name, dep.model, load, gpus, learned, movable))
    return tuple(out)

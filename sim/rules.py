"""Validation rules for scenario files: raw YAML mapping → :class:`sim.spec.Scenario`.

Every check raises :class:`flexpipe.errors.ValidationError` with the dotted path of the bad entry
(``domains.A.nodes.node-a1.gpus``, ``timeline[3].count``), never a KeyError or TypeError. Checks
run in file order, so the first problem a reader would meet is the one reported.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Mapping
from typing import Any

from flexpipe.errors import ValidationError
from flexpipe.schemas import FATAL_XIDS
from gearbox.config import PlacementConfig
from gearbox.presets import MODEL_ALIASES
from sim.spec import (
    DEFAULT_LINKS,
    DeploymentSpec,
    DomainSpec,
    GpuClassSpec,
    GpuSpec,
    Isolate,
    LinkChange,
    LinkSpec,
    LoadPhase,
    MixSpec,
    ModelSpecRef,
    NodeFailure,
    NodeRecovery,
    NodeSpec,
    PlanHint,
    Preempt,
    Release,
    Restore,
    Scenario,
    Swing,
    TimelineEvent,
    WorkloadSpec,
    Xid,
    gpu_uuid,
)

Check = Callable[[Any, str], Any]
_DEFAULT_EPOCH_MS = 1_735_689_600_000  # 2025-01-01T00:00:00Z
_GPU_REF = re.compile(r"^(?P<node>[^:\s]+):(?P<index>\d+)$")
_TOP_KEYS = (
    "name duration_s epoch_ms gpu_classes links inter_domain_link domains deployments timeline"
    " placement"
)


def _at(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


def _number(
    lo: float, *, hi: float = math.inf, above: bool = False, integer: bool = False
) -> Check:
    kind = "an integer" if integer else "a number"

    def check(value: Any, path: str) -> Any:
        ok_type = int if integer else (int, float)
        if isinstance(value, bool) or not isinstance(value, ok_type):
            raise ValidationError(path, f"expected {kind}, got {value!r}")
        if not math.isfinite(value):
            raise ValidationError(path, f"must be finite, got {value}")
        if value < lo or (above and value == lo) or value > hi:
            bound = f"{'>' if above else '>='} {lo}" + (f" and <= {hi}" if hi < math.inf else "")
            raise ValidationError(path, f"must be {bound}, got {value}")
        return value if integer else float(value)

    return check


def _text(value: Any, path: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValidationError(path, f"expected a non-empty string, got {value!r}")
    return value


POSITIVE = _number(0.0, above=True)
NON_NEGATIVE = _number(0.0)
COUNT = _number(1, integer=True)


def _mapping(value: Any, path: str, *, empty_ok: bool = False) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise ValidationError(path, f"expected a mapping, got {type(value).__name__}")
    for key in value:
        if not isinstance(key, str):
            raise ValidationError(_at(path, str(key)), "keys must be strings (quote it)")
    if not value and not empty_ok:
        raise ValidationError(path, "must not be empty")
    return dict(value)


def _raw(value: Any, path: str) -> Any:
    return value


def _list(value: Any, path: str) -> list[Any]:
    if not isinstance(value, list):
        raise ValidationError(path, f"expected a list, got {type(value).__name__}")
    return value


def _record(value: Any, path: str, fields: Mapping[str, Check], required: tuple[str, ...]) -> dict:
    """Check a mapping's keys against ``fields`` and run each field's check."""
    m = _mapping(value, path, empty_ok=not required)
    for key in m:
        if key not in fields:
            raise ValidationError(_at(path, key), f"unknown key (expected one of {sorted(fields)})")
    for key in required:
        if key not in m:
            raise ValidationError(_at(path, key), "required")
    return {k: fields[k](v, _at(path, k)) for k, v in m.items()}


# ---- sections ----------------------------------------------------------------------------------


def build(raw: Any, source: str) -> Scenario:
    """Validate a raw scenario mapping section by section and return the typed scenario."""
    required = ("name", "duration_s", "gpu_classes", "domains")
    top = _record(raw, "", dict.fromkeys(_TOP_KEYS.split(), _raw), required)
    duration_s = POSITIVE(top["duration_s"], "duration_s")
    classes = _gpu_classes(top["gpu_classes"])
    links = _links(_optional(top, "links", {}))
    inter = _text(top.get("inter_domain_link", "ethernet"), "inter_domain_link")
    if inter not in links:
        raise ValidationError("inter_domain_link", f"unknown link {inter!r} ({sorted(links)})")
    domains = _domains(top["domains"], classes, links)
    partial = Scenario(
        name=_text(top["name"], "name"),
        duration_s=duration_s,
        epoch_ms=_number(0, integer=True)(top.get("epoch_ms", _DEFAULT_EPOCH_MS), "epoch_ms"),
        gpu_classes=tuple(classes.values()),
        links=tuple(links.values()),
        inter_domain_link=inter,
        domains=domains,
        deployments=(),
        timeline=(),
        source=source,
    )
    deployments = _deployments(_optional(top, "deployments", {}), partial)
    timeline = _timeline(_optional(top, "timeline", []), partial)
    _check_timeline_state(timeline, partial)
    placement = _placement(_optional(top, "placement", {}))
    return dataclasses.replace(
        partial, deployments=deployments, timeline=timeline, placement=placement
    )


def _placement(raw: Any) -> tuple[tuple[str, float], ...]:
    """The config's ``placement`` knobs the scenario sets (on-demand models), checked by
    :class:`gearbox.config.PlacementConfig` itself."""
    fields = {f.name: NON_NEGATIVE for f in dataclasses.fields(PlacementConfig)}
    m = _record(raw, "placement", fields, ())
    try:
        PlacementConfig(**m)
    except ValueError as exc:
        raise ValidationError("placement", str(exc)) from None
    return tuple(sorted(m.items()))


def _optional(top: dict[str, Any], key: str, empty: Any) -> Any:
    value = top.get(key)
    return empty if value is None else value  # "timeline:" with nothing under it is empty


def _gpu_classes(raw: Any) -> dict[str, GpuClassSpec]:
    fields = {
        "peak_bf16_tflops": POSITIVE,
        "memory_gb": POSITIVE,
        "memory_bandwidth_gbps": POSITIVE,
        "tdp_w": POSITIVE,
    }
    required = ("peak_bf16_tflops", "memory_gb", "memory_bandwidth_gbps")
    return {
        name: GpuClassSpec(name=name, **_record(spec, _at("gpu_classes", name), fields, required))
        for name, spec in _mapping(raw, "gpu_classes").items()
    }


def _links(raw: Any) -> dict[str, LinkSpec]:
    fields = {"bandwidth_gbps": POSITIVE, "latency_us": NON_NEGATIVE}
    links = dict(DEFAULT_LINKS)
    for name, spec in _mapping(raw, "links", empty_ok=True).items():
        args = _record(spec, _at("links", name), fields, tuple(fields))
        links[name] = LinkSpec(name=name, **args)
    return links


def _domains(
    raw: Any, classes: Mapping[str, GpuClassSpec], links: Mapping[str, LinkSpec]
) -> tuple[DomainSpec, ...]:
    domains: list[DomainSpec] = []
    owner: dict[str, str] = {}  # node -> domain, names are cluster-wide
    for dom_id, spec in _mapping(raw, "domains").items():
        path = _at("domains", dom_id)
        m = _record(spec, path, {"link": _text, "nodes": _mapping}, ("link", "nodes"))
        if m["link"] not in links:
            raise ValidationError(f"{path}.link", f"unknown link {m['link']!r} ({sorted(links)})")
        nodes = []
        for node, node_raw in m["nodes"].items():
            node_path = _at(f"{path}.nodes", node)
            if node in owner:
                raise ValidationError(node_path, f"node name already used in domain {owner[node]}")
            owner[node] = dom_id
            nodes.append(_node(node_raw, node_path, dom_id, node, classes))
        domains.append(DomainSpec(id=dom_id, link=m["link"], nodes=tuple(nodes)))
    return tuple(domains)


def _node(
    raw: Any, path: str, domain: str, node: str, classes: Mapping[str, GpuClassSpec]
) -> NodeSpec:
    m = _record(raw, path, {"gpus": _raw, "isolated": _list}, ("gpus",))
    gpus_path = f"{path}.gpus"
    if isinstance(m["gpus"], Mapping):  # {class: count}
        entries = [(_at(gpus_path, c), c, n) for c, n in _mapping(m["gpus"], gpus_path).items()]
    else:  # [class, class, ...]
        entries = [(_at(gpus_path, i), c, 1) for i, c in enumerate(_list(m["gpus"], gpus_path))]
    kinds: list[str] = []
    for at, cls, count in entries:
        if _text(cls, at) not in classes:
            raise ValidationError(at, f"unknown GPU class {cls!r} (known: {sorted(classes)})")
        kinds += [cls] * COUNT(count, at)
    if not kinds:
        raise ValidationError(gpus_path, "a node needs at least one GPU")
    isolated: set[int] = set()
    for i, idx in enumerate(m.get("isolated", [])):
        at = _at(f"{path}.isolated", i)
        idx = _number(0, hi=len(kinds) - 1, integer=True)(idx, at)
        if idx in isolated:
            raise ValidationError(at, f"GPU {idx} listed twice")
        isolated.add(idx)
    gpus = tuple(
        GpuSpec(gpu_uuid(domain, node, i), node, domain, i, cls, isolated=i in isolated)
        for i, cls in enumerate(kinds)
    )
    return NodeSpec(name=node, domain=domain, gpus=gpus)


def _deployments(raw: Any, sc: Scenario) -> tuple[DeploymentSpec, ...]:
    free = {d.id: sum(not g.isolated for g in d.gpus) for d in sc.domains}
    out = []
    for name, spec in _mapping(raw, "deployments", empty_ok=True).items():
        path = _at("deployments", name)
        fields = {
            "model": _raw,
            "plan": _raw,
            "workload": _raw,
            "memory_utilisation": _number(0.0, hi=1.0),
            "ttft_slo_ms": POSITIVE,
            "tbt_slo_ms": POSITIVE,
            "on_demand": _raw,
        }
        on_demand = isinstance(spec, dict) and "on_demand" in spec
        required = (
            ("model", "on_demand", "workload") if on_demand else ("model", "plan", "workload")
        )
        m = _record(spec, path, fields, required)
        model = _model(m["model"], f"{path}.model")
        plan = None
        if "plan" in m:
            plan = _plan(m["plan"], f"{path}.plan", sc, model)
            if on_demand:
                raise ValidationError(f"{path}.plan", "an on_demand deployment has no plan")
            if plan.num_gpus > free[plan.block]:
                raise ValidationError(
                    f"{path}.plan",
                    f"needs {plan.num_gpus} GPUs but block {plan.block} has "
                    f"{free[plan.block]} left (isolated GPUs and earlier deployments excluded)",
                )
            free[plan.block] -= plan.num_gpus
        placing = _on_demand(m["on_demand"], f"{path}.on_demand", sc) if on_demand else {}
        workload = _workload(m["workload"], f"{path}.workload", sc.duration_s)
        share = m.get("memory_utilisation", 0.0)
        out.append(
            DeploymentSpec(
                name,
                model,
                plan,
                workload,
                memory_utilisation=share,
                ttft_slo_ms=m.get("ttft_slo_ms"),
                tbt_slo_ms=m.get("tbt_slo_ms"),
                on_demand=on_demand,
                **placing,
            )
        )
    names = {d.name for d in out}
    for d in out:
        for other in (*d.affinity, *d.anti_affinity):
            if other not in names:
                at = _at(_at("deployments", d.name), "on_demand")
                raise ValidationError(at, f"unknown deployment {other!r}")
    return tuple(out)


def _on_demand(raw: Any, path: str, sc: Scenario) -> dict[str, Any]:
    """An on-demand deployment's placement: ``{pin: domain, affinity: [...], anti_affinity:
    [...]}``, every key optional (``{}`` = anywhere)."""
    fields = {"pin": _text, "affinity": _raw, "anti_affinity": _raw}
    m = _record(raw if raw is not None else {}, path, fields, ())
    pin = m.get("pin")
    if pin is not None and pin not in {d.id for d in sc.domains}:
        raise ValidationError(_at(path, "pin"), f"unknown domain {pin!r}")
    out: dict[str, Any] = {"pin": pin}
    for key in ("affinity", "anti_affinity"):
        names = m.get(key, [])
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise ValidationError(_at(path, key), "a list of deployment names")
        out[key] = tuple(names)
    return out


def _model(raw: Any, path: str) -> ModelSpecRef:
    if isinstance(raw, str):
        raw = {"preset": raw}
    fields = {
        "preset": _text,
        "params_b": POSITIVE,
        "num_layers": COUNT,
        "kv_bytes_per_token": COUNT,
    }
    m = _record(raw, path, fields, ("preset",))
    spec = MODEL_ALIASES.get(m["preset"])
    defaults = (
        (spec.num_params / 1e9, spec.num_layers, spec.kv_bytes_per_token) if spec else (None,) * 3
    )
    for key, default in zip(
        ("params_b", "num_layers", "kv_bytes_per_token"), defaults, strict=True
    ):
        if key not in m and default is None:
            raise ValidationError(
                _at(path, key), f"required for a preset not in {sorted(MODEL_ALIASES)}"
            )
        m.setdefault(key, default)
    return ModelSpecRef(**m)


def _plan(raw: Any, path: str, sc: Scenario, model: ModelSpecRef) -> PlanHint:
    fields = {"block": _text, "tp": COUNT, "pp": COUNT, "replicas": COUNT}
    plan = PlanHint(**_record(raw, path, fields, ("block",)))
    if plan.block not in {d.id for d in sc.domains}:
        raise ValidationError(f"{path}.block", f"unknown domain {plan.block!r}")
    smallest = min(sc.gpu_class(g.gpu_class).memory_total_bytes for g in sc.domain(plan.block).gpus)
    shard_bytes = model.weight_bytes / (plan.tp * plan.pp)
    # NOTE: 0.9 leaves room for the CUDA context, activations and some KV cache.
    if shard_bytes > 0.9 * smallest:
        raise ValidationError(
            f"{path}.tp",
            f"{model.preset} weights need {shard_bytes / 2**30:.0f} GiB per GPU at tp×pp="
            f"{plan.tp * plan.pp}; block {plan.block} GPUs hold {smallest / 2**30:.0f} GiB",
        )
    return plan


def _workload(raw: Any, path: str, duration_s: float) -> WorkloadSpec:
    fields = {"chat": _raw, "summarisation": _raw, "swing": _raw, "phases": _list}
    m = _record(raw, path, fields, ())
    if "chat" not in m and "summarisation" not in m:
        raise ValidationError(path, "needs a chat or a summarisation mix")
    mix_fields = {
        "arrival_rps": NON_NEGATIVE,
        "prompt_tokens_mean": POSITIVE,
        "output_tokens_mean": POSITIVE,
    }
    idle = {"arrival_rps": 0.0, "prompt_tokens_mean": 1.0, "output_tokens_mean": 1.0}
    mixes = {
        key: MixSpec(**(_record(m[key], _at(path, key), mix_fields, tuple(mix_fields))))
        if key in m
        else MixSpec(**idle)
        for key in ("chat", "summarisation")
    }
    swing_fields = {
        "amplitude": _number(0.0, hi=1.0),
        "period_s": POSITIVE,
        "peak_s": _number(-math.inf),
    }
    swing = Swing(**_record(m.get("swing", {}), f"{path}.swing", swing_fields, ()))
    phases = _phases(m.get("phases", []), f"{path}.phases", duration_s)
    return WorkloadSpec(mixes["chat"], mixes["summarisation"], swing, phases)


def _phases(raw: list[Any], path: str, duration_s: float) -> tuple[LoadPhase, ...]:
    fields = {
        "name": _text,
        "start_s": NON_NEGATIVE,
        "end_s": POSITIVE,
        "multiplier": NON_NEGATIVE,
        "chat": NON_NEGATIVE,
        "summarisation": NON_NEGATIVE,
    }
    phases: list[LoadPhase] = []
    for i, entry in enumerate(raw):
        at = _at(path, i)
        m = _record(entry, at, fields, ("start_s", "end_s"))
        if m["end_s"] <= m["start_s"]:
            raise ValidationError(f"{at}.end_s", f"must be after start_s ({m['start_s']})")
        if m["end_s"] > duration_s:
            raise ValidationError(f"{at}.end_s", f"beyond the scenario's duration ({duration_s})")
        if phases and m["start_s"] < phases[-1].end_s:
            raise ValidationError(
                f"{at}.start_s", f"overlaps or precedes phase {i - 1} (ends {phases[-1].end_s})"
            )
        both = m.get("multiplier", 1.0)
        phases.append(
            LoadPhase(
                name=m.get("name", f"phase-{i}"),
                start_s=m["start_s"],
                end_s=m["end_s"],
                chat_multiplier=m.get("chat", both),
                summarisation_multiplier=m.get("summarisation", both),
            )
        )
    return tuple(phases)


# ---- timeline ----------------------------------------------------------------------------------


def _one_of(known: Mapping[str, Any], what: str) -> Check:
    def check(value: Any, path: str) -> str:
        if _text(value, path) not in known:
            raise ValidationError(path, f"unknown {what} {value!r} (known: {sorted(known)})")
        return str(value)

    return check


def _gpu_ref(sc: Scenario) -> Check:
    uuids = {(g.node, g.index): g.uuid for g in sc.gpus}

    def check(value: Any, path: str) -> str:
        match = _GPU_REF.match(_text(value, path))
        key = (match["node"], int(match["index"])) if match else None
        if key is None or key not in uuids:
            raise ValidationError(path, f"unknown GPU {value!r} (expected '<node>:<index>')")
        return uuids[key]

    return check


def _event_table(sc: Scenario) -> dict[str, tuple[type, dict[str, Check], tuple[str, ...]]]:
    domain = _one_of({d.id: d for d in sc.domains}, "domain")
    node = _one_of({n.name: n for n in sc.nodes}, "node")
    gpu = _gpu_ref(sc)

    def gpus(value: Any, path: str) -> tuple[str, ...]:
        return tuple(gpu(v, _at(path, i)) for i, v in enumerate(_list(value, path)))

    preempt = {"domain": domain, "count": COUNT, "gpus": gpus, "id": _text}
    release = {"domain": domain, "count": COUNT, "preemption": _text}
    link = {"domain": domain, "bandwidth_gbps": POSITIVE}
    return {
        "preempt": (Preempt, preempt, ("domain",)),
        "release": (Release, release, ("domain",)),
        "node_failure": (NodeFailure, {"node": node}, ("node",)),
        "node_recovery": (NodeRecovery, {"node": node}, ("node",)),
        "xid": (Xid, {"gpu": gpu, "code": _number(1, hi=999, integer=True)}, ("gpu", "code")),
        "isolate": (Isolate, {"gpu": gpu, "reason": _text}, ("gpu",)),
        "restore": (Restore, {"gpu": gpu}, ("gpu",)),
        "link": (LinkChange, link, ("domain", "bandwidth_gbps")),
    }


def _timeline(raw: Any, sc: Scenario) -> tuple[TimelineEvent, ...]:
    table = _event_table(sc)
    events: list[TimelineEvent] = []
    for i, entry in enumerate(_list(raw, "timeline")):
        path = _at("timeline", i)
        m = _mapping(entry, path)
        kind = m.pop("type", None)
        if kind not in table:
            raise ValidationError(f"{path}.type", f"expected one of {sorted(table)}, got {kind!r}")
        if "t_s" not in m:
            raise ValidationError(f"{path}.t_s", "required")
        t_s = _number(0.0, hi=sc.duration_s)(m.pop("t_s"), f"{path}.t_s")
        if events and t_s < events[-1].t_s:
            raise ValidationError(f"{path}.t_s", f"before the previous event ({events[-1].t_s})")
        cls, fields, required = table[kind]
        args = _record(m, path, fields, required)
        if kind == "preempt":
            args = _preempt_args(args, path, i)
        events.append(cls(t_s=t_s, **args))
    return tuple(events)


def _preempt_args(args: dict[str, Any], path: str, i: int) -> dict[str, Any]:
    gpus = args.get("gpus", ())
    if "count" not in args and not gpus:
        raise ValidationError(f"{path}.count", "required (or name the gpus)")
    if gpus and args.setdefault("count", len(gpus)) != len(gpus):
        raise ValidationError(f"{path}.count", f"is {args['count']} but {len(gpus)} gpus named")
    if len(set(gpus)) != len(gpus):
        raise ValidationError(f"{path}.gpus", "names a GPU twice")
    args.setdefault("id", f"preempt-{i}")
    return args


# ---- timeline state: replay the events against a ledger of what each step leaves --------------


class _Ledger:
    """What the timeline has done so far: reservations per domain, down nodes, pulled GPUs."""

    def __init__(self, sc: Scenario) -> None:
        self.size = {d.id: len(d.gpus) for d in sc.domains}
        self.domain_of = {g.uuid: g.domain for g in sc.gpus}
        self.held: dict[str, list[list[Any]]] = {d.id: [] for d in sc.domains}  # [id, count]
        self.ids: set[str] = set()
        self.down: set[str] = set()
        self.pulled = {g.uuid for g in sc.gpus if g.isolated}  # isolated or fatally failed

    def preempt(self, ev: Preempt, path: str) -> None:
        if ev.id in self.ids:
            raise ValidationError(f"{path}.id", f"preemption id {ev.id!r} already used")
        for j, uuid in enumerate(ev.gpus):
            if self.domain_of[uuid] != ev.domain:
                raise ValidationError(f"{path}.gpus[{j}]", f"not in domain {ev.domain}")
        free = self.size[ev.domain] - sum(n for _, n in self.held[ev.domain])
        if ev.count > free:
            raise ValidationError(
                f"{path}.count", f"takes {ev.count} GPUs but {ev.domain} has {free} unreserved"
            )
        self.ids.add(ev.id)
        self.held[ev.domain].append([ev.id, ev.count])

    def release(self, ev: Release, path: str) -> None:
        held = self.held[ev.domain]
        if (ev.count is None) == (ev.preemption is None):
            raise ValidationError(f"{path}.count", "give exactly one of count, preemption")
        if ev.preemption is not None:
            entry = next((e for e in held if e[0] == ev.preemption), None)
            if entry is None:
                raise ValidationError(
                    f"{path}.preemption",
                    f"no earlier preemption {ev.preemption!r} holds GPUs in domain {ev.domain}",
                )
            held.remove(entry)
            return
        assert ev.count is not None
        if ev.count > sum(n for _, n in held):
            raise ValidationError(
                f"{path}.count", f"releases {ev.count} GPUs but {ev.domain} holds fewer"
            )
        left = ev.count
        while left:  # oldest reservation first, as the simulator releases them
            take = min(left, held[0][1])
            held[0][1] -= take
            left -= take
            if not held[0][1]:
                held.pop(0)

    def node(self, ev: NodeFailure | NodeRecovery, path: str) -> None:
        failing = isinstance(ev, NodeFailure)
        if failing == (ev.node in self.down):
            state = "already down" if failing else "not down"
            raise ValidationError(f"{path}.node", f"node {ev.node} is {state}")
        (self.down.add if failing else self.down.discard)(ev.node)

    def gpu(self, ev: Xid | Isolate | Restore, path: str) -> None:
        if isinstance(ev, Isolate) and ev.gpu in self.pulled:
            raise ValidationError(f"{path}.gpu", "already isolated or failed")
        if isinstance(ev, Restore) and ev.gpu not in self.pulled:
            raise ValidationError(f"{path}.gpu", "is neither isolated nor failed")
        if isinstance(ev, Isolate) or (isinstance(ev, Xid) and ev.code in FATAL_XIDS):
            self.pulled.add(ev.gpu)
        elif isinstance(ev, Restore):
            self.pulled.discard(ev.gpu)


def _check_timeline_state(events: tuple[TimelineEvent, ...], sc: Scenario) -> None:
    ledger = _Ledger(sc)
    for i, ev in enumerate(events):
        path = _at("timeline", i)
        if isinstance(ev, Preempt):
            ledger.preempt(ev, path)
        elif isinstance(ev, Release):
            ledger.release(ev, path)
        elif isinstance(ev, NodeFailure | NodeRecovery):
            ledger.node(ev, path)
        elif isinstance(ev, Xid | Isolate | Restore):
            ledger.gpu(ev, path)

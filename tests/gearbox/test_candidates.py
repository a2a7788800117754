"""Enumeration with pruning: which options exist and how many."""

from __future__ import annotations

import pytest

from gearbox import (
    DEFAULT_CONFIG,
    MODEL_7B_MHA,
    MODEL_70B_GQA,
    AtomicBlock,
    GearboxConfig,
    ModelSpec,
    OptionKind,
    ReplicaOption,
    TopologySnapshot,
    build_blocks,
    enumerate_options,
    split_layers,
)
from gearbox.ranking import available_memory
from tests.gearbox.builders import DomainSpec, article_cluster, make_cluster


def _options(
    snapshot: TopologySnapshot,
    model: ModelSpec = MODEL_70B_GQA,
    config: GearboxConfig = DEFAULT_CONFIG,
) -> tuple[tuple[AtomicBlock, ...], tuple[ReplicaOption, ...]]:
    blocks = build_blocks(snapshot, config)
    free = available_memory(snapshot, frozenset())
    return blocks, enumerate_options(blocks, snapshot, model, 1000, 200, free, config)


@pytest.mark.unit
def test_tp_stays_inside_blocks_and_divides_heads() -> None:
    blocks, options = _options(article_cluster())
    members = {b.block_id: set(b.gpu_uuids) for b in blocks}
    for option in options:
        for copy in option.copies:
            for template, group in zip(option.stages, copy.gpu_groups, strict=True):
                assert set(group) <= members[template.block_id]
                assert MODEL_70B_GQA.num_kv_heads % len(group) == 0


@pytest.mark.unit
def test_copies_in_a_block_use_disjoint_gpus() -> None:
    _, options = _options(article_cluster(), MODEL_7B_MHA)
    for option in options:
        gpus = [u for c in option.copies for g in c.gpu_groups for u in g]
        assert len(gpus) == len(set(gpus))


@pytest.mark.unit
def test_pipeline_only_across_blocks_too_small_alone() -> None:
    small = (DomainSpec("S1", "nvlink", ("l40s",) * 2), DomainSpec("S2", "nvlink", ("l40s",) * 2))
    snapshot = make_cluster(small, inter_domain_link="rdma")
    _, options = _options(snapshot)
    assert [o.kind for o in options] == [OptionKind.PP]
    plan = options[0].plan(MODEL_70B_GQA.name, 0)
    assert sum(s.num_layers for s in plan.stages) == 80
    assert len(plan.block_ids) == 2


@pytest.mark.unit
def test_no_pipeline_over_a_slow_inter_block_link() -> None:
    small = (DomainSpec("S1", "nvlink", ("l40s",) * 2), DomainSpec("S2", "nvlink", ("l40s",) * 2))
    snapshot = make_cluster(small, inter_domain_link="ethernet")
    strict = GearboxConfig(min_pp_link_gbps=20.0, min_pd_link_gbps=20.0)
    assert _options(snapshot, config=strict)[1] == ()


@pytest.mark.unit
def test_pd_needs_a_fast_enough_link() -> None:
    kinds = {o.kind for o in _options(article_cluster())[1]}
    assert OptionKind.PD in kinds
    strict = GearboxConfig(min_pp_link_gbps=20.0, min_pd_link_gbps=20.0)
    assert OptionKind.PD not in {o.kind for o in _options(article_cluster(), config=strict)[1]}


@pytest.mark.unit
def test_layer_split_is_proportional_to_speed_and_capped() -> None:
    assert split_layers(80, [3.0, 1.0], [80, 80]) == (60, 20)
    assert split_layers(80, [3.0, 1.0], [50, 80]) == (50, 30)
    assert split_layers(10, [1.0, 1.0, 1.0], [10, 10, 10]) == (4, 3, 3)
    assert split_layers(80, [1.0, 1.0], [30, 30]) is None
    assert split_layers(2, [100.0, 1.0], [2, 2]) == (1, 1)


@pytest.mark.unit
def test_mixed_hardware_pipeline_gives_faster_stage_more_layers() -> None:
    snapshot = make_cluster(
        (DomainSpec("F", "nvlink", ("l40s",) * 2), DomainSpec("S", "nvlink", ("a6000-48g",) * 2)),
        inter_domain_link="rdma",
    )
    plan = _options(snapshot)[1][0].plan(MODEL_70B_GQA.name, 0)
    by_class = {s.gpu_class.name: s.num_layers for s in plan.stages}
    assert by_class["l40s"] > by_class["a6000-48g"]


@pytest.mark.unit
def test_option_count_grows_with_blocks_not_gpus() -> None:
    def count(num_blocks: int, gpus_per_block: int) -> int:
        domains = [
            DomainSpec(f"D{i}", "nvlink", ("h100-sxm",) * gpus_per_block) for i in range(num_blocks)
        ]
        return len(_options(make_cluster(domains), MODEL_7B_MHA)[1])

    assert count(4, 8) == count(4, 16)  # twice the GPUs, same options
    assert count(8, 8) > count(4, 8)


@pytest.mark.unit
def test_a_gpu_without_room_does_not_sink_a_group() -> None:
    # six hoppers, the fourth in order full with another deployment's weights: TP4 fits on the
    # other five, and its copy leaves the full one out
    snapshot = make_cluster((DomainSpec("A", "nvlink", ("h100-sxm",) * 6, gpus_per_node=3),))
    blocks = build_blocks(snapshot, DEFAULT_CONFIG)
    free = dict(available_memory(snapshot, frozenset()))
    free["A-g03"] = 0
    options = enumerate_options(blocks, snapshot, MODEL_70B_GQA, 1000, 200, free, DEFAULT_CONFIG)
    tp4 = [o for o in options if o.kind is OptionKind.TP and o.gpus_per_copy == 4]
    assert len(tp4) == 1 and len(tp4[0].copies) == 1
    assert "A-g03" not in tp4[0].copies[0].gpu_groups[0]

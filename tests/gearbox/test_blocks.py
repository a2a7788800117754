"""Atomic blocks: who is in, how domains group, and stable ids."""

from __future__ import annotations

from dataclasses import replace

import pytest

from gearbox import DEFAULT_CONFIG, GearboxConfig, assign_block_ids, build_blocks, jaccard
from gearbox.blocks import BlockGroup
from gearbox.presets import LINK_CLASSES
from tests.gearbox.builders import NOW_S, DomainSpec, article_cluster, make_cluster, with_gpus


@pytest.mark.unit
def test_article_cluster_has_three_blocks() -> None:
    blocks = build_blocks(article_cluster(), DEFAULT_CONFIG)
    assert [(b.domain_id, b.num_gpus, b.link.name) for b in blocks] == [
        ("A", 12, "nvlink"),
        ("B", 9, "rdma"),
        ("C", 6, "pcie"),
    ]
    assert blocks[1].nodes == ("B-n0", "B-n1", "B-n2")


@pytest.mark.unit
def test_unhealthy_unschedulable_and_silent_gpus_are_out() -> None:
    snapshot = article_cluster()
    snapshot = with_gpus(snapshot, ["A-g00"], healthy=False)
    snapshot = with_gpus(snapshot, ["A-g01"], schedulable=False)
    snapshot = with_gpus(snapshot, ["A-g02"], last_seen_s=NOW_S - 46.0)
    snapshot = with_gpus(snapshot, ["A-g03"], last_seen_s=NOW_S - 45.0)  # exactly at the timeout
    block_a = build_blocks(snapshot, DEFAULT_CONFIG)[0]
    assert block_a.num_gpus == 9
    assert {"A-g00", "A-g01", "A-g02"}.isdisjoint(block_a.gpu_uuids)
    assert "A-g03" in block_a.gpu_uuids


@pytest.mark.unit
def test_slow_domain_splits_per_node() -> None:
    snapshot = make_cluster([DomainSpec("E", "ethernet", ("l40s",) * 6, gpus_per_node=2)])
    slow = GearboxConfig(min_block_link_gbps=20.0)
    blocks = build_blocks(snapshot, slow)
    assert sorted(b.nodes for b in blocks) == [("E-n0",), ("E-n1",), ("E-n2",)]
    assert len(build_blocks(snapshot, DEFAULT_CONFIG)) == 1


@pytest.mark.unit
def test_unknown_domain_gets_the_inter_domain_link() -> None:
    snapshot = with_gpus(article_cluster(), ["C-g00"], domain="ghost")
    ghost = [b for b in build_blocks(snapshot, DEFAULT_CONFIG) if b.domain_id == "ghost"]
    assert ghost[0].link == snapshot.inter_domain_link


@pytest.mark.unit
def test_ids_survive_small_membership_changes() -> None:
    before = build_blocks(article_cluster(), DEFAULT_CONFIG)
    shrunk = with_gpus(article_cluster(), ["A-g00", "A-g01", "A-g02"], healthy=False)
    after = build_blocks(shrunk, DEFAULT_CONFIG, previous=before)
    assert [b.block_id for b in after] == [b.block_id for b in before]
    assert after[0].num_gpus == 9


@pytest.mark.unit
def test_ids_change_when_most_members_are_new() -> None:
    before = build_blocks(article_cluster(), DEFAULT_CONFIG)
    lost = [f"A-g{i:02d}" for i in range(7)]  # 5 of 12 remain: Jaccard 5/12 < 0.5
    after = build_blocks(with_gpus(article_cluster(), lost, healthy=False), DEFAULT_CONFIG, before)
    assert after[0].block_id != before[0].block_id
    assert [b.block_id for b in after[1:]] == [b.block_id for b in before[1:]]


@pytest.mark.unit
def test_fresh_ids_are_deterministic() -> None:
    first = build_blocks(article_cluster(), DEFAULT_CONFIG)
    again = build_blocks(article_cluster(now_s=NOW_S + 5), DEFAULT_CONFIG)
    assert first == again


@pytest.mark.unit
def test_a_split_block_keeps_its_id_on_the_larger_part() -> None:
    link = LINK_CLASSES["nvlink"]
    whole = assign_block_ids(
        [BlockGroup("X", link, tuple(f"g{i}" for i in range(8)), ("n",))], (), 0.5
    )
    parts = [
        BlockGroup("X", link, ("g0", "g1"), ("n",)),
        BlockGroup("X", link, tuple(f"g{i}" for i in range(2, 8)), ("n",)),
    ]
    split = assign_block_ids(parts, whole, 0.5)
    big = next(b for b in split if b.num_gpus == 6)
    small = next(b for b in split if b.num_gpus == 2)
    assert big.block_id == whole[0].block_id
    assert small.block_id != whole[0].block_id


@pytest.mark.unit
def test_jaccard() -> None:
    assert jaccard(frozenset("ab"), frozenset("bc")) == pytest.approx(1 / 3)
    assert jaccard(frozenset(), frozenset()) == 0.0


@pytest.mark.unit
def test_blocks_round_trip() -> None:
    block = build_blocks(article_cluster(), DEFAULT_CONFIG)[2]
    assert type(block).from_dict(block.to_dict()) == block
    assert replace(block, block_id="x") != block

"""The candidate cache: a memo that returns what enumerating again would, and enumerates again
only the blocks a trigger touched."""

from __future__ import annotations

import dataclasses

import pytest

from bench.planner import make_cluster, make_load
from gearbox import (
    MODEL_70B_GQA,
    GearboxConfig,
    available_memory,
    build_blocks,
    cache,
    enumerate_options,
)
from gearbox.candidates import OptionKind, ReplicaOption
from gearbox.scoring import request_profile
from gearbox.types import TopologySnapshot


def _options(snapshot: TopologySnapshot) -> tuple[ReplicaOption, ...]:
    config = GearboxConfig()
    blocks = build_blocks(snapshot, config)
    prompt, output = request_profile(make_load(16), config)
    free = available_memory(snapshot, frozenset())
    return enumerate_options(blocks, snapshot, MODEL_70B_GQA, prompt, output, free, config)


def _with_free(snapshot: TopologySnapshot, uuid: str, free: int) -> TopologySnapshot:
    gpus = tuple(
        dataclasses.replace(g, free_memory_bytes=free) if g.uuid == uuid else g
        for g in snapshot.gpus
    )
    return dataclasses.replace(snapshot, gpus=gpus)


@pytest.fixture(autouse=True)
def _empty_cache() -> None:
    cache.clear()


def test_a_hit_returns_what_enumerating_again_returns() -> None:
    snapshot = make_cluster(16)
    first = _options(snapshot)
    assert cache.OPTIONS.stats.hits == 0
    second = _options(snapshot)
    assert cache.OPTIONS.stats.hits > 0
    cache.clear()
    assert second == first == _options(snapshot)
    kinds = {o.kind.value for o in first}
    assert kinds == {"tp", "pp", "pd"}, "the hard case: every kind of option is enumerated"


def test_only_the_touched_block_is_enumerated_again() -> None:
    snapshot = make_cluster(16)
    _options(snapshot)
    before = cache.OPTIONS.stats
    gpu = next(g for g in snapshot.gpus if g.domain == "d004")  # a big (TP-hosting) block
    touched = _with_free(snapshot, gpu.uuid, gpu.free_memory_bytes // 2)
    after_touch = _options(touched)
    after = cache.OPTIONS.stats
    misses = after.misses - before.misses
    hosts = {o.block_ids[0] for o in after_touch if o.kind is OptionKind.TP}
    block = next(b for b in hosts if b.startswith("d004"))
    pairings = [o for o in after_touch if o.kind is OptionKind.PD and block in o.block_ids]
    # d004 is one of the two fastest prefill blocks (max_pd_prefill_blocks): its TP options, its
    # pairing as prefill with each of the 7 other TP hosts, and as decode for the other fastest.
    assert len(hosts) == 8 and GearboxConfig().max_pd_prefill_blocks == 2
    assert len(pairings) == 7 + 1, "every pairing of the touched block is feasible here"
    assert misses == 1 + 7 + 1, "the touched block and its PD pairings, nothing else"
    cache.clear()
    assert after_touch == _options(touched), "the touched block's options are fresh"


def test_the_cache_is_bounded_least_recently_used_first() -> None:
    memo = cache.OptionCache(max_entries=2)
    memo.get_or("a", lambda: 1)
    memo.get_or("b", lambda: 2)
    memo.get_or("a", lambda: 0)  # a hit: "a" is now the most recent
    memo.get_or("c", lambda: 3)  # evicts "b"
    assert memo.get_or("a", lambda: 0) == 1
    assert memo.get_or("b", lambda: 9) == 9
    assert memo.stats.entries == 2


def test_keys_compare_by_their_parts() -> None:
    assert cache.Key("x", (1, 2)) == cache.Key("x", (1, 2))
    assert hash(cache.Key("x", (1, 2))) == hash(cache.Key("x", (1, 2)))
    assert cache.Key("x", (1, 2)) != cache.Key("x", (1, 3))
    with pytest.raises(ValueError, match="max_entries"):
        cache.OptionCache(max_entries=0)


def test_equal_key_parts_are_interned_to_one_instance() -> None:
    memo = cache.OptionCache(max_entries=2)
    first = memo.intern(cache.Key("x", (1, 2)))
    again = memo.intern(cache.Key("x", (1, 2)))
    assert again is first  # a later lookup's part compares by identity
    assert memo.intern(cache.Key("x", (1, 3))) is not first
    memo.intern(cache.Key("y"))  # past the bound: the table starts again
    fresh = cache.Key("x", (1, 2))
    assert memo.intern(fresh) is fresh
    memo.clear()
    other = cache.Key("x", (1, 2))
    assert memo.intern(other) is other


def test_an_options_derived_figures_match_its_copies() -> None:
    options = _options(make_cluster(16))
    assert {o.kind for o in options} >= {OptionKind.TP, OptionKind.PD}
    for o in options:
        assert o.gpus_per_copy == sum(len(g) for g in o.copies[0].gpu_groups)
        assert o.total_rps == sum(c.capacity.capacity_rps for c in o.copies)

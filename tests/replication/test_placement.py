"""Replica placement chooses exactly: least-loaded healthy non-holders, DRAM sources first."""

from __future__ import annotations

import pytest

from kvflow.replication import NodeId, NodeLoad, Tier, choose_source, choose_targets

A, B, C, D = (NodeId(n) for n in ("a", "b", "c", "d"))


def test_targets_are_the_least_loaded_healthy_non_holders():
    loads = [NodeLoad(A, 5), NodeLoad(B, 9), NodeLoad(C, 1), NodeLoad(D, 1, healthy=False)]
    assert choose_targets({A: Tier.DRAM}, 3, loads) == [C, B]
    assert choose_targets({A: Tier.DRAM}, 2, loads) == [C]


def test_ties_break_by_node_id_and_enough_replicas_means_nothing():
    loads = [NodeLoad(C, 2), NodeLoad(B, 2), NodeLoad(A, 0)]
    assert choose_targets({A: Tier.SSD}, 2, loads) == [B]
    assert choose_targets({A: Tier.SSD, B: Tier.DRAM}, 2, loads) == []
    assert choose_targets({A: Tier.SSD, B: Tier.DRAM}, 1, loads) == []


def test_not_enough_candidates_gives_what_there_is():
    assert choose_targets({A: Tier.DRAM}, 5, [NodeLoad(A, 0), NodeLoad(B, 3)]) == [B]


@pytest.mark.parametrize("target", [0, -1, True, 1.5])
def test_bad_target(target):
    with pytest.raises(ValueError, match="target"):
        choose_targets({}, target, [])


def test_source_prefers_an_available_dram_copy():
    holders = {A: Tier.SSD, B: Tier.DRAM, C: Tier.DRAM}
    assert choose_source(holders, [A, B, C]) == B
    assert choose_source(holders, [A, C]) == C
    assert choose_source(holders, [A]) == A
    assert choose_source(holders, [D]) is None

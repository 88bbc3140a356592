"""A training peer's affinity: the partner it picks each upkeep tick from the stage map, what
``/api/swarm`` shows of it, and the ``affinity=False`` ablation switch (``Tunables``)."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
import trio

from p2pswarm.dht.records import Capacity, StageRecord
from p2pswarm.model.catalog import get_model
from p2pswarm.run.tunables import Tunables
from p2pswarm.swarm.service import SwarmService

SPEC = get_model("tiny-lm/2")


class StageMapOf:
    """The fresh records of each stage, as ``StageMap.pool`` gives them."""

    def __init__(self, peers: dict[int, list[str]]) -> None:
        self.peers = peers

    def pool(self, stage: int) -> list[StageRecord]:
        return [StageRecord(p, ("/ip4/127.0.0.1/tcp/1",), SPEC.name, stage, 0, 1, Capacity(100, 0, 0), 0.0, 30.0)
                for p in self.peers.get(stage, [])]


def partners_of(stage0: list[str], stage1: list[str], tunables: Tunables = Tunables()) -> dict[str, str | None]:
    """Each stage-0 peer's partner, every one of them seeing only the others (not itself) in the map."""
    async def main():
        chosen = {}
        for me in stage0:
            stage_map = StageMapOf({0: [p for p in stage0 if p != me], 1: stage1})
            svc = SwarmService(spec=SPEC, stage=0, me=me, pool=None, stage_map=stage_map, host=None,
                               tunables=tunables)
            svc.upkeep.choose_partner()
            chosen[me] = svc.doc()["router"]["partner"]
        return chosen
    return trio.run(main)


def test_two_by_two_forms_disjoint_chains():
    chosen = partners_of(["B", "A"], ["Y", "X"])
    assert chosen == {"A": "X", "B": "Y"}


def test_the_ablation_switch_turns_affinity_off():
    assert partners_of(["A", "B"], ["X", "Y"], Tunables(affinity=False)) == {"A": None, "B": None}


def test_no_next_stage_peer_means_no_partner():
    assert partners_of(["A"], []) == {"A": None}

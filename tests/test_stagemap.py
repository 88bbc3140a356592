"""StageMap.current: one rebuild at a time, in the background; a caller waits for it at most
its bound (an /api/stages call must answer even when DHT lookups take seconds)."""

from __future__ import annotations

import time

import trio

from p2pswarm.dht.records import UNNAMED_RUN, Capacity, StageRecord
from p2pswarm.dht.stagemap import StageMap
from p2pswarm.model.catalog import get_model

MODEL = get_model("tiny-lm/2")


class SlowIndex:
    """lookup_stage answers only when the test lets it (``release``), and counts the lookups."""

    me = "me"

    def __init__(self) -> None:
        self.lookups = 0
        self.release = trio.Event()
        self.peers = ["first"]
        self.ttl = 60.0
        self.runs: set[str] = set()  # the runs looked up: a stage map asks for its own only

    async def lookup_stage(self, model: str, stage: int, k: int, standing=None, run=UNNAMED_RUN) -> list[StageRecord]:
        self.lookups += 1
        self.runs.add(run)
        await self.release.wait()
        start, end = MODEL.stage_range(stage)
        return [StageRecord(p, (), model, stage, start, end, Capacity(0, 0), time.time(), self.ttl, run)
                for p in self.peers]


def peers(stages: dict) -> set[str]:
    return {r.peer_id for records in stages.values() for r in records}


def test_a_slow_rebuild_does_not_hold_the_caller_and_runs_once():
    async def main():
        index = SlowIndex()
        async with trio.open_nursery() as nursery:
            stage_map = StageMap(index, MODEL, nursery, run="fdd1f91421b0282a")
            assert await stage_map.current(wait=0.05) == {}  # the rebuild is still looking
            assert await stage_map.current(wait=0.05) == {}
            assert index.lookups == MODEL.n_stages  # one rebuild, not one per call
            index.release.set()
            assert peers(await stage_map.current()) == {"first"}  # waits for the running rebuild
            index.peers, index.release = ["second"], trio.Event()
            stage_map.updated_at = 0.0  # stale again
            assert peers(await stage_map.current(wait=0.05)) == {"first"}  # the map it has
            index.release.set()
            assert peers(await stage_map.current()) == {"second"}
            doc = await stage_map.stages_json({})
            assert [p["peer_id"] for p in doc["stages"]["0"]["peers"]] == ["second"]
            assert index.lookups == 2 * MODEL.n_stages
            assert index.runs == {"fdd1f91421b0282a"} and doc["run"] == "fdd1f91421b0282a"  # its own run only

    trio.run(main)


def test_a_record_past_its_ttl_leaves_the_map_while_lookups_hang():
    """A killed peer must drop out when its record expires, even if every later lookup overruns."""
    async def main():
        index = SlowIndex()
        index.ttl = 0.2
        index.release.set()
        async with trio.open_nursery() as nursery:
            stage_map = StageMap(index, MODEL, nursery)
            assert peers(await stage_map.current()) == {"first"}
            assert [r.peer_id for r in stage_map.pool(0)] == ["first"]
            index.release = trio.Event()  # from now on every lookup hangs
            await trio.sleep(0.3)
            assert peers(stage_map.stages) == set()
            assert stage_map.pool(0) == [] and stage_map.records() == {}
            nursery.cancel_scope.cancel()

    trio.run(main)


class MapIndex:
    """lookup_stage answers at once with the records the test put under each stage."""

    me = "me"

    def __init__(self, records: dict[int, list[StageRecord]]) -> None:
        self.records = records

    async def lookup_stage(self, model: str, stage: int, k: int, standing=None, run=UNNAMED_RUN) -> list[StageRecord]:
        return list(self.records.get(stage, []))


def test_the_map_shows_each_stages_health_replicas_and_the_backups_other_stages_hold():
    from p2pswarm.dht.records import BackupClaim

    three = get_model("tiny-lm/3")
    digest = bytes(32)

    def record(peer: str, stage: int, agreed: int | None, backups=()) -> StageRecord:
        start, end = three.stage_range(stage)
        return StageRecord(peer, (), three.name, stage, start, end, Capacity(0, 0), time.time(), 60.0,
                           agreed=None if agreed is None else (agreed, digest),
                           backups=tuple(BackupClaim(s, r, digest) for s, r in backups))

    async def main():
        index = MapIndex({0: [record("a", 0, 7, [(1, 4), (2, 3)]), record("b", 0, 6)],
                          1: [record("c", 1, 4, [(0, 6), (2, 2)])]})
        async with trio.open_nursery() as nursery:
            stage_map = StageMap(index, three, nursery)
            await stage_map.current()
            doc = stage_map.doc()
            nursery.cancel_scope.cancel()
        stages = doc["stages"]
        assert [(stages[s]["health"], stages[s]["replicas"]) for s in "012"] == [
            ("healthy", 2), ("degraded", 1), ("down", 0)]
        assert {p["peer_id"]: p["agreed_round"] for p in stages["0"]["peers"]} == {"a": 7, "b": 6}
        [backup] = stages["0"]["backups"]  # c (stage 1) holds stage 0's round 6: one behind round 7
        assert backup["holder"] == "c" and backup["round"] == 6 and backup["rounds_behind"] == 1
        assert backup["age_s"] >= 0.0  # round 6 was seen agreed (b's record): its age is known
        assert [(b["holder"], b["round"], b["rounds_behind"]) for b in stages["1"]["backups"]] == [("a", 4, 0)]
        # stage 2: no peer, so no round of it was ever seen agreed: rounds behind and age unknown
        assert stages["2"]["backups"] == [{"holder": "a", "round": 3, "rounds_behind": None, "age_s": None},
                                          {"holder": "c", "round": 2, "rounds_behind": None, "age_s": None}]
        assert doc["health"] == {"stages": {"0": "healthy", "1": "degraded", "2": "down"},
                                 "blocked": "stage 2 is down; waiting for a peer to take it"}

    trio.run(main)


def test_a_stage_never_looked_up_is_unknown_not_down():
    async def main():
        async with trio.open_nursery() as nursery:
            stage_map = StageMap(MapIndex({}), MODEL, nursery)
            assert stage_map.doc()["health"] == {"stages": {}, "blocked": None}  # nothing looked up yet
            await stage_map.refresh_stages([0])
            assert stage_map.counts() == {0: 0}
            await stage_map.current()  # a whole map: every stage has a count now
            assert stage_map.counts() == {0: 0, 1: 0}
            assert stage_map.doc()["health"]["blocked"] == "stages 0 and 1 are down; waiting for peers to take them"
            nursery.cancel_scope.cancel()

    trio.run(main)

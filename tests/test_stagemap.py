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

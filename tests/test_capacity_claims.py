"""Capacity claims must not crowd honest peers out of the stage map (issue 13, part 3).

The probe: records of self-made identities claiming 2^32-1 MB free filled all 8 places of every
stage, so a joiner's own ``/api/stages`` listed 8 fakes per stage and not itself. Here 64
identities on one public address (203.0.113.7: nothing answers there) sign a record for every
stage, each claiming all the memory, throughput and idleness the wire allows. The honest swarm is
real: a bootstrap node and two training peers (stages 0 and 1), py-libp2p hosts on loopback in
one trio run. Every DHT store is offered every fake (as if each identity had stored its own); the
honest peers' stores keep their 4 places per address, and the bootstrap node's store is hostile:
it keeps all 64 and serves them first. Over several rebuilds of both peers' stage maps:

* each honest peer is in the top of its stage, in its own view and in the other peer's view;
* the top's vouched entries (peers that answered our round trip) hold no fake, and the top holds
  at most MAX_PER_IP fakes in all;
* a router is offered, and works with, only peers that answered;
* the peers counted as working (what health, stage choice and DiLoCo's invitations read) hold no fake.
"""

from __future__ import annotations

import time

import trio

from p2pswarm.dht.ranking import MAX_PER_IP
from p2pswarm.dht.record_codec import sign_record
from p2pswarm.dht.records import (
    FLAG_GPU,
    FLAG_SNAPSHOT,
    FLAG_TRAINING,
    MAX_FREE_MEMORY_MB,
    MAX_THROUGHPUT,
    MAX_TTL,
    Capacity,
    StageRecord,
    routing_rank,
    stage_key,
)
from p2pswarm.dht.store import MAX_ENTRIES_PER_IP_PER_KEY, RecordStore, StoredRecord
from p2pswarm.identity import generate_identity
from p2pswarm.model.catalog import get_model
from p2pswarm.node.config import DhtMode
from tests.test_discovery import RUN, start_swarm  # the nodes' (default) run: the fakes claim it too

ATTACKER_IP = "203.0.113.7"  # TEST-NET-3: one public address, where no peer answers
FAKES = 64
MODEL = get_model("tiny-lm")
REBUILDS = 2  # rounds of lookups of every checked stage watched once the swarm has settled
SETTLE_TIMEOUT = 25.0  # seconds for the honest peers to find and vouch for each other


class HostileStore(RecordStore):
    """A careless or hostile DHT store: keeps every record it is given, serves the biggest claims first."""

    def __init__(self) -> None:
        super().__init__(max_entries_per_ip_per_key=FAKES, max_entries_per_ip=FAKES * MODEL.n_stages)

    def get(self, key: bytes, now: float) -> list[StoredRecord]:
        return sorted(super().get(key, now), key=lambda stored: routing_rank(stored.record))


def fake_records(now: float) -> list[StoredRecord]:
    """Every fake identity's signed record for every stage, claiming everything the wire allows."""
    made = []
    for i in range(FAKES):
        identity = generate_identity()
        for stage in range(MODEL.n_stages):
            start, end = MODEL.stage_range(stage)
            record = StageRecord(identity.peer_id_text, (f"/ip4/{ATTACKER_IP}/tcp/{4001 + i}",), MODEL.name, stage,
                                 start, end, Capacity(MAX_FREE_MEMORY_MB, 0, FLAG_TRAINING | FLAG_GPU | FLAG_SNAPSHOT,
                                                      MAX_THROUGHPUT), now, MAX_TTL, RUN)
            made.append(StoredRecord(record, sign_record(record, identity), ATTACKER_IP))
    return made


def offer_fakes(node, fakes: list[StoredRecord], rotate: int) -> int:
    """Offer every fake to ``node``'s store, each store in another order; count the accepted."""
    order = fakes[rotate:] + fakes[:rotate]
    return sum(node.index.store.put(stage_key(MODEL.name, s.record.stage, RUN), s, time.time()) for s in order)


class Watch:
    """What the two honest peers show, checked on every look."""

    def __init__(self, first, second, fakes: set[str]) -> None:
        self.nodes, self.fakes = (first, second), fakes
        self.ids = {node.identity.peer_id_text: node.stage for node in self.nodes}
        self.fakes_seen = 0  # fakes in the pools the peers check: the attack did reach them

    def settled(self) -> bool:
        """Each peer lists both honest peers at their stages, and has heard from the other."""
        return all(peer in {r.peer_id for r in node.stage_map.stages.get(stage, [])}
                   for node in self.nodes for peer, stage in self.ids.items()) and \
            all(node.stage_map.book.has_answered(peer, time.time())
                for node in self.nodes for peer in self.ids if peer != node.identity.peer_id_text)

    def check(self) -> None:
        now = time.time()
        for node in self.nodes:
            view = node.stage_map.stages
            pools = [node.stage_map.pool(stage) for stage in view]
            self.fakes_seen += sum(len(self.fakes.intersection(r.peer_id for r in records)) for records in pools)
            for peer, stage in self.ids.items():  # own view and the other peer's view
                top = [r.peer_id for r in view.get(stage, [])]
                assert peer in top, f"{peer} missing from its stage {stage} as {node.identity.peer_id_text} sees it"
                assert len(self.fakes.intersection(top)) <= MAX_PER_IP, top
                vouched = [p for p in top if node.stage_map.book.has_answered(p, now)]
                assert not self.fakes.intersection(vouched)
            counted = {peer for peers in node.stage_map.workers().values() for peer in peers}
            assert counted <= set(self.ids) and node.identity.peer_id_text in counted  # work, never a claim
            stage_doc = node.stage_map.doc()["stages"][str(node.stage)]["peers"]
            assert node.identity.peer_id_text in {p["peer_id"] for p in stage_doc}  # /api/stages lists us
            next_stage = node.stage + 1
            offered = {r.peer_id for r in node.stage_map.candidates(next_stage)}
            assert offered <= set(self.ids) and all(node.stage_map.book.has_answered(p, now) for p in offered)
            assert set(node.swarm.router.peers) <= set(self.ids)  # the router never even knew a fake
            assert set(node.swarm.router.choose(next_stage, now)) <= offered | set(self.ids)


def test_64_identities_on_one_address_claiming_everything_crowd_out_no_honest_peer():
    async def main():
        fakes = fake_records(time.time())
        async with trio.open_nursery() as nursery:
            boot, (first, second) = await start_swarm(nursery, [(0, 2), (2, 4)], DhtMode.SERVER)
            boot.index.store = HostileStore()  # the honest peers re-announce to it within ANNOUNCE_PERIOD
            assert offer_fakes(boot, fakes, 0) == len(fakes)
            for rotate, node in enumerate((first, second), start=1):
                accepted = offer_fakes(node, fakes, rotate * MAX_ENTRIES_PER_IP_PER_KEY * MODEL.n_stages)
                assert accepted == MAX_ENTRIES_PER_IP_PER_KEY * MODEL.n_stages
            watch = Watch(first, second, {s.record.peer_id for s in fakes})
            with trio.fail_after(SETTLE_TIMEOUT):
                while not watch.settled():
                    await trio.sleep(0.2)
            lookups = [node.index.stats.lookups for node in (first, second)]
            rounds = [REBUILDS * len(range(max(0, node.stage - 1), min(MODEL.n_stages, node.stage + 2)))
                      for node in (first, second)]
            with trio.fail_after(SETTLE_TIMEOUT):
                while any(n.index.stats.lookups - before < want for n, before, want in
                          zip((first, second), lookups, rounds)):
                    watch.check()
                    await trio.sleep(0.2)
                for node in (first, second):  # a full rebuild, every stage, as /api/stages does it
                    await node.stage_map.refresh()
                    watch.check()
            assert watch.fakes_seen > 0
            assert second.identity.peer_id_text in first.swarm.router.peers  # the router was fed all along
            nursery.cancel_scope.cancel()

    trio.run(main)

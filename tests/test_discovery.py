"""Stage discovery between real nodes (py-libp2p hosts on loopback) in one trio loop."""

from __future__ import annotations

import dataclasses
import time

import trio

import p2pswarm.dht.discovery as discovery
import p2pswarm.dht.holds as holds
import p2pswarm.dht.records as records_module
from p2pswarm.dht.record_codec import sign_record
from p2pswarm.dht.records import Capacity, StageRecord, stage_key
from p2pswarm.dht.store import StoredRecord
from p2pswarm.identity import generate_identity
from p2pswarm.node.config import DhtMode, NodeConfig, Role
from p2pswarm.node.running import run_node
from p2pswarm.run.spec import default_run

LOOPBACK = ("/ip4/127.0.0.1/tcp/0",)

RUN = default_run().identity  # what nodes started without a run train: their records live under its keys


async def start_swarm(nursery, layer_ranges, dht_mode: DhtMode = DhtMode.AUTO, rng=None):
    addrs = []
    boot = await nursery.start(lambda task_status: run_node(
        NodeConfig(role=Role.BOOTSTRAP, listen=LOOPBACK), on_listening=addrs.extend, task_status=task_status))
    nodes = []
    for layers in layer_ranges:
        nodes.append(await nursery.start(lambda task_status, layers=layers: run_node(
            NodeConfig(role=Role.JOIN, listen=LOOPBACK, bootstrap=(addrs[0],), layers=layers, dht_mode=dht_mode),
            rng=rng, task_status=task_status)))
    return boot, nodes


def test_lookup_finds_every_server_and_ignores_forgeries():
    async def main():
        async with trio.open_nursery() as nursery:
            boot, nodes = await start_swarm(nursery, [(0, 2), (0, 2), (2, 4)])
            with trio.fail_after(20):
                while {r.peer_id for r in await nodes[2].index.lookup_stage("tiny-lm", 0, run=RUN)} != {
                        n.identity.peer_id_text for n in nodes[:2]}:
                    await trio.sleep(0.2)
            # Mallory signs a record and relabels it as the victim's; every storing node is
            # made to hold it (as a careless or hostile store might), yet no reader accepts it.
            mallory, victim = generate_identity(), nodes[0].identity
            record = StageRecord(peer_id=mallory.peer_id_text, addrs=(), model="tiny-lm", stage=2, start=4, end=6,
                                 capacity=Capacity(0, 0), timestamp=time.time(), ttl=60, run=RUN)
            forged = sign_record(record, mallory).replace(mallory.peer_id_text.encode(), victim.peer_id_text.encode())
            relabelled = dataclasses.replace(record, peer_id=victim.peer_id_text)
            for node in [boot, *nodes]:
                assert node.index.store.put(stage_key("tiny-lm", 2, RUN), StoredRecord(relabelled, forged), time.time())
            before = nodes[1].index.stats.invalid_records
            assert await nodes[1].index.lookup_stage("tiny-lm", 2, run=RUN) == []
            assert nodes[1].index.stats.invalid_records > before
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_routing_upkeep_rejoins_an_isolated_node(monkeypatch):
    monkeypatch.setattr(discovery, "ROUTING_CHECK_PERIOD", 0.3)

    async def main():
        async with trio.open_nursery() as nursery:
            # servers from the start: this is about the upkeep, not about waiting for PUBLIC
            _boot, nodes = await start_swarm(nursery, [(0, 2), (2, 4), (4, 6)], DhtMode.SERVER)
            table = nodes[0].kad.routing_table
            for peer in table.get_peer_ids():
                table.remove_peer(peer)
            assert nodes[0].kad.get_routing_table_size() == 0
            with trio.fail_after(10):
                while nodes[0].kad.get_routing_table_size() < discovery.MIN_ROUTING_PEERS:
                    await trio.sleep(0.1)
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_record_keeps_circuit_addresses_even_with_many_interfaces():
    from p2pswarm.dht.announce import MAX_RECORD_ADDRS, record_addrs

    listen = [f"/ip4/10.0.{i}.2/tcp/4001/p2p/12D3KooWself" for i in range(12)]
    circuits = ["/ip4/203.0.113.5/tcp/4001/p2p/12D3KooWrelay/p2p-circuit/p2p/12D3KooWself"]
    chosen = record_addrs(listen + circuits)
    assert len(chosen) == MAX_RECORD_ADDRS and chosen[0] == circuits[0]
    assert record_addrs(listen[:3]) == tuple(listen[:3])  # order kept otherwise


def test_record_puts_dial_back_confirmed_addresses_first():
    from p2pswarm.dht.announce import record_addrs

    listen = [f"/ip4/10.0.{i}.2/tcp/4001/p2p/12D3KooWself" for i in range(3)]
    forwarded = "/ip4/203.0.113.9/tcp/4001/p2p/12D3KooWself"  # a DMZ router's address, confirmed
    circuit = "/ip4/203.0.113.5/tcp/4001/p2p/12D3KooWrelay/p2p-circuit/p2p/12D3KooWself"
    chosen = record_addrs([*listen, circuit, forwarded], public=("/ip4/203.0.113.9/tcp/4001",))
    assert chosen == (forwarded, circuit, *listen)


def test_a_peer_can_store_only_its_own_record_over_a_real_connection():
    """The attack review: one connection stored 3,000 validly signed records of 3,000 made-up
    identities. Now the keeper refuses every record its sender is not, and keeps the sender's own."""
    from p2pswarm.dht.protocol import StoreRecord
    from p2pswarm.net.control import ControlService
    from p2pswarm.net.host import connect, open_host, peer_info_from_multiaddr
    from p2pswarm.wire import ErrorReply

    async def main():
        async with trio.open_nursery() as nursery:
            boot, _ = await start_swarm(nursery, [])
            attacker = generate_identity()
            async with open_host(attacker, LOOPBACK) as host, trio.open_nursery() as inner:
                control = ControlService(host, inner)
                await connect(host, peer_info_from_multiaddr(boot.addrs()[0]))

                def record_of(identity):
                    return StageRecord(peer_id=identity.peer_id_text, addrs=(), model="tiny-lm", stage=0, start=0,
                                       end=2, capacity=Capacity(0, 0), timestamp=time.time(), ttl=60)

                for _ in range(20):
                    fake = generate_identity()
                    reply = await control.request(boot.host.get_id(),
                                                  StoreRecord(record=sign_record(record_of(fake), fake)))
                    assert isinstance(reply, ErrorReply) and reply.code == "rejected" and "only its own" in reply.detail
                own = await control.request(boot.host.get_id(),
                                            StoreRecord(record=sign_record(record_of(attacker), attacker)))
                assert own.accepted
                held = boot.index.store.get(stage_key("tiny-lm", 0), time.time())
                assert [s.record.peer_id for s in held] == [attacker.peer_id_text]
                assert held[0].source_ip == "127.0.0.1"
                inner.cancel_scope.cancel()
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_announced_records_carry_the_stage_and_live_capacity():
    async def main():
        async with trio.open_nursery() as nursery:
            boot, nodes = await start_swarm(nursery, [(2, 4)])
            nodes[0].load_sources.append(lambda: 7)
            with trio.fail_after(20):
                while True:
                    records = await boot.index.lookup_stage("tiny-lm", 1, run=RUN)
                    if records and records[0].capacity.queue_depth == 7:
                        break
                    await trio.sleep(0.2)
            record = records[0]
            assert (record.stage, record.start, record.end) == (1, 2, 4)
            assert record.capacity.flags & records_module.FLAG_TRAINING
            assert record.capacity.free_memory_mb > 0
            stats = nodes[0].stats()  # each service's own stats reach /api/stats
            assert stats["stage"] == 1 and stats["streams"]["admitted"] > 0 and "budget" in stats["pool"]
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_a_peer_that_failed_a_request_is_not_asked_again_for_a_while():
    """DHT traffic dials directly; a peer that could not be reached (e.g. behind a symmetric NAT,
    offered by another server's answer) must not be picked again at once: each try costs a
    lookup its whole timeout (seen in the NAT lab: a stage map that never caught up). The hold
    doubles with each failure in a row (``dht.holds``)."""
    from p2pswarm.errors import DialError

    async def main():
        async with trio.open_nursery() as nursery:
            boot, (node,) = await start_swarm(nursery, [(0, 2)], DhtMode.SERVER)
            index, peer = node.index, boot.host.get_id()
            now = [time.time()]
            index._clock = lambda: now[0]
            assert index._may_hold_records(peer)
            index._forget(peer, DialError("unreachable"))
            assert not index._may_hold_records(peer)
            assert peer not in await index.closest_peers(b"k" * 32, 5)
            now[0] += holds.FIRST_FAILURE_HOLD
            assert index._may_hold_records(peer)
            index._forget(peer, DialError("unreachable again"))  # a second failure in a row: held twice as long
            now[0] += holds.FIRST_FAILURE_HOLD
            assert not index._may_hold_records(peer)
            now[0] += holds.FIRST_FAILURE_HOLD
            assert index._may_hold_records(peer)
            nursery.cancel_scope.cancel()

    trio.run(main)

"""Layer discovery between real nodes (py-libp2p hosts on loopback) in one trio loop."""

from __future__ import annotations

import dataclasses
import time

import trio

import p2pswarm.dht.discovery as discovery
from p2pswarm.config import DhtMode, NodeConfig, Role
from p2pswarm.dht.records import Capacity, LayerRecord, layer_key, sign_record
from p2pswarm.dht.store import StoredRecord
from p2pswarm.identity import generate_identity
from p2pswarm.node import run_node

LOOPBACK = ("/ip4/127.0.0.1/tcp/0",)


async def start_swarm(nursery, layer_ranges, dht_mode: DhtMode = DhtMode.AUTO):
    addrs = []
    boot = await nursery.start(lambda task_status: run_node(
        NodeConfig(role=Role.BOOTSTRAP, listen=LOOPBACK), on_listening=addrs.extend, task_status=task_status))
    nodes = []
    for layers in layer_ranges:
        nodes.append(await nursery.start(lambda task_status, layers=layers: run_node(
            NodeConfig(role=Role.JOIN, listen=LOOPBACK, bootstrap=(addrs[0],), layers=layers, dht_mode=dht_mode),
            task_status=task_status)))
    return boot, nodes


def test_lookup_finds_every_server_and_ignores_forgeries():
    async def main():
        async with trio.open_nursery() as nursery:
            boot, nodes = await start_swarm(nursery, [(0, 2), (0, 4), (2, 4)])
            with trio.fail_after(20):
                while {r.peer_id for r in await nodes[2].index.lookup_layer("tiny-lm", 1)} != {
                        n.identity.peer_id_text for n in nodes[:2]}:
                    await trio.sleep(0.2)
            # Mallory signs a record and relabels it as the victim's; every storing node is
            # made to hold it (as a careless or hostile store might), yet no reader accepts it.
            mallory, victim = generate_identity(), nodes[0].identity
            record = LayerRecord(peer_id=mallory.peer_id_text, addrs=(), model="tiny-lm", start=0, end=8,
                                 capacity=Capacity(0, 0), timestamp=time.time(), ttl=60)
            forged = sign_record(record, mallory).replace(mallory.peer_id_text.encode(), victim.peer_id_text.encode())
            relabelled = dataclasses.replace(record, peer_id=victim.peer_id_text)
            for node in [boot, *nodes]:
                assert node.index.store.put(layer_key("tiny-lm", 5), StoredRecord(relabelled, forged), time.time())
            before = nodes[1].index.stats.invalid_records
            assert await nodes[1].index.lookup_layer("tiny-lm", 5) == []
            assert nodes[1].index.stats.invalid_records > before
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_routing_upkeep_rejoins_an_isolated_node(monkeypatch):
    monkeypatch.setattr(discovery, "ROUTING_CHECK_PERIOD", 0.3)

    async def main():
        async with trio.open_nursery() as nursery:
            # servers from the start: this is about the upkeep, not about waiting for PUBLIC
            boot, nodes = await start_swarm(nursery, [(0, 2), (2, 4), (4, 6)], DhtMode.SERVER)
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
    from p2pswarm.node import MAX_RECORD_ADDRS, record_addrs

    listen = [f"/ip4/10.0.{i}.2/tcp/4001/p2p/12D3KooWself" for i in range(12)]
    circuits = ["/ip4/203.0.113.5/tcp/4001/p2p/12D3KooWrelay/p2p-circuit/p2p/12D3KooWself"]
    chosen = record_addrs(listen + circuits)
    assert len(chosen) == MAX_RECORD_ADDRS and chosen[0] == circuits[0]
    assert record_addrs(listen[:3]) == tuple(listen[:3])  # order kept otherwise


def test_record_puts_dial_back_confirmed_addresses_first():
    from p2pswarm.node import record_addrs

    listen = [f"/ip4/10.0.{i}.2/tcp/4001/p2p/12D3KooWself" for i in range(3)]
    forwarded = "/ip4/203.0.113.9/tcp/4001/p2p/12D3KooWself"  # a DMZ router's address, confirmed
    circuit = "/ip4/203.0.113.5/tcp/4001/p2p/12D3KooWrelay/p2p-circuit/p2p/12D3KooWself"
    chosen = record_addrs([*listen, circuit, forwarded], public=("/ip4/203.0.113.9/tcp/4001",))
    assert chosen == (forwarded, circuit, *listen)

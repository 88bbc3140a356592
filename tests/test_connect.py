"""connect(): real hosts on loopback — direct first, relay when direct fails, and the upgrade of a
relayed connection to a direct one driven by the side that received it (DCUtR step 0)."""

from __future__ import annotations

import random

import pytest
import trio

from p2pswarm import wire
from p2pswarm.errors import DialError
from p2pswarm.identity import generate_identity
from p2pswarm.nat.holepunch import HolePunchService
from p2pswarm.nat.relay_client import RelayPicker, serve_relay_reservations
from p2pswarm.nat.relay_service import RelayConfig, serve_relay
from p2pswarm.net import probe
from p2pswarm.net.connect import Connector, connections_to, has_direct, is_inbound, is_relayed
from p2pswarm.net.control import ControlService
from p2pswarm.net.host import open_host, set_extra_addrs

pytestmark = pytest.mark.timeout(90)

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


async def _run_holepunch(host, task_status=trio.TASK_STATUS_IGNORED):
    from libp2p.tools.anyio_service import background_trio_service

    service = HolePunchService(host)
    async with background_trio_service(service):
        await service.event_started.wait()
        task_status.started(service)
        await trio.sleep_forever()


async def _relay(task_status=trio.TASK_STATUS_IGNORED):
    async with open_host(generate_identity(), LOOPBACK) as host, trio.open_nursery() as nursery:
        await nursery.start(serve_relay, host, RelayConfig())
        task_status.started(str(host.get_addrs()[0]))
        await trio.sleep_forever()


class Peer:
    """A host with the node's connect, control, probe and DCUtR services."""

    def __init__(self, host, nursery):
        self.host = host
        self.connector = Connector(host, nursery)
        self.control = ControlService(host, nursery, self.connector)
        probe.register(host, self.control)
        self.punch: HolePunchService | None = None

    @property
    def id(self) -> str:
        return str(self.host.get_id())


async def _reserve(peer: Peer, relay_addr: str, nursery) -> str:
    picker = RelayPicker(random.Random(1))
    picker.add_candidate(relay_addr.rsplit("/p2p/", 1)[1], [relay_addr])
    await nursery.start(lambda task_status: serve_relay_reservations(
        peer.host, picker, lambda addrs: set_extra_addrs(peer.host, addrs), tick=0.2, task_status=task_status))
    with trio.fail_after(10):
        while not picker.held:
            await trio.sleep(0.05)
    return f"{relay_addr}/p2p-circuit"


def test_relayed_connection_is_upgraded_by_the_receiving_side_only():
    async def main():
        async with trio.open_nursery() as nursery:
            relay_addr = await nursery.start(_relay)
            async with open_host(generate_identity(), LOOPBACK) as host_a, \
                    open_host(generate_identity(), LOOPBACK) as host_b:
                a, b = Peer(host_a, nursery), Peer(host_b, nursery)
                a.punch = await nursery.start(_run_holepunch, host_a)
                b.punch = await nursery.start(_run_holepunch, host_b)
                circuit = await _reserve(b, relay_addr, nursery)

                # only the circuit is offered: A reaches B through the relay
                assert await a.connector.connect(b.id, [circuit]) == "relay"
                conns_b = connections_to(host_b, host_a.get_id())
                assert [is_relayed(c) for c in conns_b] == [True] and is_inbound(conns_b[0])
                assert await a.control.request(b.id, wire.Ping(nonce=1)) == wire.Pong(nonce=1)

                # B received the relayed connection, so B (and only B) upgrades it; A is dialable
                with trio.fail_after(15):
                    while not (has_direct(host_a, host_b.get_id())
                               and a.connector.stats.methods["holepunch"].successes):
                        await trio.sleep(0.05)
                    while b.punch.book.outcomes["unilateral"] == 0:
                        await trio.sleep(0.05)
                assert b.punch.book.summary()["attempts"] == 1 and a.punch.book.summary()["attempts"] == 0
                assert a.punch.book.refused == b.punch.book.refused == 0
                # the control channel moves to the direct connection; the relayed one stays as a fallback
                assert await a.control.request(b.id, wire.Ping(nonce=2)) == wire.Pong(nonce=2)
                assert sorted(is_relayed(c) for c in connections_to(host_a, host_b.get_id())) == [False, True]
                stats = a.connector.stats.summary()
                assert stats["relay"]["successes"] == 1 and stats["holepunch"]["successes"] == 1, stats
                result = await probe.probe(host_a, a.connector, a.control, b.id, nbytes=300_000)
                assert result.method == "connected" and result.path == "direct" and result.bytes == 300_000
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_direct_wins_when_it_works_and_relay_refusal_is_a_clean_dial_error():
    async def main():
        async with trio.open_nursery() as nursery:
            relay_addr = await nursery.start(_relay)
            async with open_host(generate_identity(), LOOPBACK) as host_a, \
                    open_host(generate_identity(), LOOPBACK) as host_b:
                a, b = Peer(host_a, nursery), Peer(host_b, nursery)
                direct = str(host_b.get_addrs()[0])
                # B holds no reservation: the relay answers NO_RESERVATION
                with pytest.raises(DialError, match="NO_RESERVATION"):
                    await a.connector.connect(b.id, [f"{relay_addr}/p2p-circuit"])
                # with both, the direct dial wins inside the relay's head start
                assert await a.connector.connect(b.id, [direct, f"{relay_addr}/p2p-circuit"]) == "direct"
                assert await a.connector.connect(b.id) == "connected"
                stats = a.connector.stats.summary()
                assert stats["direct"]["successes"] == 1 and stats["relay"] == {
                    "attempts": 1, "successes": 0, "failures": 1, "p50_ms": None, "p95_ms": None}
                assert stats["reused"] == 1
                with pytest.raises(DialError, match="no dialable address"):
                    await a.connector.connect(str(generate_identity().peer_id_text), ["/ip4/0.0.0.0/tcp/1"])
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_a_relayed_dial_carries_the_relays_circuit_limit():
    """The stream pool accounts a circuit against what its relay allows; the dialer learns that
    from the relay's STATUS reply (the Limit field), not from a guess."""
    from p2pswarm.net.budget import CircuitLimit
    from p2pswarm.net.connect import dial_via_relay

    async def small_relay(task_status=trio.TASK_STATUS_IGNORED):
        async with open_host(generate_identity(), LOOPBACK) as host, trio.open_nursery() as inner:
            await inner.start(serve_relay, host, RelayConfig(circuit_bytes=3 * 1024 * 1024, circuit_duration=45))
            task_status.started(str(host.get_addrs()[0]))
            await trio.sleep_forever()

    async def main():
        async with trio.open_nursery() as nursery:
            relay_addr = await nursery.start(small_relay)
            async with open_host(generate_identity(), LOOPBACK) as host_a, \
                    open_host(generate_identity(), LOOPBACK) as host_b:
                b = Peer(host_b, nursery)
                circuit = await _reserve(b, relay_addr, nursery)
                conn = await dial_via_relay(host_a, circuit, host_b.get_id())
                assert conn.p2pswarm_circuit_limit == CircuitLimit(seconds=45.0, bytes=3 * 1024 * 1024)
            nursery.cancel_scope.cancel()

    trio.run(main)

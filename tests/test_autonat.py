"""Dial-back reachability checks between real hosts on loopback."""

from __future__ import annotations

import random
import socket

import trio
from hypothesis import given
from hypothesis import strategies as st

from p2pswarm import wire
from p2pswarm.identity import generate_identity
from p2pswarm.nat.autonat import (
    AUTONAT_PROTOCOL,
    PER_PEER_BURST,
    STATUS_DIAL_ERROR,
    STATUS_OK,
    STATUS_RATE_LIMITED,
    AutonatService,
    DialRequest,
    DialResponse,
    dial_target,
)
from p2pswarm.net.host import connect, open_host, peer_info_from_multiaddr
from p2pswarm.net.streams import open_stream

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


def test_dial_target_only_ever_dials_the_observed_ip():
    addrs = ("/ip4/203.0.113.9/tcp/4001", "/ip4/10.0.0.2/tcp/4002")
    assert dial_target(addrs, "198.51.100.7") == "/ip4/198.51.100.7/tcp/4001"
    assert dial_target(("/ip4/1.2.3.4/udp/9/quic-v1", "/dns4/x/tcp/5"), "198.51.100.7") is None
    assert dial_target(("/ip4/1.2.3.4/tcp/0",), "198.51.100.7") is None


@given(st.lists(st.text(max_size=40), max_size=20), st.ip_addresses(v=4).map(str))
def test_dial_target_is_total_and_guarded(addrs, observed):
    target = dial_target(tuple(addrs), observed)
    assert target is None or target.startswith(f"/ip4/{observed}/tcp/")


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


async def ask(client, server_id, addrs: tuple[str, ...], nonce: int = 7) -> DialResponse:
    stream = await open_stream(client, server_id, AUTONAT_PROTOCOL)
    await wire.write_frame(stream, DialRequest(addrs=addrs, nonce=nonce))
    reply, _ = await wire.read_frame(stream, max_payload=0)
    await stream.close()
    return reply


def with_server_and_client(test):
    async def main():
        async with (open_host(generate_identity(), LOOPBACK) as server,
                    open_host(generate_identity(), LOOPBACK) as client):
            async with trio.open_nursery() as nursery:
                services = []
                for host in (server, client):
                    service = AutonatService(host, nursery, random.Random(1))
                    await nursery.start(service.serve_dialer)
                    services.append(service)
                await connect(client, peer_info_from_multiaddr(str(server.get_addrs()[0])))
                await test(server, client, *services)
                nursery.cancel_scope.cancel()

    trio.run(main)


def test_reachable_client_is_confirmed_with_its_nonce():
    async def test(server, client, server_service, client_service):
        result = await client_service.check(server.get_id())
        assert result is not None and result.reachable
        assert result.address == str(client.get_addrs()[0]).rsplit("/p2p/", 1)[0]

    with_server_and_client(test)


def test_closed_port_is_unreachable_despite_the_open_connection():
    """py-libp2p's AutoNAT v1 would answer over the existing connection and say PUBLIC."""
    async def test(server, client, server_service, client_service):
        assert server.get_id() in client.get_connected_peers()
        reply = await ask(client, server.get_id(), (f"/ip4/127.0.0.1/tcp/{closed_port()}",))
        assert reply.status == STATUS_DIAL_ERROR

    with_server_and_client(test)


def test_a_listener_that_does_not_know_the_nonce_is_not_confirmed():
    """The dial-back reaches the client's listener, but the client never asked: no ack, no OK."""
    async def test(server, client, server_service, client_service):
        client_addr = str(client.get_addrs()[0]).rsplit("/p2p/", 1)[0]
        reply = await ask(client, server.get_id(), (client_addr,), nonce=12345)
        assert reply.status == STATUS_DIAL_ERROR and reply.status != STATUS_OK

    with_server_and_client(test)


def test_requests_are_rate_limited_per_peer():
    async def test(server, client, server_service, client_service):
        statuses = [(await ask(client, server.get_id(), (f"/ip4/127.0.0.1/tcp/{closed_port()}",))).status
                    for _ in range(PER_PEER_BURST + 1)]
        assert statuses[-1] == STATUS_RATE_LIMITED
        assert STATUS_RATE_LIMITED not in statuses[:PER_PEER_BURST]

    with_server_and_client(test)

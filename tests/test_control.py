"""The control channel between two real libp2p hosts on loopback."""

from __future__ import annotations

import struct

import pytest
import trio

from p2pswarm import wire
from p2pswarm.errors import DialError
from p2pswarm.identity import generate_identity
from p2pswarm.net.control import CONTROL_PROTOCOL, ControlService
from p2pswarm.net.host import connect, open_host, peer_info_from_multiaddr
from p2pswarm.net.streams import open_stream

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


async def pong(peer: str, message: wire.Ping) -> wire.Pong:
    return wire.Pong(nonce=message.nonce + 1)


def with_pair(test):
    """Run ``test(client_host, client_control, server_host, server_control)`` on two connected hosts."""

    async def main():
        async with open_host(generate_identity(), LOOPBACK) as server, open_host(generate_identity(), LOOPBACK) as client:
            async with trio.open_nursery() as nursery:
                server_control, client_control = ControlService(server, nursery), ControlService(client, nursery)
                await connect(client, peer_info_from_multiaddr(str(server.get_addrs()[0])))
                await test(client, client_control, server, server_control)
                nursery.cancel_scope.cancel()

    trio.run(main)


def test_requests_are_answered_in_order_over_one_stream():
    async def test(client, control, server, server_control):
        server_control.handle(wire.Ping, pong)
        replies = {}

        async def ask(n):
            replies[n] = await control.request(server.get_id(), wire.Ping(nonce=n))

        async with trio.open_nursery() as nursery:
            for n in range(50):
                nursery.start_soon(ask, n)
        assert replies == {n: wire.Pong(nonce=n + 1) for n in range(50)}
        assert server_control.stats.requests_served == 50
        assert len(control._channels) == 1  # one long-lived stream carried all fifty

    with_pair(test)


def test_unhandled_message_gets_an_error_reply():
    async def test(client, control, server, server_control):
        reply = await control.request(server.get_id(), wire.Ping(nonce=1))
        assert isinstance(reply, wire.ErrorReply) and reply.code == "unsupported"

    with_pair(test)


def test_failing_handler_does_not_take_the_node_down():
    async def broken(peer, message):
        raise ValueError("bug")

    async def test(client, control, server, server_control):
        server_control.handle(wire.Ping, broken)
        reply = await control.request(server.get_id(), wire.Ping(nonce=1))
        assert reply == wire.ErrorReply(code="internal", detail="handler failed")
        server_control.handle(wire.Ping, pong)
        assert await control.request(server.get_id(), wire.Ping(nonce=2)) == wire.Pong(nonce=3)

    with_pair(test)


@pytest.mark.parametrize("garbage", [b"\x00\x00\x00\x03abc", struct.pack(">I", 1 << 30), b"\xff" * 64])
def test_garbage_resets_the_stream_and_the_server_keeps_serving(garbage):
    async def test(client, control, server, server_control):
        server_control.handle(wire.Ping, pong)
        raw = await open_stream(client, server.get_id(), CONTROL_PROTOCOL)
        await raw.write(garbage)
        with trio.fail_after(5):
            assert await raw.read(100) == b""  # reset by the server
        assert server_control.stats.peers_dropped == 1
        assert await control.request(server.get_id(), wire.Ping(nonce=7)) == wire.Pong(nonce=8)

    with_pair(test)


def test_silent_peer_times_out_with_dial_error():
    async def never(peer, message):
        await trio.sleep_forever()

    async def test(client, control, server, server_control):
        server_control.handle(wire.Ping, never)
        with pytest.raises(DialError, match="no reply"):
            await control.request(server.get_id(), wire.Ping(nonce=1), timeout=0.5)
        assert control.stats.requests_failed == 1

    with_pair(test)

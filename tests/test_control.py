"""The control channel between two real libp2p hosts on loopback."""

from __future__ import annotations

import struct

import pytest
import trio

from p2pswarm import wire
from p2pswarm.errors import DialError
from p2pswarm.identity import generate_identity
from p2pswarm.net import control as control_module
from p2pswarm.net.control import CONTROL_PROTOCOL, HANDLER_TIMEOUT, REQUEST_TIMEOUT, ControlService
from p2pswarm.net.guard import guard_stats, set_protocol_limits
from p2pswarm.net.host import connect, open_host, peer_info_from_multiaddr
from p2pswarm.net.limits import ProtocolLimits
from p2pswarm.net.streams import open_stream

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


async def pong(peer: str, message: wire.Ping) -> wire.Pong:
    return wire.Pong(nonce=message.nonce + 1)


def with_pair(test, handler_timeout: float = HANDLER_TIMEOUT):
    """Run ``test(client_host, client_control, server_host, server_control)`` on two connected hosts; the
    server cuts its handlers at ``handler_timeout``."""

    async def main():
        async with (open_host(generate_identity(), LOOPBACK) as server,
                    open_host(generate_identity(), LOOPBACK) as client):
            async with trio.open_nursery() as nursery:
                server_control = ControlService(server, nursery, handler_timeout=handler_timeout)
                client_control = ControlService(client, nursery)
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


async def trickle(raw, data: bytes, gap: float) -> bool:
    """Write ``data`` one byte every ``gap`` seconds; whether the peer reset the stream before the end."""
    for byte in data:
        try:
            await raw.write(bytes([byte]))
        except Exception:  # reset under us
            return True
        await trio.sleep(gap)
    return False


def test_a_request_trickled_a_byte_at_a_time_is_cut_at_the_request_deadline(monkeypatch):
    """Slowloris: a byte now and then kept a stream (and its slot) past every deadline; now a request
    that began must come whole within REQUEST_TIMEOUT, while waiting for one stays idle time."""
    monkeypatch.setattr(control_module, "REQUEST_TIMEOUT", 1.0)  # the server's read deadline, short here

    async def test(client, control, server, server_control):
        server_control.handle(wire.Ping, pong)
        frame = wire.encode_frame(wire.Ping(nonce=1))
        raw = await open_stream(client, server.get_id(), CONTROL_PROTOCOL)
        await trio.sleep(1.5)  # an idle stream is not cut by the request deadline
        with trio.fail_after(10):
            cut = await trickle(raw, frame[:-1], gap=0.2)
            assert await raw.read(100) == b""  # reset by the server
        assert cut  # cut before the trickle ended
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


async def never(peer, message):
    await trio.sleep_forever()


SHORT_HANDLER_TIMEOUT = 1.0  # the server's handler deadline where a test waits one out: a quarter of HANDLER_TIMEOUT


def test_a_handler_past_its_deadline_gets_a_timeout_reply_and_the_stream_goes_on():
    """Issue 7, item 1 (server side): a stalled handler no longer stalls the peer's FIFO channel."""
    assert HANDLER_TIMEOUT < REQUEST_TIMEOUT and SHORT_HANDLER_TIMEOUT < REQUEST_TIMEOUT

    async def test(client, control, server, server_control):
        server_control.handle(wire.Pong, never)
        server_control.handle(wire.Ping, pong)
        reply = await control.request(server.get_id(), wire.Pong(nonce=1))  # the default timeout
        assert isinstance(reply, wire.ErrorReply) and reply.code == "timeout"
        channel = control._channels[str(server.get_id())]
        assert await control.request(server.get_id(), wire.Ping(nonce=2)) == wire.Pong(nonce=3)
        assert control._channels[str(server.get_id())] is channel and not channel.closed
        assert server_control.stats.handler_timeouts == 1

    with_pair(test, SHORT_HANDLER_TIMEOUT)


def test_a_request_timeout_retires_the_channel_so_the_next_request_is_answered():
    """Issue 7, item 1 (client side): the next request goes on a fresh stream, not behind the stuck one."""

    async def test(client, control, server, server_control):
        server_control.handle(wire.Pong, never)
        server_control.handle(wire.Ping, pong)
        with pytest.raises(DialError, match="no reply"):
            await control.request(server.get_id(), wire.Pong(nonce=1), timeout=0.5)
        stuck = control._channels[str(server.get_id())]
        # Well inside HANDLER_TIMEOUT: only a fresh stream can answer this in time.
        assert await control.request(server.get_id(), wire.Ping(nonce=2),
                                     timeout=HANDLER_TIMEOUT / 2) == wire.Pong(nonce=3)
        assert control._channels[str(server.get_id())] is not stuck
        with trio.fail_after(REQUEST_TIMEOUT + 5):
            await stuck.reader_done.wait()  # its reader stopped and reset the stream
        assert control.stats.channels_retired == 1

    with_pair(test)


def test_requests_succeed_again_after_a_peers_handlers_stalled():
    """Issue 7, item 3: once the peer's handlers answer again, requests succeed again, with
    nothing restarted, and the peer is left with no stalled handler (each was cut at its deadline)."""
    stalled, running = [True], [0]

    async def sometimes(peer, message):
        running[0] += 1
        try:
            if stalled[0]:
                await trio.sleep_forever()
            return wire.Pong(nonce=message.nonce + 1)
        finally:
            running[0] -= 1

    async def test(client, control, server, server_control):
        server_control.handle(wire.Ping, sometimes)
        async with trio.open_nursery() as nursery:
            for n in range(8):  # requests pile up on the stalled peer and fail
                nursery.start_soon(_expect_failure, control, server.get_id(), n)
        assert control.stats.requests_failed == 8
        stalled[0] = False
        for n in range(20):
            assert await control.request(server.get_id(), wire.Ping(nonce=n), timeout=1.0) == wire.Pong(nonce=n + 1)
        assert control.stats.requests_failed == 8  # no longer rising
        with trio.fail_after(SHORT_HANDLER_TIMEOUT + 5):
            while running[0]:
                await trio.sleep(0.05)

    with_pair(test, SHORT_HANDLER_TIMEOUT)


async def _expect_failure(control, peer_id, nonce):
    with pytest.raises(DialError):
        await control.request(peer_id, wire.Ping(nonce=nonce), timeout=0.3)


def test_a_channel_idle_too_long_is_reopened(monkeypatch):
    """A client reopens an idle channel before a server's idle deadline could cut it mid-request."""
    monkeypatch.setattr(control_module, "CHANNEL_MAX_IDLE", 0.2)

    async def test(client, control, server, server_control):
        server_control.handle(wire.Ping, pong)
        assert await control.request(server.get_id(), wire.Ping(nonce=1)) == wire.Pong(nonce=2)
        first = control._channels[str(server.get_id())]
        await trio.sleep(0.3)  # the idleness under test, not a wait for an event
        assert await control.request(server.get_id(), wire.Ping(nonce=3)) == wire.Pong(nonce=4)
        assert control._channels[str(server.get_id())] is not first
        with trio.fail_after(5):
            await first.reader_done.wait()

    with_pair(test)


def test_a_silent_channel_is_closed_by_the_server_and_the_client_reopens_one():
    """The server's guard drops a control stream silent past its idle deadline; the client's reader
    sees it, and the next request opens a fresh stream."""

    async def test(client, control, server, server_control):
        server_control.handle(wire.Ping, pong)
        set_protocol_limits(server, CONTROL_PROTOCOL, ProtocolLimits(4, idle_timeout=0.5))
        assert await control.request(server.get_id(), wire.Ping(nonce=1)) == wire.Pong(nonce=2)
        first = control._channels[str(server.get_id())]
        with trio.fail_after(5):
            await first.reader_done.wait()
        assert guard_stats(server)["closed_idle"] == 1
        assert await control.request(server.get_id(), wire.Ping(nonce=3)) == wire.Pong(nonce=4)

    with_pair(test)

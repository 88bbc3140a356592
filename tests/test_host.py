"""The libp2p host as p2pswarm builds it: Noise only, fast connect, expanded addresses, closed listeners."""

from __future__ import annotations

import socket
from contextlib import AsyncExitStack

import multiaddr
import pytest
import trio
from trio.testing import wait_all_tasks_blocked

from p2pswarm.errors import ConfigError, DialError, StartupError
from p2pswarm.identity import generate_identity
from p2pswarm.net import host as host_module
from p2pswarm.net.guard import guard_stats, set_protocol_limits
from p2pswarm.net.host import HostLimits, connect, expand_wildcards, open_host, peer_info_from_multiaddr
from p2pswarm.net.limits import ProtocolLimits, StreamLimits
from p2pswarm.net.streams import open_stream

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
ENDLESS_DELAY = 3600.0  # a happy-eyeballs delay no test outlives: a connect that sits it out hangs
CONNECT_GUARD_S = 30.0  # failure guard only: a loopback connect takes milliseconds


def first_addr(host) -> str:
    return str(host.get_addrs()[0])


def test_expand_wildcards():
    addrs = [multiaddr.Multiaddr("/ip4/0.0.0.0/tcp/4001"), multiaddr.Multiaddr("/ip4/10.0.0.1/tcp/5")]
    out = [str(a) for a in expand_wildcards(addrs, ["192.0.2.2", "127.0.0.1"])]
    assert out == ["/ip4/192.0.2.2/tcp/4001", "/ip4/127.0.0.1/tcp/4001", "/ip4/10.0.0.1/tcp/5"]


def test_wildcard_listen_never_advertises_0000():
    async def main():
        async with open_host(generate_identity(), ["/ip4/0.0.0.0/tcp/0"]) as host:
            addrs = [str(a) for a in host.get_addrs()]
            assert addrs and not any("0.0.0.0" in a for a in addrs)
            assert any(a.startswith("/ip4/127.0.0.1/tcp/") for a in addrs)

    trio.run(main)


def test_plaintext_only_peer_is_refused():
    """A peer that offers only /plaintext/2.0.0 (or secio) cannot connect to a p2pswarm host."""
    from libp2p import new_host
    from libp2p.security.insecure.transport import PLAINTEXT_PROTOCOL_ID, InsecureTransport

    async def main():
        async with open_host(generate_identity(), LOOPBACK) as ours:
            plain_identity = generate_identity()
            plain = new_host(key_pair=plain_identity.key_pair,
                             sec_opt={PLAINTEXT_PROTOCOL_ID: InsecureTransport(plain_identity.key_pair)})
            async with plain.run(listen_addrs=[multiaddr.Multiaddr(LOOPBACK[0])]):
                try:
                    with pytest.raises(DialError):
                        await connect(plain, peer_info_from_multiaddr(first_addr(ours)), timeout=5)
                    assert not ours.get_connected_peers()
                finally:
                    await plain.close()

    trio.run(main)


def test_connect_returns_as_soon_as_its_dial_wins(monkeypatch):
    """Ours never sits out its happy-eyeballs delay once a dial has won: with the delay made
    endless, connect still returns (the guard only turns a hang into a failure)."""
    monkeypatch.setattr(host_module, "HAPPY_EYEBALLS_DELAY", ENDLESS_DELAY)

    async def main():
        async with open_host(generate_identity(), LOOPBACK) as server, \
                open_host(generate_identity(), LOOPBACK) as client:
            with trio.fail_after(CONNECT_GUARD_S):
                await connect(client, peer_info_from_multiaddr(first_addr(server)))
            assert server.get_id() in client.get_connected_peers()

    trio.run(main)


def test_library_dial_peer_still_waits_for_alternates_after_its_dial_succeeded(monkeypatch):
    """The defect (8) behind ``max_connections_per_peer=1`` and our own ``connect``: with more
    connections per peer allowed, py-libp2p's ``dial_peer`` keeps waiting out its happy-eyeballs
    delay after its only dial succeeded. Drop the workaround when this fails."""
    from libp2p.network import swarm as swarm_module

    monkeypatch.setattr(swarm_module, "_HAPPY_EYEBALLS_DELAY", ENDLESS_DELAY)
    limits = HostLimits(max_connections_per_peer=3)

    async def main():
        async with open_host(generate_identity(), LOOPBACK, limits) as server, \
                open_host(generate_identity(), LOOPBACK, limits) as client:
            target = peer_info_from_multiaddr(first_addr(server))
            network, returned = client.get_network(), []
            client.get_peerstore().add_addrs(target.peer_id, target.addrs, 120)

            async def library_dial():  # the swarm's own dial_peer, which ours replaces
                returned.append(await type(network).dial_peer(network, target.peer_id))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(library_dial)
                await _wait_for(lambda: server.get_id() in client.get_connected_peers(), CONNECT_GUARD_S)
                await wait_all_tasks_blocked()  # what could still run has run: dial_peer only waits
                assert not returned  # connected, yet dial_peer has not returned
                nursery.cancel_scope.cancel()

    trio.run(main)


def test_connect_dials_every_given_address_not_only_the_first():
    """py-libp2p's dial_peer tries one TCP address per peer (the first in its peerstore): a peer
    listing an unreachable LAN address first could never be reached. Ours tries them in turn."""

    async def main():
        async with open_host(generate_identity(), LOOPBACK) as server, \
                open_host(generate_identity(), LOOPBACK) as client:
            good = first_addr(server)
            info = peer_info_from_multiaddr(good)
            with socket.socket() as closed:  # a port nobody listens on: refused at once
                closed.bind(("127.0.0.1", 0))
                dead = f"/ip4/127.0.0.1/tcp/{closed.getsockname()[1]}"
            info.addrs[:] = [multiaddr.Multiaddr(dead), multiaddr.Multiaddr(good.split("/p2p/")[0])]
            await connect(client, info)
            assert server.get_id() in client.get_connected_peers()

    trio.run(main)


def test_port_in_use_is_a_startup_error():
    async def main():
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            port = taken.getsockname()[1]
            with pytest.raises(StartupError, match="in use"):
                async with open_host(generate_identity(), [f"/ip4/127.0.0.1/tcp/{port}"]):
                    pass

    trio.run(main)


def test_listener_is_closed_after_the_block():
    async def main():
        async with open_host(generate_identity(), LOOPBACK) as host:
            port = int(first_addr(host).split("/")[4])
        return port

    port = trio.run(main)
    with socket.socket() as probe:
        assert probe.connect_ex(("127.0.0.1", port)) != 0, "a listener survived host.close()"


def test_no_auto_dialling_of_known_peers():
    """py-libp2p's auto-connector would dial every peer in the peerstore; ours dials nobody unasked."""

    async def main():
        async with open_host(generate_identity(), LOOPBACK) as other:
            async with open_host(generate_identity(), LOOPBACK) as host:
                info = peer_info_from_multiaddr(first_addr(other))
                host.get_peerstore().add_addrs(info.peer_id, info.addrs, 3600)
                network = host.get_network()
                assert not network.auto_connector._started
                await network.auto_connector.maybe_connect()  # what its periodic task would run
                assert not host.get_connected_peers()  # a started connector dials inside that call

    trio.run(main)


def test_connection_limit_is_enforced_exactly():
    """HostLimits.max_connections peers are held; more are refused (libp2p alone holds one fewer)."""
    limit = 3

    async def main():
        async with open_host(generate_identity(), LOOPBACK, HostLimits(max_connections=limit)) as server:
            target = peer_info_from_multiaddr(first_addr(server))
            outcomes = []
            async with AsyncExitStack() as clients:
                for _ in range(limit + 2):
                    client = await clients.enter_async_context(open_host(generate_identity(), LOOPBACK))
                    try:
                        await connect(client, target, timeout=3)
                        outcomes.append("connected")
                    except DialError:
                        outcomes.append("refused")
                    if len(outcomes) <= limit:  # the server holds every admitted peer
                        await _wait_for(lambda: len(server.get_connected_peers()) == len(outcomes))
                    else:  # and keeps none of the excess, even one whose handshake completed
                        await _wait_for(lambda client=client: server.get_id() not in client.get_connected_peers())
                    assert len(server.get_connected_peers()) <= limit
                assert len(server.get_connected_peers()) == limit
            # The first `limit` dials succeed; the one after may complete its handshake before the
            # server drops it, but the server never holds more than `limit`, and later dials fail.
            assert outcomes[:limit] == ["connected"] * limit and outcomes[-1] == "refused", outcomes

    trio.run(main)


# --- inbound stream limits (net/guard.py installed by build_host) ------------------------

SILENT = "/p2pswarm/test-silent/1.0.0"


def _silent_server(host, finished: list):
    """A handler that waits for bytes that never come, noting when it ends (cancelled or not)."""

    async def handler(stream):
        try:
            await stream.read(1)
        finally:
            finished.append(stream)

    host.set_stream_handler(SILENT, handler)


async def _wait_for(predicate, timeout: float = 5.0) -> None:
    with trio.fail_after(timeout):
        while not predicate():
            await trio.sleep(0.02)


def test_libp2p_stream_limit_queues_instead_of_refusing():
    """The defect (9) behind the guard: py-libp2p's own stream limit makes the excess wait, silently.

    A plain host with a 2-stream limit holding 2 silent streams never answers a third: the
    stream is neither negotiated nor refused. Drop the guard when this no longer holds.
    """
    from libp2p import new_host
    from libp2p.crypto.x25519 import create_new_key_pair
    from libp2p.rcmgr import ResourceLimits, new_resource_manager
    from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_ID
    from libp2p.security.noise.transport import Transport as NoiseTransport

    async def main():
        identity = generate_identity()
        plain = new_host(key_pair=identity.key_pair,
                         sec_opt={NOISE_ID: NoiseTransport(identity.key_pair,
                                                           noise_privkey=create_new_key_pair().private_key)},
                         resource_manager=new_resource_manager(limits=ResourceLimits(max_streams=2),
                                                               enable_metrics=False))
        finished = []
        _silent_server(plain, finished)
        async with plain.run(listen_addrs=[multiaddr.Multiaddr(LOOPBACK[0])]):
            try:
                async with open_host(generate_identity(), LOOPBACK) as client:
                    await connect(client, peer_info_from_multiaddr(first_addr(plain)))
                    held = [await open_stream(client, plain.get_id(), SILENT) for _ in range(2)]
                    with pytest.raises(DialError, match="no answer within"):
                        await open_stream(client, plain.get_id(), SILENT, timeout=1.0)
                    assert len(held) == 2
            finally:
                await plain.close()

    trio.run(main)


def test_excess_streams_of_a_peer_are_refused_at_once_and_others_still_served():
    limits = HostLimits(streams=StreamLimits(max_inbound_per_peer=3))

    async def main():
        async with open_host(generate_identity(), LOOPBACK, limits) as server, \
                open_host(generate_identity(), LOOPBACK) as greedy, open_host(generate_identity(), LOOPBACK) as other:
            finished = []
            _silent_server(server, finished)
            for client in (greedy, other):
                await connect(client, peer_info_from_multiaddr(first_addr(server)))
            held = [await open_stream(greedy, server.get_id(), SILENT) for _ in range(3)]
            with pytest.raises(DialError) as refused:
                await open_stream(greedy, server.get_id(), SILENT)
            assert "no answer within" not in str(refused.value)  # reset at once, not queued
            held.append(await open_stream(other, server.get_id(), SILENT))  # another peer is served
            stats = guard_stats(server)
            assert stats["refused_peer"] == 1 and stats["open"] == 4 and stats["peers"] == 2

    trio.run(main)


def test_every_protocol_is_guarded_even_one_registered_after_the_host_was_built():
    """A service registering its handler later (e.g. the stream pool) gets the same limits:
    its excess streams are refused, and a silent one is closed at its idle deadline, its
    handler cancelled (a local reset alone would leave the handler blocked in its read)."""

    async def main():
        async with (open_host(generate_identity(), LOOPBACK) as server,
                    open_host(generate_identity(), LOOPBACK) as client):
            finished = []
            _silent_server(server, finished)
            set_protocol_limits(server, SILENT, ProtocolLimits(2, idle_timeout=0.5))
            await connect(client, peer_info_from_multiaddr(first_addr(server)))
            held = [await open_stream(client, server.get_id(), SILENT) for _ in range(2)]
            try:  # refused after negotiation: the reset may overtake the protocol's echo, or not
                held.append(await open_stream(client, server.get_id(), SILENT))
            except DialError:
                pass
            await _wait_for(lambda: guard_stats(server)["refused_protocol"] == 1)
            await _wait_for(lambda: len(finished) == 2)  # both cut at their idle deadline
            await _wait_for(lambda: guard_stats(server)["open"] == 0)  # released once the reset is done
            stats = guard_stats(server)
            assert stats["closed_idle"] == 2
            assert len(held) >= 2

    trio.run(main)


def test_a_stream_that_never_negotiates_is_closed_at_its_deadline():
    limits = HostLimits(streams=StreamLimits(negotiation_timeout=0.5))

    async def main():
        async with (open_host(generate_identity(), LOOPBACK, limits) as server,
                    open_host(generate_identity(), LOOPBACK) as client):
            await connect(client, peer_info_from_multiaddr(first_addr(server)))
            muxed = client.get_network().get_connections(server.get_id())[0].muxed_conn
            raw = await muxed.open_stream()  # a Yamux stream on which the client never says a word
            await _wait_for(lambda: guard_stats(server)["closed_negotiation"] == 1)
            # released once its reset is done (after the count)
            await _wait_for(lambda: guard_stats(server)["open"] == 0)
            await raw.reset()

    trio.run(main)


PEER = "12D3KooWDNBaynwLzcwCmDKXNd7PjbJZbCJaUrWxtrAeAEd6D6Ge"


@pytest.mark.parametrize("addr", [
    f"/ip4/127.0.0.1/tcp/4001/p2p/{PEER}",
    f"/dns4/example.com/tcp/4001/p2p/{PEER}",
    "/ip4/1.2.3.4/tcp/1/p2p/QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N",
    "/ip4/127.0.0.1/tcp/4001",
    f"/ip4/1.2.3.4/tcp/1/p2p/{PEER}/p2p-circuit",
    "/ip4/1.2.3.4/tcp/1/p2p/12D3Koo",
    "not a multiaddr",
    "",
])
def test_the_command_lines_light_check_agrees_with_libp2ps_parse(addr):
    """``check_peer_multiaddr`` (no libp2p import) accepts exactly what ``peer_info_from_multiaddr``
    accepts, and refuses the rest with a ConfigError."""

    def verdict(check) -> bool:
        try:
            check(addr)
        except ConfigError:
            return False
        return True

    assert verdict(host_module.check_peer_multiaddr) == verdict(host_module.peer_info_from_multiaddr)

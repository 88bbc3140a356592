"""The py-libp2p 0.8.1 swarm patches of ``net/swarm_fixes.py`` and ``net/guard.py``, each shown
against the library's own behaviour (so that an upgrade which fixes the library fails the
"defect" test and the patch can go), on real hosts on loopback in one trio run."""

from __future__ import annotations

import trio

from p2pswarm import wire
from p2pswarm.identity import generate_identity
from p2pswarm.net.control import ControlService
from p2pswarm.net.guard import guard_stats
from p2pswarm.net.host import HostLimits, connect, open_host, peer_info_from_multiaddr
from p2pswarm.net.swarm_fixes import PerAddress, inbound_stats
from p2pswarm.testing.churn import LOOPBACK, one_lifetime

CAP = 4  # a small connection cap: the old defect shows after this many lifetimes
LIFETIMES = 5 * CAP


async def pong(peer: str, message: wire.Ping) -> wire.Pong:
    return wire.Pong(nonce=message.nonce + 1)


async def lifetimes(node, count: int) -> tuple[int, int]:
    """``count`` fresh peers connect, ping and leave, one after another: (accepted, failed)."""
    addr = str(node.get_addrs()[0])
    accepted = failed = 0
    for _ in range(count):
        try:
            await one_lifetime(addr)
            accepted += 1
        except Exception:  # refused: counted
            failed += 1
    return accepted, failed


def run_node(body, limits: HostLimits = HostLimits(max_connections=CAP)):
    async def main():
        async with open_host(generate_identity(), LOOPBACK, limits) as node, trio.open_nursery() as nursery:
            ControlService(node, nursery).handle(wire.Ping, pong)
            await body(node, nursery)
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_library_defect_inbound_slots_held_until_shutdown():
    async def body(node, nursery):
        swarm = node.get_network()
        del swarm._handle_inbound_connection  # the library's own handler again
        accepted, failed = await lifetimes(node, 2 * CAP)
        assert (accepted, failed) == (CAP, CAP)  # each closed connection still holds its slot

    run_node(body)


def test_inbound_slots_return_when_connections_close():
    async def body(node, nursery):
        assert await lifetimes(node, LIFETIMES) == (LIFETIMES, 0)
        with trio.fail_after(10):
            while inbound_stats(node)["open"]:
                await trio.sleep(0.05)
        stats = inbound_stats(node)
        assert stats["accepted"] == LIFETIMES and stats["refused"] == 0 and stats["limit"] == CAP
        assert not node.get_network().auto_connector._recent_disconnects  # nothing kept per departed peer

    run_node(body)


def test_one_address_holds_a_bounded_number_of_inbound_connections():
    """Identities are free, addresses are not: connections from one address beyond its cap are refused
    while the others stay open, and a closed one frees its place (loopback is exempt in use; not here)."""
    async def body(node, nursery):
        node.get_network().p2pswarm_per_address = PerAddress(2, exempt=lambda ip: False)
        target = peer_info_from_multiaddr(str(node.get_addrs()[0]))
        held = [await stack_host(nursery) for _ in range(2)]
        for host, _ in held:
            await connect(host, target)
        assert await lifetimes(node, 1) == (0, 1)  # a third from the same address
        assert inbound_stats(node)["refused_per_address"] == 1
        await held[0][0].disconnect(target.peer_id)
        with trio.fail_after(10):
            while node.get_network().p2pswarm_per_address.open["127.0.0.1"] > 1:
                await trio.sleep(0.05)
        assert await lifetimes(node, 1) == (1, 0)
        for _, done in held:
            done.set()

    run_node(body)


async def stack_host(nursery) -> tuple:
    """A client host that lives until its event is set."""
    ready, done = trio.Event(), trio.Event()
    box: list = []

    async def live():
        async with open_host(generate_identity(), LOOPBACK) as host:
            box.append(host)
            ready.set()
            await done.wait()
    nursery.start_soon(live)
    await ready.wait()
    return box[0], done


ECHO = "/test/raise-after-read/1.0.0"


async def open_and_reset(client, node_id) -> None:
    with trio.fail_after(5):
        stream = await client.new_stream(node_id, [ECHO])
        await stream.write(b"x")
        await stream.reset()


def test_a_failing_handler_ends_its_stream_not_the_connection():
    async def body(node, nursery):
        async def handler(stream):
            await stream.read(1)
            await stream.read(1)  # waits for the peer's reset, then raises (no sleep racing its arrival)
            await stream.write(b"y")  # were the read ever to return: raises, the stream was reset

        node.set_stream_handler(ECHO, handler)
        async with open_host(generate_identity(), LOOPBACK) as client:
            await connect(client, peer_info_from_multiaddr(str(node.get_addrs()[0])))
            for _ in range(5):  # the library's own dispatch hung every stream after the second
                await open_and_reset(client, node.get_id())
            with trio.fail_after(5):
                while guard_stats(node)["handler_errors"] < 5 or guard_stats(node)["open"]:
                    await trio.sleep(0.05)
            control = ControlService(client, nursery)
            assert await control.request(node.get_id(), wire.Ping(nonce=1)) == wire.Pong(nonce=2)

    run_node(body)


def test_the_resource_managers_denials_are_counted_by_what_it_returns():
    """A node whose resource manager allows a few streams: streams are opened until one is denied, and
    ``inbound_stats`` counts that one denial (by the manager's answer, not by the text of the library's error)."""
    from libp2p.custom_types import TProtocol

    from p2pswarm.net.control import CONTROL_PROTOCOL

    async def main():
        async with open_host(generate_identity(), LOOPBACK, HostLimits(max_streams=4)) as node, \
                open_host(generate_identity(), LOOPBACK) as other, trio.open_nursery() as nursery:
            ControlService(other, nursery).handle(wire.Ping, pong)
            await connect(node, peer_info_from_multiaddr(f"{other.get_addrs()[0]}"))
            held = []
            for _ in range(8):
                assert inbound_stats(node)["resource_manager_denied_streams"] == 0
                try:
                    held.append(await node.new_stream(other.get_id(), [TProtocol(CONTROL_PROTOCOL)]))
                except Exception as exc:  # the library's SwarmException, whatever its text
                    print(f"stream {len(held) + 1} refused: {exc!r}")
                    break
            else:
                raise AssertionError("8 streams opened past a manager's limit of 4")
            assert inbound_stats(node)["resource_manager_denied_streams"] == 1
            for stream in held:
                await stream.reset()
            nursery.cancel_scope.cancel()

    trio.run(main)

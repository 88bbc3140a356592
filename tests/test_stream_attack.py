"""One peer holding thousands of silent streams must not lock anyone else out (issue 7, item 2).

Real py-libp2p hosts on loopback, in one trio run. The attacker switches off its own library's
stream limits (as a malicious peer would), negotiates thousands of control streams and never
writes on them, and keeps opening raw Yamux streams that never even negotiate. Meanwhile fresh
honest hosts connect, ping the node over the control channel, and the node pings them back:
each exchange must be answered within the normal request timeout for the whole attack, and the
node's guard must show the streams it refused and closed. Afterwards the node recovers alone.
"""

from __future__ import annotations

import logging

import libp2p  # noqa: F401 - importing sets up libp2p's logging; done here, before caplog quiets it
import trio
from libp2p.stream_muxer.exceptions import MuxedStreamError

from p2pswarm import wire
from p2pswarm.identity import generate_identity
from p2pswarm.net.control import CONTROL_PROTOCOL, REQUEST_TIMEOUT, ControlService
from p2pswarm.net.guard import guard_stats, set_protocol_limits
from p2pswarm.net.host import HostLimits, connect, open_host, peer_info_from_multiaddr
from p2pswarm.net.limits import ProtocolLimits, StreamLimits

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
RAW_BURST = 1000  # raw Yamux streams (never negotiated) per burst: a few bursts exceed py-libp2p's 4096
RAW_PERIOD = 1.0  # seconds between bursts
NEGOTIATE_BATCH = 100  # control streams negotiated at once, then held silent
MIN_HONEST_ROUNDS = 3  # honest peers served one after another during the attack
ATTACK_GUARD_S = 120.0  # failure guard only: every defence acts within seconds of the attack's start
TEST_LIMITS = HostLimits(streams=StreamLimits(negotiation_timeout=2.0))  # short deadlines keep the test short
CONTROL_IDLE = 3.0  # the control idle deadline in this test (minutes in a real node)


async def pong(peer: str, message: wire.Ping) -> wire.Pong:
    return wire.Pong(nonce=message.nonce + 1)


def info(host):
    return peer_info_from_multiaddr(str(host.get_addrs()[0]))


def unleash(attacker, target_id):
    """Switch off the attacker's own library limits; return its muxed connection to the target (None: its
    connection closed again before it could be used)."""
    network = attacker.get_network()
    network.set_resource_manager(None)
    conn = next((c for c in network.get_connections(target_id) if not c.is_closed), None)
    if conn is None:
        return None
    conn.muxed_conn.stream_backlog_semaphore = trio.Semaphore(1 << 20)  # Yamux's 256 outbound streams a connection
    return conn.muxed_conn


class Attack:
    """What the attacker did: streams it opened raw, negotiated, and tried to negotiate."""

    def __init__(self) -> None:
        self.raw = 0
        self.negotiated = 0
        self.attempts = 0
        self.redials = 0
        self.held: list = []

    async def run(self, attacker, target) -> None:
        """Until cancelled: bursts of raw streams, and control streams negotiated then left silent. When its
        connection ends (in the suite, once, under load: closed by one of the two libraries), it dials again,
        as an attacker would, again if that connection closes at once (seen once in the suite under load):
        what is tested is that the honest peers are served meanwhile."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._negotiate, attacker, target.peer_id)
            while True:
                muxed = unleash(attacker, target.peer_id)
                try:
                    if muxed is None:
                        raise MuxedStreamError("the redialled connection closed at once")
                    while True:
                        for _ in range(RAW_BURST):
                            self.held.append(await muxed.open_stream())
                            self.raw += 1
                        await trio.sleep(RAW_PERIOD)
                except MuxedStreamError:  # "Connection is shutting down"
                    self.redials += 1
                    await connect(attacker, target)

    async def _negotiate(self, attacker, node_id) -> None:
        async def one() -> None:
            try:
                stream = await attacker.new_stream(node_id, [CONTROL_PROTOCOL])
            except Exception:  # refused during negotiation
                return
            self.held.append(stream)
            self.negotiated += 1

        while True:
            async with trio.open_nursery() as nursery:
                for _ in range(NEGOTIATE_BATCH):
                    self.attempts += 1
                    nursery.start_soon(one)


def every_defence_acted(attack: Attack, node) -> bool:
    """The attack is at full strength and the node's guard has refused per peer and per protocol
    and closed streams at both the negotiation and the idle deadline."""
    stats = guard_stats(node)
    return (attack.raw >= 4 * RAW_BURST and attack.attempts >= NEGOTIATE_BATCH
            and stats["refused_peer"] > 0 and stats["refused_protocol"] > 0
            and stats["closed_negotiation"] > 0 and stats["closed_idle"] > 0)


async def honest_round(node, node_control, nursery) -> None:
    """A fresh host connects and pings the node; the node pings it back. Raises if either fails."""
    async with open_host(generate_identity(), LOOPBACK) as honest:
        control = ControlService(honest, nursery)
        control.handle(wire.Ping, pong)
        with trio.fail_after(REQUEST_TIMEOUT):
            await connect(honest, info(node))
        assert await control.request(node.get_id(), wire.Ping(nonce=1)) == wire.Pong(nonce=2)
        assert await node_control.request(honest.get_id(), wire.Ping(nonce=3)) == wire.Pong(nonce=4)


def test_one_peer_with_thousands_of_silent_streams_locks_nobody_out(caplog):
    caplog.set_level(logging.CRITICAL, logger="libp2p")  # the attacker's library logs each refusal

    async def main():
        async with open_host(generate_identity(), LOOPBACK, TEST_LIMITS) as node, \
                open_host(generate_identity(), LOOPBACK) as attacker:
            async with trio.open_nursery() as nursery:
                node_control = ControlService(node, nursery)
                node_control.handle(wire.Ping, pong)
                set_protocol_limits(node, CONTROL_PROTOCOL, ProtocolLimits(16, idle_timeout=CONTROL_IDLE))
                await connect(attacker, info(node))
                attack, attack_scope = Attack(), trio.CancelScope()

                async def run_attack():
                    with attack_scope:
                        await attack.run(attacker, info(node))

                nursery.start_soon(run_attack)
                rounds, rounds_after_every_defence = 0, 0
                # Honest rounds (each must succeed) until some began after every defence had acted.
                with trio.move_on_after(ATTACK_GUARD_S) as guard:  # a failure guard, with what was seen
                    while rounds < MIN_HONEST_ROUNDS or not rounds_after_every_defence:
                        defences_acted = every_defence_acted(attack, node)
                        await honest_round(node, node_control, nursery)
                        rounds, rounds_after_every_defence = rounds + 1, rounds_after_every_defence + defences_acted
                stats = guard_stats(node)
                assert not guard.cancelled_caught, (rounds, rounds_after_every_defence, attack.raw,
                                                    attack.attempts, stats)
                print(f"attacker: {attack.raw} raw streams, {attack.negotiated} of {attack.attempts} negotiated, "
                      f"{attack.redials} redial(s); "
                      f"{rounds} honest rounds answered, {rounds_after_every_defence} after every defence "
                      f"acted; guard: {stats}")
                assert stats["open"] <= TEST_LIMITS.streams.max_inbound_per_peer + 4
                attack_scope.cancel()
                await attacker.close()
                with trio.fail_after(10):
                    while guard_stats(node)["open"] > 0:  # every admitted stream was released
                        await trio.sleep(0.05)
                await honest_round(node, node_control, nursery)
                nursery.cancel_scope.cancel()

    trio.run(main)

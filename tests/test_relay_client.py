"""The relay client: its pure picker, then real relays and a NATed-in-spirit client on loopback."""

from __future__ import annotations

import random

import trio
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from p2pswarm import wire
from p2pswarm.identity import generate_identity
from p2pswarm.nat.relay_client import (
    REFRESH_AT,
    RELAY_BACKOFF,
    WANT_RELAYS,
    RelayPicker,
    serve_relay_reservations,
)
from p2pswarm.nat.relay_service import RelayConfig, serve_relay
from p2pswarm.net.control import ControlService
from p2pswarm.net.host import (
    connect,
    open_host,
    peer_info_from_multiaddr,
    set_extra_addrs,
)

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
RELAYS = [f"R{i}" for i in range(5)]

# ---------------------------------------------------------------- pure core


class PickerMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.picker = RelayPicker(random.Random(0))
        self.now = 1000.0
        self.failures: dict[str, float] = {}

    @rule(peer=st.sampled_from(RELAYS))
    def add(self, peer):
        self.picker.add_candidate(peer, [f"/ip4/10.0.0.{peer[1]}/tcp/4001"])

    @rule(ttl=st.floats(1, 3600))
    def reserve_what_is_asked(self, ttl):
        for peer in self.picker.to_reserve(self.now):
            assert not self.picker.in_backoff(peer, self.now)
            assert self.now - self.failures.get(peer, -1e9) >= RELAY_BACKOFF, "re-picked within the backoff"
            self.picker.reserved(peer, self.now, self.now + ttl)

    @rule(ttl=st.floats(1, 3600))
    def refresh_what_is_due(self, ttl):
        for peer in self.picker.refresh_due(self.now):
            held = self.picker.held[peer]
            assert held.expiry > self.now, "refresh asked for after expiry"
            self.picker.reserved(peer, self.now, self.now + ttl)

    @rule(peer=st.sampled_from(RELAYS), ttl=st.floats(1, 3600))
    def stray_grant(self, peer, ttl):  # a grant the picker did not ask for must not overfill it
        self.picker.reserved(peer, self.now, self.now + ttl)

    @rule(peer=st.sampled_from(RELAYS))
    def lose_connection(self, peer):  # the relay may have ended the reservation with its last connection
        self.picker.connection_lost(peer)

    @rule(peer=st.sampled_from(RELAYS))
    def fail(self, peer):
        self.picker.failed(peer, self.now)
        self.failures[peer] = self.now

    @rule(dt=st.floats(0, 2000))
    def tick(self, dt):
        # time moves in steps no longer than a refresh window of what is held, as a driver polls
        for held in self.picker.held.values():
            dt = min(dt, max(0.0, held.expiry - self.now) * (1 - REFRESH_AT) * 0.99)
        self.now += dt
        for peer in [p for p, h in self.picker.held.items() if h.expiry <= self.now]:
            self.failures[peer] = self.now  # expiry counts as a failure
        self.picker.expire(self.now)

    @invariant()
    def never_more_than_wanted(self):
        assert len(self.picker.held) <= WANT_RELAYS

    @invariant()
    def refresh_is_due_before_expiry(self):
        for held in self.picker.held.values():
            assert held.refresh_at() < held.expiry
            if not held.lost:
                assert held.refresh_at() - held.granted_at >= REFRESH_AT * (held.expiry - held.granted_at) - 1e-6

    @invariant()
    def a_lost_reservation_is_refreshed_at_once(self):
        due = self.picker.refresh_due(self.now)
        assert all(peer in due for peer, held in self.picker.held.items() if held.lost)

    @invariant()
    def nothing_held_is_expired(self):
        assert all(h.expiry > self.now for h in self.picker.held.values())


TestPicker = PickerMachine.TestCase
TestPicker.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_picker_fills_replaces_and_backs_off():
    picker = RelayPicker(random.Random(1))
    for peer in ["A", "B", "C"]:
        picker.add_candidate(peer, [f"/ip4/1.1.1.1/tcp/4001/p2p/{peer}"])
    chosen = picker.to_reserve(0)
    assert len(chosen) == 2
    for peer in chosen:
        assert picker.reserved(peer, 0, 100)
    assert picker.to_reserve(0) == [] and picker.refresh_due(49) == [] and picker.refresh_due(50) == sorted(chosen)
    assert picker.circuit_addrs() == [f"/ip4/1.1.1.1/tcp/4001/p2p/{p}/p2p-circuit" for p in sorted(chosen)]
    dead = chosen[0]
    picker.failed(dead, 10)
    (spare,) = set("ABC") - set(chosen)
    assert picker.to_reserve(11) == [spare]
    picker.reserved(spare, 11, 111)
    picker.failed(spare, 12)
    assert picker.to_reserve(12) == []  # the only other candidate failed moments ago
    assert picker.to_reserve(10 + RELAY_BACKOFF) == [dead]
    assert picker.stats(10) == [{"peer": chosen[1], "expires_in_s": 90.0}]


# ---------------------------------------------------------------- real hosts

async def _relay(config, task_status=trio.TASK_STATUS_IGNORED):
    """A relay host until cancelled (which closes it: its connections drop)."""
    async with open_host(generate_identity(), LOOPBACK) as host, trio.open_nursery() as nursery:
        await nursery.start(serve_relay, host, config)
        task_status.started(str(host.get_addrs()[0]))
        await trio.sleep_forever()


def test_client_reserves_on_two_relays_survives_a_dead_one_and_is_dialled_through_a_circuit():
    async def main():
        async with trio.open_nursery() as nursery:
            relay_scopes, relay_addrs = [], []
            for _ in range(3):
                scope = trio.CancelScope()
                relay_scopes.append(scope)

                async def run_relay(scope=scope, task_status=trio.TASK_STATUS_IGNORED):
                    with scope:
                        await _relay(RelayConfig(), task_status=task_status)
                relay_addrs.append(await nursery.start(run_relay))
            relay_ids = [a.rsplit("/p2p/", 1)[1] for a in relay_addrs]

            async with open_host(generate_identity(), LOOPBACK) as client, \
                    open_host(generate_identity(), LOOPBACK) as dialer:
                control = ControlService(client, nursery)

                async def pong(peer, ping):
                    return wire.Pong(nonce=ping.nonce)
                control.handle(wire.Ping, pong)
                picker = RelayPicker(random.Random(3))
                for addr in relay_addrs:
                    picker.add_candidate(addr.rsplit("/p2p/", 1)[1], [addr])
                changes: list[list[str]] = []

                def on_change(addrs):
                    changes.append(addrs)
                    set_extra_addrs(client, addrs)

                notifees = len(client.get_network().notifees)
                async with trio.open_nursery() as inner:
                    started = trio.current_time()
                    await inner.start(lambda task_status: serve_relay_reservations(
                        client, picker, on_change, tick=0.5, task_status=task_status))
                    def circuits():
                        return [str(a) for a in client.get_addrs() if "/p2p-circuit" in str(a)]
                    with trio.fail_after(15):
                        while len(circuits()) < 2:
                            await trio.sleep(0.05)
                    print(f"two reservations after {trio.current_time() - started:.2f} s")
                    assert len(circuits()) == 2 and all(a.endswith(f"/p2p-circuit/p2p/{client.get_id()}")
                                                        for a in circuits()), circuits()
                    assert all(e["expires_in_s"] > 1000 for e in picker.stats(__import__("time").time()))

                    # kill one held relay: the spare one replaces it
                    victim = min(picker.held)
                    relay_scopes[relay_ids.index(victim)].cancel()
                    killed = trio.current_time()
                    with trio.fail_after(15):
                        while any(victim in a for a in circuits()) or len(circuits()) < 2:
                            await trio.sleep(0.05)
                    print(f"replaced a dead relay after {trio.current_time() - killed:.2f} s")
                    assert changes[-1] == picker.circuit_addrs() and victim not in picker.held

                    # a third host dials the client through one circuit address and pings it
                    await _ping_through(dialer, circuits()[0], client.get_id())
                    inner.cancel_scope.cancel()
                assert changes[-1] == [] and not any("/p2p-circuit" in str(a) for a in client.get_addrs())
                assert len(client.get_network().notifees) == notifees  # its connection watch ended with it
            nursery.cancel_scope.cancel()

    trio.run(main)


async def _ping_through(dialer, circuit_addr: str, client_id) -> None:
    import multiaddr
    from libp2p.relay.circuit_v2.config import RelayConfig as LibRelayConfig
    from libp2p.relay.circuit_v2.protocol import CircuitV2Protocol
    from libp2p.relay.circuit_v2.transport import CircuitV2Transport

    relay_part = circuit_addr.split("/p2p-circuit")[0]
    await connect(dialer, peer_info_from_multiaddr(relay_part))
    transport = CircuitV2Transport(dialer, CircuitV2Protocol(dialer), LibRelayConfig())
    async with trio.open_nursery() as nursery:
        control = ControlService(dialer, nursery)
        with trio.fail_after(20):
            started = trio.current_time()
            await transport.dial(multiaddr.Multiaddr(circuit_addr))
            reply = await control.request(client_id, wire.Ping(nonce=7))
        print(f"relayed dial + ping in {trio.current_time() - started:.2f} s")
        assert reply == wire.Pong(nonce=7)
        nursery.cancel_scope.cancel()


# ---------------------------------------------------------------- the node and the command line

def test_node_reserves_only_while_private_and_shows_it_in_stats():
    from p2pswarm.nat.reachability import Reachability
    from p2pswarm.node.config import DhtMode, NodeConfig, Role
    from p2pswarm.node.running import run_node

    async def main():
        async with trio.open_nursery() as nursery:
            relay_addr = await nursery.start(_relay, RelayConfig())
            config = NodeConfig(role=Role.JOIN, listen=tuple(LOOPBACK), dht_mode=DhtMode.SERVER, layers=(0, 1),
                                relays=(relay_addr,))
            state = await nursery.start(run_node, config)
            assert state.stats()["relays"] == [] and state.stats()["circuit_addrs"] == []
            await state.nat.on_verdict(Reachability.PRIVATE)
            with trio.fail_after(15):
                while not state.stats()["circuit_addrs"]:
                    await trio.sleep(0.05)
            stats = state.stats()
            relay_id = relay_addr.rsplit("/p2p/", 1)[1]
            expected = f"{relay_addr}/p2p-circuit/p2p/{state.identity.peer_id_text}"
            assert stats["circuit_addrs"] == [expected] and expected in stats["addrs"]
            assert [r["peer"] for r in stats["relays"]] == [relay_id] and stats["relays"][0]["expires_in_s"] > 1000
            # on_verdict starts and stops the reservations synchronously (it cancels their scope), so the
            # state right after it returns is the decision itself: no sleep needed, none would prove more
            reservations = state.nat._relay_scope
            await state.nat.on_verdict(Reachability.UNKNOWN)  # keeps what runs
            assert state.nat._relay_scope is reservations and not reservations.cancel_called
            assert state.stats()["circuit_addrs"] == [expected]
            await state.nat.on_verdict(Reachability.PUBLIC)
            assert reservations.cancel_called and state.nat._relay_scope is None
            with trio.fail_after(5):
                while state.stats()["circuit_addrs"]:
                    await trio.sleep(0.05)
            stats = state.stats()
            assert stats["relays"] == [] and not any("/p2p-circuit" in a for a in stats["addrs"])
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_join_takes_repeatable_relays_and_rejects_one_without_peer_id():
    import pytest

    from p2pswarm.cli import build_parser, config_from_args
    from p2pswarm.errors import ConfigError

    boot = "/ip4/1.2.3.4/tcp/4001/p2p/12D3KooWC4p8cVcVJXqt72KsBpXPXDKQtfn7YXyuMP4RMEUkfFiF"
    relay = "/ip4/5.6.7.8/tcp/4001/p2p/12D3KooWF3pjaq1dBpTR5iUHFTwu3VXsYGWRmGgneQasLy6mZ8bZ"
    args = build_parser().parse_args(["join", "--bootstrap", boot, "--relay", relay, "--relay", boot])
    assert config_from_args(args).relays == (relay, boot)
    assert config_from_args(build_parser().parse_args(["join", "--bootstrap", boot])).relays == ()
    with pytest.raises(ConfigError, match="/p2p/"):
        config_from_args(build_parser().parse_args(["join", "--bootstrap", boot, "--relay", "/ip4/5.6.7.8/tcp/1"]))


def test_a_connected_peer_speaking_hop_is_used_as_a_relay():
    async def main():
        async with trio.open_nursery() as nursery:
            relay_addr = await nursery.start(_relay, RelayConfig())
            async with open_host(generate_identity(), LOOPBACK) as client:
                await connect(client, peer_info_from_multiaddr(relay_addr))
                picker, changes = RelayPicker(random.Random(0)), []
                nursery.start_soon(lambda: serve_relay_reservations(client, picker, changes.append, tick=0.2))
                with trio.fail_after(15):
                    while not changes:
                        await trio.sleep(0.05)
                assert changes[-1] == [f"{relay_addr}/p2p-circuit"]  # loopback only here, so kept
            nursery.cancel_scope.cancel()

    trio.run(main)

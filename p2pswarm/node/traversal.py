"""The node's NAT traversal service: reachability checks, relay reservations, hole punching,
STUN, and the relay service of relay nodes, with the addresses each of them makes us advertise.

It carries out the pure reactions of ``nat.policy`` and exposes its own stats; ``node.py``
only starts it.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

import trio

from p2pswarm.nat.autonat import AutonatService, serve_reachability
from p2pswarm.nat.holepunch import HolePunchService, punch_stats
from p2pswarm.nat.policy import RelayAction, react
from p2pswarm.nat.reachability import Reachability, ReachabilityTracker
from p2pswarm.nat.relay_client import RelayPicker, serve_relay_reservations
from p2pswarm.nat.relay_service import RelayBook, RelayConfig, serve_relay
from p2pswarm.nat.stun import StunReport, classify_nat
from p2pswarm.net.connect import path_kinds
from p2pswarm.net.host import listen_addrs, peer_info_from_multiaddr, set_extra_addrs
from p2pswarm.node.config import NodeConfig, Role

log = logging.getLogger(__name__)


class ServedRelay(Protocol):
    """What we read of the relay protocol ``serve_relay`` reports once serving."""

    book: RelayBook


class NatTraversal:
    """Everything a node does to be reachable and to reach others through NATs."""

    def __init__(self, host, nursery: trio.Nursery, config: NodeConfig, rng: random.Random,
                 push_identify: Callable[[], Awaitable[None]]) -> None:
        self._host, self._nursery, self._config, self._rng = host, nursery, config, rng
        self._push_identify = push_identify
        self.reachability = ReachabilityTracker()
        self.autonat = AutonatService(host, nursery, rng)
        self.stun: StunReport | None = None
        self.holepunch: HolePunchService | None = None  # DCUtR: the roles that can sit behind a NAT
        self.relay: ServedRelay | None = None  # the relay protocol (with its RelayBook) when the role is RELAY
        self.relay_picker: RelayPicker | None = None  # our reservations on relays (role JOIN)
        self._relay_scope: trio.CancelScope | None = None  # reservations, running exactly while PRIVATE
        self.circuit_addrs: list[str] = []  # advertised /p2p-circuit addrs (no /p2p/<us>)
        self.public_addrs: list[str] = []  # dial-back-confirmed, not our listen addrs (DMZ)
        self.set_dht_server: Callable[[bool], Awaitable[None]] | None = None  # given once the DHT runs
        if config.role is Role.JOIN:
            self.relay_picker = RelayPicker(rng)
            for relay in config.relays:
                self.relay_picker.add_candidate(str(peer_info_from_multiaddr(relay).peer_id), [relay])

    async def start(self) -> None:
        """Start the services that must run before the node joins the DHT."""
        if self._config.role is Role.JOIN:
            self.holepunch = await _start_holepunch(self._host, self._nursery)
        await self._nursery.start(self.autonat.serve_dialer)
        if self._config.role is Role.RELAY:
            self.relay = await self._nursery.start(serve_relay, self._host, self._config.relay or RelayConfig())
        if self._config.stun:
            self._nursery.start_soon(self._ask_stun)

    async def serve_reachability(self, find_servers: Callable[[int], Awaitable[None]]) -> None:
        await serve_reachability(self._host, self.autonat, self.reachability, self._rng, self.on_verdict,
                                 find_servers=find_servers)

    @property
    def private(self) -> bool:
        return self.reachability.verdict(time.time()) is Reachability.PRIVATE

    async def on_verdict(self, verdict: Reachability) -> None:
        """Log a new verdict and carry out ``nat.policy.react``'s reaction to it."""
        log.info("reachability: %s", verdict.value)
        confirmed = self.reachability.reachable_addresses(time.time()) if verdict is Reachability.PUBLIC else []
        reaction = react(verdict, role=self._config.role, dht_mode=self._config.dht_mode, confirmed=confirmed,
                         listening=listen_addrs(self._host))
        if list(reaction.public_addrs) != self.public_addrs:
            log.info("advertising dial-back-confirmed address(es): %s", ", ".join(reaction.public_addrs) or "none")
            self.public_addrs = list(reaction.public_addrs)
            self._publish_extra_addrs()
        if reaction.dht_server is not None and self.set_dht_server is not None:
            await self.set_dht_server(reaction.dht_server)
        if reaction.relays is RelayAction.START:
            self._start_relay_reservations()
        elif reaction.relays is RelayAction.STOP:
            self._stop_relay_reservations()

    def _set_circuit_addrs(self, addrs: list[str]) -> None:
        self.circuit_addrs = list(addrs)
        self._publish_extra_addrs()

    def _publish_extra_addrs(self) -> None:
        """Advertise, besides the listen addresses: confirmed public ones (a port-forwarding or DMZ
        router's address, which the host cannot see) and relay circuits."""
        set_extra_addrs(self._host, self.public_addrs + self.circuit_addrs)
        self._nursery.start_soon(self._push_identify)  # peers learn the new addresses now

    def _start_relay_reservations(self) -> None:
        picker = self.relay_picker
        if self._relay_scope is not None or picker is None:
            return
        scope = self._relay_scope = trio.CancelScope()

        async def run() -> None:
            with scope:
                await serve_relay_reservations(self._host, picker, self._set_circuit_addrs)
            self._set_circuit_addrs([])

        log.info("relay client: behind a NAT, reserving on relays")
        self._nursery.start_soon(run)

    def _stop_relay_reservations(self) -> None:
        if self._relay_scope is not None:
            log.info("relay client: reachable, dropping relay reservations")
            self._relay_scope.cancel()
            self._relay_scope = None

    async def _ask_stun(self) -> None:
        """One bounded STUN classification at start-up (pystun3-style floods are impossible here)."""
        server = self._config.stun
        assert server is not None, "started only when config.stun names a server"
        self.stun = await classify_nat(server)
        log.info("STUN %s:%d: NAT type %s, public UDP address %s (%d packets)", *server,
                 self.stun.nat_type.value, self.stun.public, self.stun.packets_sent)

    def stats_doc(self, peer_id: str) -> dict:
        """What /api/stats shows of NAT traversal (top-level keys)."""
        now = time.time()
        stun = self.stun
        return {
            "reachability": self.reachability.verdict(now).value,
            "reachable_addrs": self.reachability.reachable_addresses(now),
            "stun": None if stun is None else {
                "nat_type": stun.nat_type.value,
                "public": f"{stun.public[0]}:{stun.public[1]}" if stun.public else None,
                "packets_sent": stun.packets_sent,
            },
            "holepunch": punch_stats(self.holepunch),
            "relay": self.relay.book.stats(time.monotonic()) if self.relay is not None else None,
            "relays": self.relay_picker.stats(now) if self.relay_picker is not None else [],
            "circuit_addrs": [f"{a}/p2p/{peer_id}" for a in self.circuit_addrs],
            "paths": path_kinds(self._host, self.holepunch.book.punched if self.holepunch else ()),
        }


async def _start_holepunch(host, nursery: trio.Nursery) -> HolePunchService:
    """Run the DCUtR service in ``nursery`` until the node stops."""
    from libp2p.tools.anyio_service import background_trio_service

    service = HolePunchService(host)

    async def run(task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with background_trio_service(service):
            await service.event_started.wait()
            task_status.started()
            await trio.sleep_forever()

    await nursery.start(run)
    return service


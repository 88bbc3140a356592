"""A running node: the host, the DHT, the control channel, layer announcement and the API.

``run_node`` holds every service in one nursery and switches them on by role; there are no
service classes or inheritance. It reports ``task_status.started(state)`` once the node is
listening, has joined the DHT and (for a trainer) has chosen its layers.
"""

from __future__ import annotations

import functools
import logging
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import trio

from p2pswarm import __version__
from p2pswarm.api import serve_api
from p2pswarm.config import BOOTSTRAP_DIAL_TIMEOUT, DhtMode, NodeConfig, Role
from p2pswarm.dht.discovery import (
    ANNOUNCE_PERIOD,
    LAYER_MAP_PERIOD,
    LOOKUP_TIMEOUT,
    RECORD_TTL,
    LayerIndex,
    join_network,
    open_kademlia,
    push_identify,
    serve_routing_upkeep,
)
from p2pswarm.dht.records import Capacity, LayerRecord, sign_record
from p2pswarm.dht.store import RecordStore
from p2pswarm.identity import Identity, load_or_create_key
from p2pswarm.model.catalog import ModelSpec, get_model, least_served_stage
from p2pswarm.errors import ConfigError, DialError
from p2pswarm.nat.autonat import AutonatService, serve_reachability
from p2pswarm.nat.holepunch import HolePunchService, punch_stats
from p2pswarm.nat.reachability import Reachability, ReachabilityTracker
from p2pswarm.nat.relay_client import RelayPicker, serve_relay_reservations
from p2pswarm.nat.relay_service import RelayConfig, serve_relay
from p2pswarm.nat.stun import StunReport, classify_nat
from p2pswarm.net import probe
from p2pswarm.net.connect import Connector
from p2pswarm.net.control import ControlService
from p2pswarm.net.host import listen_addrs, open_host, parse_multiaddr, peer_info_from_multiaddr, set_extra_addrs

log = logging.getLogger(__name__)

MAX_UPGRADE_WAIT = 30.0  # /api/ping?upgrade_wait=S: longest wait for a relayed connection to turn direct
LAYER_MAP_BUILD_TIMEOUT = 2 * LOOKUP_TIMEOUT  # closest-peer search plus one fetch round, each bounded


@dataclass
class NodeState:
    """What the node knows about itself and the swarm; read by the status API."""

    identity: Identity
    config: NodeConfig
    model: ModelSpec
    host: object = None
    kad: object = None
    control: ControlService | None = None
    connector: Connector | None = None
    holepunch: HolePunchService | None = None  # DCUtR (role JOIN: the roles that can sit behind a NAT)
    index: LayerIndex | None = None
    autonat: AutonatService | None = None
    reachability: ReachabilityTracker = field(default_factory=ReachabilityTracker)
    stun: StunReport | None = None
    relay: object = None  # the relay protocol (with its RelayBook) when the role is RELAY
    relay_picker: RelayPicker | None = None  # our reservations on relays (role JOIN)
    relay_scope: trio.CancelScope | None = None  # the reservation driver, running exactly while PRIVATE
    circuit_addrs: list[str] = field(default_factory=list)  # advertised /p2p-circuit addrs (no /p2p/<us>)
    public_addrs: list[str] = field(default_factory=list)  # dial-back-confirmed, not our listen addrs (DMZ)
    nursery: trio.Nursery | None = None
    layers: tuple[int, int] | None = None
    api_address: str | None = None
    started_at: float = field(default_factory=time.time)
    layer_map: dict[int, list[LayerRecord]] = field(default_factory=dict)
    layer_map_at: float = 0.0
    layer_map_lock: trio.Lock = field(default_factory=trio.Lock)

    def addrs(self) -> list[str]:
        return [str(a) for a in self.host.get_addrs()] if self.host else []

    async def stats_json(self, params: dict) -> dict:
        return self.stats()

    async def layers_json(self, params: dict) -> dict:
        await current_layer_map(self)
        return self.layers_doc()

    async def ping_json(self, params: dict) -> dict:
        """/api/ping?peer=<peer id or multiaddr>&bytes=N[&fresh=1][&upgrade_wait=S]: reach a peer
        (anew with fresh=1) and measure the path; see net/probe.py."""
        peer, addrs = await resolve_peer(self, params.get("peer", ""))
        try:
            nbytes = int(params.get("bytes", "0"))
        except ValueError:
            raise ConfigError(f"bytes must be an integer, not {params['bytes']!r}") from None
        if not 0 <= nbytes <= probe.MAX_PROBE_BYTES:
            raise ConfigError(f"bytes must be between 0 and {probe.MAX_PROBE_BYTES}")
        try:
            upgrade_wait = float(params.get("upgrade_wait", "0"))
        except ValueError:
            raise ConfigError(f"upgrade_wait must be seconds, not {params['upgrade_wait']!r}") from None
        if not 0 <= upgrade_wait <= MAX_UPGRADE_WAIT:
            raise ConfigError(f"upgrade_wait must be between 0 and {MAX_UPGRADE_WAIT:.0f} s")
        result = await probe.probe(self.host, self.connector, self.control, peer, addrs, nbytes,
                                   fresh=params.get("fresh") == "1", upgrade_wait=upgrade_wait)
        return result.doc()

    def stats(self) -> dict:
        index, control = self.index, self.control
        lookups = sorted(index.stats.lookup_seconds) if index else []
        return {
            "version": __version__,
            "peer_id": self.identity.peer_id_text,
            "role": self.config.role.value,
            "addrs": self.addrs(),
            "reachability": self.reachability.verdict(time.time()).value,
            "reachable_addrs": self.reachability.reachable_addresses(time.time()),
            "stun": None if self.stun is None else {
                "nat_type": self.stun.nat_type.value,
                "public": f"{self.stun.public[0]}:{self.stun.public[1]}" if self.stun.public else None,
                "packets_sent": self.stun.packets_sent,
            },
            "dht_mode": "server" if index and index.server else "client",
            "uptime_s": round(time.time() - self.started_at, 1),
            "model": self.model.name,
            "layers": list(self.layers) if self.layers else None,
            "connected_peers": sorted(str(p) for p in self.host.get_connected_peers()) if self.host else [],
            "routing_table_size": self.kad.get_routing_table_size() if self.kad else 0,
            "records_held": index.store.entry_count() if index else 0,
            "discovery": {
                "announces": index.stats.announces if index else 0,
                "stores_accepted": index.stats.stores_accepted if index else 0,
                "stores_failed": index.stats.stores_failed if index else 0,
                "lookups": index.stats.lookups if index else 0,
                "lookup_p50_ms": round(1000 * lookups[len(lookups) // 2], 1) if lookups else None,
                "invalid_records": index.stats.invalid_records if index else 0,
            },
            "control": vars(control.stats) if control else {},
            "connect": self.connector.stats.summary() if self.connector else {},
            "holepunch": punch_stats(self.holepunch),
            "relay": self.relay.book.stats(time.monotonic()) if self.relay is not None else None,
            "relays": self.relay_picker.stats(time.time()) if self.relay_picker is not None else [],
            "circuit_addrs": [f"{a}/p2p/{self.identity.peer_id_text}" for a in self.circuit_addrs],
        }

    def layers_doc(self) -> dict:
        return {
            "model": self.model.name,
            "n_layers": self.model.n_layers,
            "updated_at": self.layer_map_at,
            "layers": {
                str(layer): [
                    {"peer_id": r.peer_id, "start": r.start, "end": r.end, "addrs": list(r.addrs),
                     "queue_depth": r.capacity.queue_depth, "free_memory_mb": r.capacity.free_memory_mb,
                     "expires_in_s": round(r.expires_at - time.time(), 1)}
                    for r in records
                ]
                for layer, records in self.layer_map.items()
            },
        }


async def resolve_peer(state: NodeState, text: str) -> tuple[str, tuple[str, ...]]:
    """A peer id and the addresses to try: from a full multiaddr, or from the layer map for an id."""
    if not text:
        raise ConfigError("say which peer: ?peer=<peer id or multiaddr ending in /p2p/<id>>")
    if text.startswith("/"):
        parse_multiaddr(text)
        head, sep, peer = text.rpartition("/p2p/")
        if not sep or "/" in peer:
            raise ConfigError(f"multiaddr {text} must end in /p2p/<peer id>")
        return peer, (head,) if head else ()
    layer_map = await current_layer_map(state)
    addrs = [a for records in layer_map.values() for r in records if r.peer_id == text for a in r.addrs]
    return text, tuple(dict.fromkeys(addrs))


def free_memory_mb() -> int:
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // (1024 * 1024)
    except (ValueError, OSError):
        return 0


MAX_RECORD_ADDRS = 8  # addresses in a layer record; well inside the record's size limit


def record_addrs(addrs: list[str], limit: int = MAX_RECORD_ADDRS, public: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The addresses a layer record carries: those dial-backs confirmed first, then relay
    circuits, since a NATed peer's own listen addresses (listed first by the host) are the ones
    nobody outside can dial."""
    def rank(addr: str) -> int:
        return 0 if addr.split("/p2p/")[0] in public else 1 if "/p2p-circuit" in addr else 2

    return tuple(sorted(addrs, key=rank)[:limit])


def make_record(state: NodeState, now: float) -> LayerRecord:
    start, end = state.layers
    return LayerRecord(
        peer_id=state.identity.peer_id_text,
        addrs=record_addrs(state.addrs(), public=tuple(state.public_addrs)),
        model=state.model.name,
        start=start,
        end=end,
        capacity=Capacity(free_memory_mb=free_memory_mb(), queue_depth=0, flags=0),
        timestamp=now,
        ttl=RECORD_TTL,
    )


async def serve_announcements(state: NodeState) -> None:
    """Re-announce our layer record every ANNOUNCE_PERIOD, well before its TTL runs out."""
    while True:
        record = make_record(state, time.time())
        try:
            accepted = await state.index.announce(record, sign_record(record, state.identity))
        except Exception:  # one failed round must not stop the node; the next one retries
            log.exception("announcing layers [%d, %d) failed; retrying in %.0f s",
                          record.start, record.end, ANNOUNCE_PERIOD)
        else:
            log.info("announced layers [%d, %d) of %s: %d store(s) accepted",
                     record.start, record.end, record.model, accepted)
        await trio.sleep(ANNOUNCE_PERIOD)


async def refresh_layer_map(state: NodeState) -> None:
    state.layer_map = await state.index.layer_map(state.model)
    state.layer_map_at = time.time()


async def current_layer_map(state: NodeState) -> dict[int, list[LayerRecord]]:
    """The layer map, rebuilt when older than LAYER_MAP_PERIOD.

    Built on demand rather than in a loop: a full map costs one lookup per layer, and a node
    nobody asks should not spend that every few seconds. A rebuild that overruns its bound
    leaves the previous map in place.
    """
    async with state.layer_map_lock:
        if time.time() - state.layer_map_at >= LAYER_MAP_PERIOD:
            with trio.move_on_after(LAYER_MAP_BUILD_TIMEOUT):
                await refresh_layer_map(state)
    return state.layer_map


async def choose_layers(state: NodeState, rng: random.Random) -> tuple[int, int]:
    if state.config.layers is not None:
        return state.config.layers
    await refresh_layer_map(state)
    replicas = {layer: len(records) for layer, records in state.layer_map.items()}
    chosen = least_served_stage(state.model, replicas, rng)
    log.info("--layers auto: chose [%d, %d), the least-served stage", *chosen)
    return chosen


async def ask_stun(state: NodeState) -> None:
    """One bounded STUN classification at start-up (pystun3-style floods are impossible here)."""
    state.stun = await classify_nat(state.config.stun)
    log.info("STUN %s:%d: NAT type %s, public UDP address %s (%d packets)", *state.config.stun,
             state.stun.nat_type.value, state.stun.public, state.stun.packets_sent)


async def connect_to_known_peers(state: NodeState, rng: random.Random, want: int) -> None:
    """Connect (directly) to up to ``want`` peers of the layer map we are not connected to.

    A joining peer starts as a DHT client and talks to the bootstrap peers only; reachability
    needs two dial-back servers, so it meets a few of the swarm's other peers.
    """
    connected = {str(p) for p in state.host.get_connected_peers()} | {state.identity.peer_id_text}
    layer_map = await current_layer_map(state)
    records = {r.peer_id: r for rs in layer_map.values() for r in rs if r.peer_id not in connected}
    chosen = rng.sample(sorted(records), min(want, len(records)))

    async def meet(peer: str) -> None:
        try:
            await state.connector.connect(peer, records[peer].addrs, via_relay=False)
        except DialError:
            pass  # a NATed peer: someone else will do

    async with trio.open_nursery() as nursery:
        for peer in chosen:
            nursery.start_soon(meet, peer)


async def on_reachability(state: NodeState, verdict: Reachability) -> None:
    """Log a new verdict; with --dht-mode auto, a joining peer is a DHT server once PUBLIC and a
    client once PRIVATE (UNKNOWN changes nothing).

    A joining peer holds relay reservations from the first PRIVATE verdict until a PUBLIC one
    (UNKNOWN keeps whatever runs: a verdict that lapsed says nothing new about the NAT).
    """
    log.info("reachability: %s", verdict.value)
    confirmed = state.reachability.reachable_addresses(time.time()) if verdict is Reachability.PUBLIC else []
    public = [a for a in confirmed if a not in listen_addrs(state.host)]  # e.g. a DMZ router's address
    if public != state.public_addrs:
        log.info("advertising dial-back-confirmed address(es): %s", ", ".join(public) or "none")
        state.public_addrs = public
        _publish_extra_addrs(state)
    if state.config.dht_mode is DhtMode.AUTO and state.config.role is Role.JOIN and verdict is not Reachability.UNKNOWN:
        await state.index.set_server(verdict is Reachability.PUBLIC)
    if state.config.role is Role.JOIN:
        if verdict is Reachability.PRIVATE:
            start_relay_reservations(state)
        elif verdict is Reachability.PUBLIC:
            stop_relay_reservations(state)


def _set_circuit_addrs(state: NodeState, addrs: list[str]) -> None:
    state.circuit_addrs = list(addrs)
    _publish_extra_addrs(state)


def _publish_extra_addrs(state: NodeState) -> None:
    """Advertise, besides the listen addresses: confirmed public ones (a port-forwarding or DMZ
    router's address, which the host cannot see) and relay circuits."""
    set_extra_addrs(state.host, state.public_addrs + state.circuit_addrs)
    if state.nursery is not None:
        state.nursery.start_soon(push_identify, state.host)  # peers learn the new addresses now


def start_relay_reservations(state: NodeState) -> None:
    if state.relay_scope is not None or state.relay_picker is None or state.nursery is None:
        return
    scope = state.relay_scope = trio.CancelScope()

    async def run() -> None:
        with scope:
            await serve_relay_reservations(state.host, state.relay_picker,
                                           functools.partial(_set_circuit_addrs, state))
        _set_circuit_addrs(state, [])

    log.info("relay client: behind a NAT, reserving on relays")
    state.nursery.start_soon(run)


def stop_relay_reservations(state: NodeState) -> None:
    if state.relay_scope is not None:
        log.info("relay client: reachable, dropping relay reservations")
        state.relay_scope.cancel()
        state.relay_scope = None


async def start_holepunch(host, nursery: trio.Nursery) -> HolePunchService:
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


async def run_node(config: NodeConfig, *, on_listening: Callable[[list[str]], None] = lambda addrs: None,
                   rng: random.Random | None = None, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Run a node until cancelled."""
    rng = rng or random.Random()
    model = get_model(config.model)
    bootstrap_infos = [peer_info_from_multiaddr(a) for a in config.bootstrap]
    identity = load_or_create_key(config.resolved_key_path())
    state = NodeState(identity=identity, config=config, model=model)
    async with open_host(identity, config.listen) as host, trio.open_nursery() as nursery:
        state.host = host
        state.nursery = nursery
        if config.role is Role.JOIN:
            state.relay_picker = RelayPicker(rng)
            for relay in config.relays:
                state.relay_picker.add_candidate(str(peer_info_from_multiaddr(relay).peer_id), [relay])
        log.info("peer %s listening on %s", identity.peer_id_text, ", ".join(state.addrs()))
        on_listening(state.addrs())
        state.connector = Connector(host, nursery)
        state.control = ControlService(host, nursery, state.connector)
        probe.register(host, state.control)
        if config.role is Role.JOIN:
            state.holepunch = await start_holepunch(host, nursery)
        state.autonat = AutonatService(host, nursery, rng)
        await nursery.start(state.autonat.serve_dialer)
        if config.role is Role.RELAY:
            state.relay = await nursery.start(serve_relay, host, config.relay or RelayConfig())
        if config.stun:
            nursery.start_soon(ask_stun, state)
        async with open_kademlia(host, config.dht_server) as kad:
            state.kad = kad
            state.index = LayerIndex(host, kad, state.control, RecordStore(), server=config.dht_server)
            reached = await join_network(host, kad, bootstrap_infos, BOOTSTRAP_DIAL_TIMEOUT)
            log.info("joined the DHT through %d bootstrap peer(s); routing table holds %d",
                     reached, kad.get_routing_table_size())
            if config.api:
                state.api_address = await nursery.start(serve_api, config.api, {
                    "/api/stats": state.stats_json, "/api/layers": state.layers_json,
                    "/api/ping": state.ping_json})
            nursery.start_soon(state.index.serve_store_pruning)
            nursery.start_soon(serve_routing_upkeep, host, kad, bootstrap_infos)
            nursery.start_soon(functools.partial(
                serve_reachability, host, state.autonat, state.reachability, rng,
                functools.partial(on_reachability, state),
                find_servers=functools.partial(connect_to_known_peers, state, rng)))
            if config.serves_layers:
                state.layers = await choose_layers(state, rng)
                nursery.start_soon(serve_announcements, state)
            task_status.started(state)
            await trio.sleep_forever()

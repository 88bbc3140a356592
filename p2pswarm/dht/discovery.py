"""Stage discovery driver: announce our stage record, look up who serves a stage.

Kademlia (py-libp2p's ``/ipfs/kad/1.0.0``) finds the peers closest to a stage key; our record
protocol (``dht.protocol``) stores the signed record on them and fetches records back. A
reader verifies every record itself, merges the answers of all closest peers per author
(newest wins), drops stale ones, and ranks the rest (``dht.ranking``: our own record first, then
peers the caller vouches for, then strangers, a few per address before the others).

Workarounds for py-libp2p's DHT live here: bootstrap peers are added to the routing table
explicitly after dialling (the table only learns peers that contact it), and a peer that fails
to answer is removed from the routing table (dead peers are never evicted otherwise).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import trio

from p2pswarm.dht.closest import ClosestPeersCache
from p2pswarm.dht.holds import RequestHolds
from p2pswarm.dht.protocol import FetchRecords, FetchReply, StoreRecord, StoreReply, handle_fetch, handle_store
from p2pswarm.dht.ranking import Standing, pool
from p2pswarm.dht.record_codec import verify_record
from p2pswarm.dht.records import MAX_TTL, UNNAMED_RUN, StageRecord, stage_key
from p2pswarm.dht.store import MAX_CLOCK_SKEW, RecordStore
from p2pswarm.errors import DialError, ProtocolError, StartupError
from p2pswarm.net.connect import as_peer_id, remote_ip
from p2pswarm.net.control import ControlService
from p2pswarm.net.host import connect
from p2pswarm.wire import ErrorReply, Message

if TYPE_CHECKING:  # libp2p is imported when a host is built
    from libp2p.kad_dht.kad_dht import KadDHT

log = logging.getLogger(__name__)

REPLICATION = 3  # closest peers that hold each stage key; survives two of them dying at once
READ_WIDTH = 5  # closest peers a reader asks: wider than REPLICATION, as views of "closest" differ
LOOKUP_WIDTH = 8  # closest peers asked of Kademlia, so enough servers remain after filtering
KADEMLIA_PROTOCOL = "/ipfs/kad/1.0.0"
LOOKUP_TIMEOUT = 3.0  # per closest-peer fetch; hivemind's DHT timeout is 3 s
DEFAULT_K = 8  # records a lookup returns; the router needs a few live candidates per stage
RECORD_TTL = 15.0  # a SIGKILLed peer vanishes from the stage map within this long
ANNOUNCE_PERIOD = 5.0  # three announcements per TTL: one lost announce never expires a live peer
STAGE_MAP_PERIOD = 5.0  # how often the cached stage map shown by the API is rebuilt
UNKNOWN_SOURCE = "?"  # source address of a store whose connection shows none: one shared bucket
PRUNE_PERIOD = 10.0  # how often expired records are dropped from the local store
ROUTING_CHECK_PERIOD = 10.0  # how often a node checks that its routing table is not (nearly) empty
MIN_ROUTING_PEERS = REPLICATION  # fewer than this and records cannot reach their closest peers


def announce_ttl(ttl: float, cut: bool) -> float:
    """The TTL of our next record, after an announcement that was ``cut`` (no store took it: cut at
    ANNOUNCE_PERIOD, failed, or refused everywhere) or not:
    RECORD_TTL while announcements get through in time; doubled after each cut one, up to MAX_TTL
    (RFC 6298's backoff, for records). On a 0.2 Mbit/s uplink full of training frames the stores' round
    trips wait seconds in its queue: three cut announcements in a row expired a live peer's record in
    every store, and the stage maps reported its stage degraded while it trained. A record that lives
    longer needs only one announcement in several to get through; a dead peer on such a line takes up
    to MAX_TTL to vanish, on a line that carries its announcements in time still RECORD_TTL."""
    return min(MAX_TTL, 2 * ttl) if cut else RECORD_TTL


@asynccontextmanager
async def open_kademlia(host, server: bool) -> AsyncIterator[KadDHT]:
    """Run py-libp2p's Kademlia DHT in server or client mode for the life of the block."""
    from libp2p.kad_dht.kad_dht import DHTMode, KadDHT
    from libp2p.tools.anyio_service import background_trio_service

    kad = KadDHT(host, DHTMode.SERVER if server else DHTMode.CLIENT, enable_random_walk=False)
    add_peer = kad.add_peer

    async def add_servers_only(peer_id, *, skip_server_mode_check: bool = False) -> bool:
        # py-libp2p adds every peer that opens a Kademlia stream ("so they MUST support KAD
        # server mode"), but clients query too: NATed clients then fill servers' tables and
        # every lookup waits on them. Check identify's protocol list always.
        return await add_peer(peer_id, skip_server_mode_check=False)

    kad.add_peer = add_servers_only  # type: ignore[method-assign]  # patching py-libp2p's KadDHT, see above
    async with background_trio_service(kad):
        yield kad


async def push_identify(host) -> None:
    """Tell connected peers our protocols and addresses changed (identify/push)."""
    push = getattr(host, "_push_identify_to_all_peers", None)
    if push is not None:
        with trio.move_on_after(LOOKUP_TIMEOUT):
            await push()


async def join_network(host, kad, bootstrap_infos, timeout: float) -> int:
    """Dial the bootstrap peers, add them to the routing table, refresh it; count reached."""
    reached = 0
    for info in bootstrap_infos:
        try:
            await connect(host, info, timeout)
        except DialError as exc:
            log.warning("bootstrap peer unreachable: %s (check the --bootstrap address and that the node is up)", exc)
            continue
        await kad.add_peer(info.peer_id)
        reached += 1
    if bootstrap_infos and not reached:
        raise StartupError(f"none of the {len(bootstrap_infos)} bootstrap peer(s) could be reached")
    if reached:
        with trio.move_on_after(timeout):
            await kad.peer_routing.refresh_routing_table()
    return reached


async def serve_routing_upkeep(host, kad, bootstrap_infos) -> None:
    """Re-join through the bootstrap peers whenever the routing table runs low.

    py-libp2p removes a peer from the routing table when one FIND_NODE stream to it fails; in a
    burst of joins that can empty a node's table (bootstrap peers included) and cut it off from
    the DHT for good. Checking every ROUTING_CHECK_PERIOD heals such a node within seconds.
    Peers that turned out to be clients (see ``known_client``) are dropped on the same round.
    """
    while True:
        await trio.sleep(ROUTING_CHECK_PERIOD)
        drop_clients(host, kad)
        size = kad.get_routing_table_size()
        if bootstrap_infos and size < MIN_ROUTING_PEERS:
            log.info("routing table holds only %d peer(s); re-joining through the bootstrap peers", size)
            try:
                await join_network(host, kad, bootstrap_infos, ROUTING_CHECK_PERIOD)
            except StartupError as exc:
                log.warning("re-join failed, will retry: %s", exc)


def advertises_kademlia(host, peer_id) -> bool:
    """Whether identify (or its push) lists the Kademlia protocol for ``peer_id`` now: a DHT server."""
    try:
        return KADEMLIA_PROTOCOL in host.get_peerstore().get_protocols(peer_id)
    except Exception:  # unknown peer: no identify yet
        return False


def known_client(host, peer_id) -> bool:
    """A peer that cannot hold records: identify lists no Kademlia, or it advertises relay
    circuits (only an unreachable peer does, and it runs as a DHT client)."""
    peerstore = host.get_peerstore()
    try:
        protocols = peerstore.get_protocols(peer_id)
        addrs = peerstore.addrs(peer_id)
    except Exception:  # unknown peer: no identify yet, give it the benefit of the doubt
        return False
    if any("/p2p-circuit" in str(a) for a in addrs):
        return True
    return bool(protocols) and KADEMLIA_PROTOCOL not in protocols


def drop_clients(host, kad) -> int:
    """Remove known clients from the routing table: they entered before identify said so, and
    every lookup that asks them waits out a dial to an address nobody can reach."""
    dropped = 0
    for peer_id in kad.routing_table.get_peer_ids():
        if known_client(host, peer_id):
            kad.routing_table.remove_peer(peer_id)
            dropped += 1
    return dropped


@dataclass
class DiscoveryStats:
    announces: int = 0
    stores_accepted: int = 0
    stores_failed: int = 0
    lookups: int = 0
    lookup_seconds: list[float] = field(default_factory=list)
    invalid_records: int = 0


class StageIndex:
    """Announce and look up stage records over the Kademlia-closest peers of each stage key."""

    def __init__(self, host, kad, control: ControlService, store: RecordStore, *, server: bool,
                 clock: Callable[[], float] = time.time) -> None:
        self._host, self._kad, self._control, self.store = host, kad, control, store
        self.server = server  # may change with reachability (see set_server)
        self._clock = clock
        self.stats = DiscoveryStats()
        self._holds = RequestHolds()  # peers left out of requests for a while (failed, or DHT clients)
        self._closest = ClosestPeersCache(want=REPLICATION)  # writers only: readers always search
        control.handle(StoreRecord, self._on_store)
        control.handle(FetchRecords, self._on_fetch)

    @property
    def me(self) -> str:
        """Our own peer id, as records spell it."""
        return str(self._host.get_id())

    def own_first(self, peer: str) -> Standing:
        """The standing a lookup gives a record when its caller knows nothing more."""
        return Standing.OWN if peer == self.me else Standing.STRANGER

    async def set_server(self, server: bool) -> None:
        """Switch Kademlia and the record service between server and client mode."""
        from libp2p.kad_dht.kad_dht import DHTMode

        if server != self.server:
            self.server = server
            await self._kad.switch_mode(DHTMode.SERVER if server else DHTMode.CLIENT)
            log.info("DHT mode: %s", "server" if server else "client")
            await push_identify(self._host)  # so servers drop us from their tables (see _may_hold_records)

    async def _on_store(self, peer: str, message: StoreRecord) -> StoreReply | ErrorReply:
        if not self.server:
            return ErrorReply(code="unsupported", detail="DHT client: holds no records")
        ip = remote_ip(self._host, as_peer_id(peer)) or UNKNOWN_SOURCE
        return handle_store(self.store, message, self._clock(), peer, ip)

    async def _on_fetch(self, peer: str, message: FetchRecords) -> FetchReply | ErrorReply:
        if not self.server:
            return ErrorReply(code="unsupported", detail="DHT client: holds no records")
        return handle_fetch(self.store, message, self._clock())

    async def store_targets(self, key: bytes) -> list:
        """Where to store a record: the REPLICATION closest peers, remembered for a while."""
        cached = self._closest.get(key, self._clock())
        if cached is not None:
            return list(cached)
        closest = await self.closest_peers(key, REPLICATION)
        self._closest.put(key, closest, self._clock())
        return closest

    async def closest_peers(self, key: bytes, count: int = REPLICATION) -> list:
        """The ``count`` peers closest to ``key``, ourselves included when we are a server."""
        from libp2p.kad_dht.utils import sort_peer_ids_by_distance

        drop_clients(self._host, self._kad)
        found = None
        with trio.move_on_after(LOOKUP_TIMEOUT):
            try:
                found = await self._kad.peer_routing.find_closest_peers_network(key, LOOKUP_WIDTH)
            except trio.Cancelled:
                raise
            except Exception as exc:  # py-libp2p's lookup raises assorted errors on dead peers
                log.debug("closest-peer lookup failed, using the local table: %s", exc)
        if found is None:
            found = self._kad.routing_table.find_local_closest_peers(key, LOOKUP_WIDTH)
        me = self._host.get_id()
        candidates = [p for p in found if p != me and self._may_hold_records(p)] + ([me] if self.server else [])
        return sort_peer_ids_by_distance(key, candidates)[:count]

    def _may_hold_records(self, peer_id) -> bool:
        """False for peers known to be DHT clients: their identify lists no Kademlia, they said so,
        or they advertise relay circuits (only an unreachable peer does, and it is a client)."""
        if self._holds.held(peer_id, self._clock(), advertises_kademlia(self._host, peer_id)):
            return False  # other servers' answers would otherwise offer it again at once (dht.holds)
        return not known_client(self._host, peer_id)

    def _forget(self, peer_id, exc: Exception) -> None:
        """A stage-record request to ``peer_id`` failed: out of the routing table, held out of requests."""
        log.debug("peer %s failed a stage-record request, removing it from the routing table: %s", peer_id, exc)
        self._drop(peer_id)
        self._holds.failed(peer_id, self._clock())

    def _drop(self, peer_id) -> None:
        self._kad.routing_table.remove_peer(peer_id)
        self._closest.forget_peer(peer_id)

    def _heard(self, peer_id, reply: Message) -> None:
        """``peer_id`` answered a stage-record request: reachable. An "unsupported" answer is a DHT client's
        (py-libp2p lets client-mode peers into servers' routing tables): it holds no records."""
        if peer_id == self._host.get_id():
            return
        if isinstance(reply, ErrorReply) and reply.code == "unsupported":
            log.debug("peer %s is a DHT client, removing it from the routing table", peer_id)
            self._drop(peer_id)
            self._holds.said_not_server(peer_id, self._clock())
        else:
            self._holds.answered(peer_id)

    async def announce(self, record: StageRecord, signed: bytes) -> int:
        """Store our signed record on the closest peers of its stage key; count acceptances."""
        self.stats.announces += 1
        accepted = 0
        message = StoreRecord(record=signed)
        me = self._host.get_id()

        async def store_on(peer_id) -> None:
            nonlocal accepted
            reply: Message
            try:
                if peer_id == me:
                    reply = handle_store(self.store, message, self._clock(), str(me))
                else:
                    reply = await self._control.request(peer_id, message, LOOKUP_TIMEOUT, via_relay=False)
            except DialError as exc:
                self.stats.stores_failed += 1
                return self._forget(peer_id, exc)
            self._heard(peer_id, reply)
            if isinstance(reply, StoreReply) and reply.accepted:
                accepted += 1
                self.stats.stores_accepted += 1
            else:
                self.stats.stores_failed += 1
                log.debug("peer %s did not keep our record for stage %d: %s", peer_id, record.stage, reply)

        async with trio.open_nursery() as nursery:
            for peer_id in await self.store_targets(stage_key(record.model, record.stage, record.run)):
                nursery.start_soon(store_on, peer_id)
        return accepted

    async def lookup_stage(self, model: str, stage: int, k: int = DEFAULT_K,
                           standing: Callable[[str], Standing] | None = None,
                           run: str = UNNAMED_RUN) -> list[StageRecord]:
        """Up to ``k`` fresh records of peers serving ``stage`` of ``model`` in run ``run``, best first by
        ``standing`` (default: our own record, then strangers), crowded strangers last (``dht.ranking``)."""
        started = time.perf_counter()
        self.stats.lookups += 1
        newest: dict[str, StageRecord] = {}
        request = FetchRecords(model=model, stage=stage, limit=k, run=run)

        async def fetch_from(peer_id) -> None:
            reply: Message
            if peer_id == self._host.get_id():
                reply = handle_fetch(self.store, request, self._clock())
            else:
                try:
                    reply = await self._control.request(peer_id, request, LOOKUP_TIMEOUT, via_relay=False)
                except DialError as exc:
                    return self._forget(peer_id, exc)
            self._heard(peer_id, reply)
            for raw in reply.records if isinstance(reply, FetchReply) else ():
                self._merge(newest, raw, (run, model, stage), self._clock())

        async with trio.open_nursery() as nursery:
            for peer_id in await self.closest_peers(stage_key(model, stage, run), READ_WIDTH):
                nursery.start_soon(fetch_from, peer_id)
        now = self._clock()
        fresh = [r for r in newest.values() if r.is_fresh(now)]
        self.stats.lookup_seconds = [*self.stats.lookup_seconds, time.perf_counter() - started][-100:]
        return pool(fresh, standing or self.own_first, k)

    def _merge(self, newest: dict[str, StageRecord], raw: bytes, asked: tuple[str, str, int], now: float) -> None:
        """Keep a fetched record if it is valid, of the (run, model, stage) ``asked``, dated at most
        MAX_CLOCK_SKEW past ``now`` (as a store checks: a hostile store could serve a record its author
        dated years ahead, fresh for good and the newest of its peer forever), and the newest of its peer."""
        try:
            record = verify_record(raw)
        except ProtocolError:
            self.stats.invalid_records += 1
            return
        if (record.run, record.model, record.stage) != asked or record.timestamp > now + MAX_CLOCK_SKEW:
            self.stats.invalid_records += 1  # another run's (or stage's) record, or one from the future
            return
        held = newest.get(record.peer_id)
        if held is None or record.timestamp > held.timestamp:
            newest[record.peer_id] = record

    def stats_doc(self) -> dict:
        """What /api/stats shows of discovery."""
        lookups = sorted(self.stats.lookup_seconds)
        return {
            "announces": self.stats.announces,
            "stores_accepted": self.stats.stores_accepted,
            "stores_failed": self.stats.stores_failed,
            "lookups": self.stats.lookups,
            "lookup_p50_ms": round(1000 * lookups[len(lookups) // 2], 1) if lookups else None,
            "invalid_records": self.stats.invalid_records,
            "records_held": self.store.entry_count(),
        }

    async def serve_store_pruning(self) -> None:
        while True:
            await trio.sleep(PRUNE_PERIOD)
            self.store.prune(self._clock())

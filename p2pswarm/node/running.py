"""A running node: the services of its role composed in one nursery.

``run_node`` builds the host and starts each service (control channel, connector, NAT
traversal, DHT and stage index, announcements, API) in one nursery; there are no service
classes or inheritance. Each service keeps its own state, exposes its own stats and routes,
and takes its decisions in a pure policy module (``nat.policy``, ``dht.announce``,
``model.catalog``); this module only wires them together. It reports
``task_status.started(state)`` once the node is listening, has joined the DHT and (for a
trainer) has chosen its stage and serves it.

A trainer's stage services (candidate checks of the neighbour stages, ``SwarmService`` with its
``DilocoService``) live in one cancellable scope per stage (``_serve_stages``): a move
(``heal.mover``) cancels it and starts it again for the new stage, with a new engine and handlers.
"""

from __future__ import annotations

import functools
import logging
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import trio

from p2pswarm import __version__, wire
from p2pswarm.allocator import imports_without_collections
from p2pswarm.api.http import Routes
from p2pswarm.api.metrics import metrics_route
from p2pswarm.api.serve import open_api_listeners, serve_api
from p2pswarm.dht.announce import capacity_flags, stage_record
from p2pswarm.dht.announcing import serve_announcements
from p2pswarm.dht.discovery import (
    RECORD_TTL,
    StageIndex,
    join_network,
    open_kademlia,
    push_identify,
    serve_routing_upkeep,
)
from p2pswarm.dht.health import serve_health_watch
from p2pswarm.dht.record_codec import sign_record
from p2pswarm.dht.records import FLAG_GPU, FLAG_PINNED, FLAG_SNAPSHOT, Capacity, StageRecord
from p2pswarm.dht.stagemap import (
    StageMap,
    check_every_stage,
    choose_stage,
    control_round_trip,
    meet_peers,
    neighbour_stages,
    serve_candidate_checks,
)
from p2pswarm.dht.store import RecordStore
from p2pswarm.dht.work import MIN_WORK
from p2pswarm.diloco import messages, snapshots
from p2pswarm.errors import LocalProtocolError
from p2pswarm.heal.mover import Mover
from p2pswarm.heal.rebalance import Rebalancer
from p2pswarm.identity import Identity, load_or_create_key
from p2pswarm.model.catalog import ModelSpec
from p2pswarm.model.tokenizer import load_tokenizer
from p2pswarm.net import probe
from p2pswarm.net.connect import Connector
from p2pswarm.net.control import ControlService
from p2pswarm.net.guard import guard_stats
from p2pswarm.net.host import HostLimits, open_host, peer_info_from_multiaddr
from p2pswarm.net.pool import StreamPool
from p2pswarm.net.probe_api import PingRoute
from p2pswarm.net.swarm_fixes import inbound_stats
from p2pswarm.node.config import BOOTSTRAP_DIAL_TIMEOUT, NodeConfig, Role
from p2pswarm.node.memory import serve_memory_upkeep
from p2pswarm.node.summary import log_summaries
from p2pswarm.node.traversal import NatTraversal
from p2pswarm.run.placement import free_device_memory_mb
from p2pswarm.run.spec import RunSpec
from p2pswarm.swarm import activation, inference
from p2pswarm.swarm.generation import SwarmCompleter
from p2pswarm.swarm.status import reported_losses

if TYPE_CHECKING:  # libp2p is imported when a host is built; the services import torch (a training peer only)
    from libp2p.abc import IHost
    from libp2p.kad_dht.kad_dht import KadDHT

    from p2pswarm.diloco.backup_service import BackupService
    from p2pswarm.diloco.service import DilocoService
    from p2pswarm.swarm.service import SwarmService

log = logging.getLogger(__name__)


@dataclass
class NodeState:
    """The node's services, as composed by ``run_node``; read by the status API and tests."""

    identity: Identity
    config: NodeConfig
    model: ModelSpec
    run: RunSpec | None = None  # what we train (config.run): its identity keys our records
    host: IHost | None = None
    kad: KadDHT | None = None
    control: ControlService | None = None
    pool: StreamPool | None = None  # bulk streams: activations, gradients, shards, snapshots
    connector: Connector | None = None
    nat: NatTraversal | None = None
    index: StageIndex | None = None
    stage_map: StageMap | None = None
    stage: int | None = None
    api_address: str | None = None
    load_sources: list[Callable[[], int]] = field(default_factory=list)  # queued work, summed in records
    swarm: SwarmService | None = None  # the SwarmService training our stage (p2pswarm.swarm.service), join only
    diloco: DilocoService | None = None  # its outer rounds and snapshots (p2pswarm.diloco.service), join only
    completer: SwarmCompleter | None = None  # text generation through the swarm, once joined
    backups: BackupService | None = None  # other stages' backups we hold (p2pswarm.diloco.backup_service), join only
    mover: Mover | None = None  # moves us to an under-served stage (join --rebalance)
    moved_from: set[int] = field(default_factory=set)  # stages we served before a move: their tensors get "moved"
    started_at: float = field(default_factory=time.time)

    def addrs(self) -> list[str]:
        return [str(a) for a in self.host.get_addrs()] if self.host else []

    @property
    def layers(self) -> tuple[int, int] | None:
        return self.model.stage_range(self.stage) if self.stage is not None else None

    def stats(self) -> dict:
        index = self.index
        return {
            "version": __version__,
            "peer_id": self.identity.peer_id_text,
            "role": self.config.role.value,
            "addrs": self.addrs(),
            **(self.nat.stats_doc(self.identity.peer_id_text) if self.nat else {}),
            "dht_mode": "server" if index and index.server else "client",
            "uptime_s": round(time.time() - self.started_at, 1),
            "model": self.model.name,
            "run": {"name": self.run.name, "identity": self.run.identity} if self.run else None,
            "stage": self.stage,
            "layers": list(self.layers) if self.layers else None,
            "capacity": vars(self.capacity()) if self.stage is not None else None,
            "rebalance": self.mover.doc() if self.mover else None,
            "connected_peers": sorted(str(p) for p in self.host.get_connected_peers()) if self.host else [],
            "routing_table_size": self.kad.get_routing_table_size() if self.kad else 0,
            "records_held": index.store.entry_count() if index else 0,
            "discovery": index.stats_doc() if index else {},
            "control": vars(self.control.stats) if self.control else {},
            "connect": self.connector.stats.summary() if self.connector else {},
            "pool": self.pool.status() if self.pool else {},
            "streams": guard_stats(self.host) if self.host else {},
            "inbound_connections": inbound_stats(self.host) if self.host else {},
        }

    async def stats_json(self, params: dict) -> dict:
        return self.stats()

    def capacity(self) -> Capacity:
        """Our live capacity: free memory (the accelerator's when we compute on one), queued work,
        and flags from role, reachability and device."""
        private = self.nat is not None and self.nat.private
        flags = capacity_flags(training=self.config.role is Role.JOIN, private=private)
        flags |= FLAG_PINNED if self.config.serves_layers and not self.config.rebalance else 0
        device = self.config.training.placement.device
        on_device = self.config.serves_layers and device != "cpu"
        free = free_device_memory_mb(device) if on_device else free_memory_mb()
        train, heldout = reported_losses(self.swarm) if self.swarm else (0.0, 0.0)  # shown on dashboards
        return Capacity(free_memory_mb=free, queue_depth=sum(load() for load in self.load_sources),
                        flags=flags | (FLAG_SNAPSHOT if self.diloco else 0) | (FLAG_GPU if on_device else 0),
                        throughput=round(self.swarm.throughput(), 1) if self.swarm else 0.0,
                        outer_round=self.diloco.outer_round() if self.diloco else 0, train_loss_bpb=train,
                        heldout_bpb=heldout)

    def signed_record(self, now: float, ttl: float = RECORD_TTL) -> tuple[StageRecord, bytes]:
        assert self.nat is not None and self.run is not None and self.stage is not None, \
            "set by run_node and _join_dht before our stage is announced"
        record = stage_record(self.identity.peer_id_text, self.addrs(), tuple(self.nat.public_addrs), self.model,
                              self.stage, self.capacity(), now, ttl, run=self.run.identity,
                              agreed=self.diloco.loader.agreed_claim() if self.diloco else None,
                              backups=self.backups.claims() if self.backups else (),
                              worked=self.stage_map.work.attested(now) if self.stage_map else ())
        return record, sign_record(record, self.identity)


def free_memory_mb() -> int:
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // (1024 * 1024)
    except (ValueError, OSError):
        return 0


async def _meet_peers(state: NodeState, rng: random.Random, want: int) -> None:
    assert state.host is not None and state.stage_map is not None and state.connector is not None, \
        "set by run_node and _join_dht before reachability checks start"
    connected = {str(p) for p in state.host.get_connected_peers()} | {state.identity.peer_id_text}
    await meet_peers(state.stage_map, connected, state.connector.connect, rng, want)


async def _join_dht(state: NodeState, nursery: trio.Nursery, rng: random.Random, api_listeners: list) -> None:
    """Kademlia, the stage index and map, the API, reachability checks, our stage."""
    config, host = state.config, state.host
    assert state.kad is not None and state.control is not None and state.nat is not None and state.run is not None, \
        "set by run_node before _join_dht"
    bootstrap_infos = [peer_info_from_multiaddr(a) for a in config.bootstrap]
    state.index = StageIndex(host, state.kad, state.control, RecordStore(), server=config.dht_server)
    state.nat.set_dht_server = state.index.set_server
    state.stage_map = StageMap(state.index, state.model, nursery, run=state.run.identity,
                               roots=[str(info.peer_id) for info in bootstrap_infos])  # whom we trust first
    stage_map, pool = state.stage_map, state.pool  # a peer that worked with us may take an idle sender's slot
    assert pool is not None  # run_node made it
    pool.prefer = lambda peer: stage_map.work.score(peer, stage_map.clock()) >= MIN_WORK
    state.completer = SwarmCompleter(state.pool, state.stage_map, state.model, state.run,
                                     load_tokenizer(state.run.tokenizer), me=state.identity.peer_id_text,
                                     local=lambda: getattr(state.swarm, "inference", None))  # any node with a map
    reached = await join_network(host, state.kad, bootstrap_infos, BOOTSTRAP_DIAL_TIMEOUT)
    log.info("joined the DHT through %d bootstrap peer(s); routing table holds %d",
             reached, state.kad.get_routing_table_size())
    routes: Routes = {}
    nursery.start_soon(state.index.serve_store_pruning)
    nursery.start_soon(serve_routing_upkeep, host, state.kad, bootstrap_infos)
    nursery.start_soon(state.nat.serve_reachability, functools.partial(_meet_peers, state, rng))
    ping = PingRoute(host, state.connector, state.control, state.stage_map.addrs_of)
    routes.update({"/api/stats": state.stats_json, **state.stage_map.routes(), **ping.routes(),
                   "/metrics": metrics_route(routes)})  # (reads the routes when scraped: the stage's come later)
    nursery.start_soon(log_summaries, routes, config.role.value,  # one INFO line a minute, API or not
                       config.training.tunables.summary_period_s)
    if api_listeners:  # up before our stage is ready: loading it may take minutes, and status shows it meanwhile
        serve = functools.partial(serve_api, api_listeners, routes, token=config.api_token,
                                  completer=lambda: getattr(state, "completer", None))  # /v1 once it is set
        state.api_address = await nursery.start(serve)
    if config.serves_layers:
        nursery.start_soon(serve_health_watch, state.stage_map)  # a log line when a stage's health changes: only
        #                                          a trainer knows the model (a bootstrap's map is the default one)
        stage = state.model.stage_of(*config.layers) if config.layers else None
        if stage is None:  # --layers auto: ask the peers of every stage first (an answer outweighs a bare record)
            await check_every_stage(state.stage_map, state.identity.peer_id_text,
                                    functools.partial(control_round_trip, state.connector, state.control))
        state.stage = stage if stage is not None else await choose_stage(state.stage_map, rng)
        state.backups = _backup_service(state)
        state.backups.register()  # one snapshot handler: our stage's server, and the backups we hold
        nursery.start_soon(state.backups.run)
        routes.update(state.backups.routes())
        nursery.start_soon(serve_announcements, state.index, state.signed_record, state.stage_map)
        state.control.handle(wire.Ping, state.stage_map.answer_ping)  # a peer checking us answered us
        state.load_sources.append(lambda: state.swarm.queue_depth() if state.swarm else 0)
        send_move, moves = trio.open_memory_channel(0)
        await nursery.start(_serve_stages, state, rng, routes, moves)
        if config.rebalance:
            core = Rebalancer(state.identity.peer_id_text, state.model.n_stages, random.Random(rng.random()))
            state.mover = Mover(stage_map=state.stage_map, me=state.identity.peer_id_text, core=core,
                                stage=lambda: state.stage, move=functools.partial(_move_to, send_move))
            nursery.start_soon(state.mover.run)


def _backup_service(state: NodeState) -> BackupService:
    """Our holder of other stages' backups, on disk under ``data_dir/backups`` (memory only without one)."""
    from p2pswarm.diloco.backup_service import BackupService  # imports torch: a training peer only

    config = state.config
    assert state.run is not None, "set by run_node"
    directory = config.data_dir / "backups" / f"{state.model.name.replace('/', '-')}-{state.run.identity}" \
        if config.data_dir else None
    return BackupService(pool=state.pool, stage_map=state.stage_map, model=state.model, run=state.run,
                         me=state.identity.peer_id_text, directory=directory,
                         budget_bytes=config.backup_budget_mb * 1024 * 1024)


async def _move_to(send_move: trio.MemorySendChannel, stage: int) -> None:
    """The mover's callback: serve ``stage`` instead of ours; returns once it serves (its state loaded)."""
    done = trio.Event()
    await send_move.send((stage, done))
    await done.wait()


async def _serve_stages(state: NodeState, rng: random.Random, routes: dict, moves: trio.MemoryReceiveChannel,
                        task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Serve ``state.stage``; on a move (``_move_to``), stop every service of it and serve the new stage."""
    done = None
    while True:
        async with trio.open_nursery() as stage_nursery:
            if done is not None:
                stage_nursery.start_soon(_announce_now, state)  # the others count us there at their next check
            await stage_nursery.start(_serve_stage, state, rng, routes)
            if done is None:
                task_status.started()
            else:
                done.set()
            stage, done = await moves.receive()
            _stop_serving(state, routes)  # before the services end: no frame reaches a half-closed one
            stage_nursery.cancel_scope.cancel()
        if state.stage is not None:
            state.moved_from.add(state.stage)
        state.stage = stage
        if state.backups is not None:
            state.backups.stage = stage  # at once: our record must never claim a backup of our own stage


async def _serve_stage(state: NodeState, rng: random.Random, routes: dict,
                       task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Our stage's services: the neighbour stages' candidate checks, and training (started once our stage's
    state is loaded); they run until the scope is cancelled by a move."""
    assert state.stage is not None, "chosen by _join_dht, or set by _serve_stages on a move"
    if state.backups is not None:
        state.backups.stage = state.stage  # our own stage is never held as a backup
    async with trio.open_nursery() as nursery:
        nursery.start_soon(serve_candidate_checks, state.stage_map, neighbour_stages(state.model, state.stage),
                           state.identity.peer_id_text,
                           functools.partial(control_round_trip, state.connector, state.control))
        state.swarm = await nursery.start(_train, state, rng)
        assert state.swarm is not None and state.diloco is not None, "set by _train before it reports started"
        routes.update(state.swarm.routes())  # served from now on: the app reads this dict per request
        routes.update(state.diloco.routes())
        task_status.started()


def _stop_serving(state: NodeState, routes: dict) -> None:
    """Between two stages: refuse our old stage's protocols (the stream is reset, as a gone peer's would be)
    and drop its API routes (the new stage's services put theirs back)."""
    async def refuse(peer: str, message, payload: bytes):
        raise LocalProtocolError(f"moving from stage {state.stage}: not serving it any more")

    assert state.pool is not None and state.swarm is not None and state.diloco is not None, \
        "set by run_node and _serve_stage before a move"
    for protocol in (activation.PROTOCOL_ID, inference.PROTOCOL_ID, messages.PROTOCOL_ID):
        state.pool.serve(protocol, refuse)
    if state.backups is not None:
        state.backups.attach_server(None)
    else:
        state.pool.serve(snapshots.PROTOCOL_ID, refuse)
    for route in (*state.swarm.routes(), *state.diloco.routes()):
        routes.pop(route, None)
    state.swarm = state.diloco = None


async def _announce_now(state: NodeState) -> None:
    """One announcement of our new stage at once, rather than at the next ANNOUNCE_PERIOD."""
    assert state.index is not None, "set by _join_dht before any move"
    try:
        await state.index.announce(*state.signed_record(time.time()))
    except Exception as exc:  # the periodic announcement retries
        log.warning("announcing stage %d after the move failed (%s); the next announcement retries", state.stage, exc)


async def _train(state: NodeState, rng: random.Random, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Train our stage, with DiLoCo between its replicas (imports torch: only a training peer does)."""
    with imports_without_collections():  # torch's objects live as long as the node (allocator)
        from p2pswarm.diloco.service import DilocoService  # lazy: imports torch, which only a training peer loads
        from p2pswarm.swarm.service import SwarmService  # lazy: imports torch

    config, me, run, training = state.config, state.identity.peer_id_text, state.run, state.config.training
    assert run is not None and state.stage is not None, "set by run_node and _join_dht before training starts"
    snapshot_dir = config.data_dir / "snapshots" / f"{state.model.name.replace('/', '-')}-{run.identity}" \
        f"-stage{state.stage}" if config.data_dir else None  # one run's snapshots never load into another
    backups = state.backups
    state.diloco = DilocoService(settings=training.diloco, spec=state.model, stage=state.stage, me=me,
                                 pool=state.pool, stage_map=state.stage_map, snapshot_dir=snapshot_dir, run=run,
                                 backups=backups, serve_snapshots=backups.attach_server if backups else None,
                                 tunables=training.tunables)
    service = SwarmService(spec=state.model, stage=state.stage, me=me, pool=state.pool,
                           stage_map=state.stage_map, host=state.host, data=config.data,
                           threads=config.threads, rng=rng, extensions=[state.diloco],
                           placement=training.placement, config=training.train, run=run,
                           tokenizer=load_tokenizer(run.tokenizer),  # resolved already: an absolute path or "bytes"
                           tunables=training.tunables, moved_from=frozenset(state.moved_from - {state.stage}))
    await service.run(task_status=task_status)


async def run_node(config: NodeConfig, *, on_listening: Callable[[list[str]], None] = lambda addrs: None,
                   rng: random.Random | None = None, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Run a node until cancelled."""
    rng = rng or random.Random()
    run, model = config.run, config.training.model
    for addr in config.bootstrap:
        peer_info_from_multiaddr(addr)  # ConfigError before anything starts
    identity = load_or_create_key(config.resolved_key_path())
    state = NodeState(identity=identity, config=config, model=model, run=run)
    if config.serves_layers:
        log.info("%s: %s, %d x %d tokens per micro-batch, lr %g", run.describe(), model.name, run.rows,
                 run.context, run.lr)
    api_listeners = await open_api_listeners(config.api) if config.api else []  # fails before we listen
    limits = HostLimits(max_connections=config.max_connections)
    async with open_host(identity, config.listen, limits) as host, trio.open_nursery() as nursery:
        state.host = host
        log.info("peer %s listening on %s", identity.peer_id_text, ", ".join(state.addrs()))
        on_listening(state.addrs())
        state.connector = Connector(host, nursery)
        nursery.start_soon(serve_memory_upkeep)
        state.control = ControlService(host, nursery, state.connector)
        probe.register(host, state.control)  # every node answers probes, with or without an API
        state.pool = StreamPool(host, nursery, state.connector)
        state.load_sources.append(state.pool.queue_depth)
        state.nat = NatTraversal(host, nursery, config, rng, functools.partial(push_identify, host))
        await state.nat.start()
        async with open_kademlia(host, config.dht_server) as kad:
            state.kad = kad
            await _join_dht(state, nursery, rng, api_listeners)
            task_status.started(state)
            await trio.sleep_forever()

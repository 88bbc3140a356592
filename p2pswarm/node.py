"""A running node: the services of its role composed in one nursery.

``run_node`` builds the host and starts each service (control channel, connector, NAT
traversal, DHT and stage index, announcements, API) in one nursery; there are no service
classes or inheritance. Each service keeps its own state, exposes its own stats and routes,
and takes its decisions in a pure policy module (``nat.policy``, ``dht.announce``,
``model.catalog``); this module only wires them together. It reports
``task_status.started(state)`` once the node is listening, has joined the DHT and (for a
trainer) has chosen its stage.
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

from p2pswarm import __version__, wire
from p2pswarm.api import open_api_listeners, serve_api
from p2pswarm.config import BOOTSTRAP_DIAL_TIMEOUT, NodeConfig, Role
from p2pswarm.dht.announce import capacity_flags, stage_record
from p2pswarm.dht.discovery import (
    RECORD_TTL,
    StageIndex,
    join_network,
    open_kademlia,
    push_identify,
    serve_routing_upkeep,
)
from p2pswarm.dht.records import FLAG_GPU, FLAG_SNAPSHOT, Capacity, StageRecord, sign_record
from p2pswarm.dht.stagemap import (
    StageMap,
    control_round_trip,
    meet_peers,
    neighbour_stages,
    serve_announcements,
    serve_candidate_checks,
)
from p2pswarm.dht.store import RecordStore
from p2pswarm.identity import Identity, load_or_create_key
from p2pswarm.memory import serve_memory_upkeep
from p2pswarm.model.catalog import ModelSpec
from p2pswarm.model.run import RunSpec
from p2pswarm.model.tokenizer import load_tokenizer
from p2pswarm.nat.traversal import NatTraversal
from p2pswarm.net.connect import Connector
from p2pswarm.net.control import ControlService
from p2pswarm.net import probe
from p2pswarm.net.guard import guard_stats
from p2pswarm.net.host import HostLimits, open_host, peer_info_from_multiaddr
from p2pswarm.net.swarm_fixes import inbound_stats
from p2pswarm.net.pool import StreamPool
from p2pswarm.net.probe_api import PingRoute
from p2pswarm.swarm.device import Placement, free_device_memory_mb

log = logging.getLogger(__name__)


@dataclass
class NodeState:
    """The node's services, as composed by ``run_node``; read by the status API and tests."""

    identity: Identity
    config: NodeConfig
    model: ModelSpec
    run: RunSpec | None = None  # what we train (config.training_run): its identity keys our records
    host: object = None
    kad: object = None
    control: ControlService | None = None
    pool: StreamPool | None = None  # bulk streams: activations, gradients, shards, snapshots
    connector: Connector | None = None
    nat: NatTraversal | None = None
    index: StageIndex | None = None
    stage_map: StageMap | None = None
    stage: int | None = None
    api_address: str | None = None
    load_sources: list[Callable[[], int]] = field(default_factory=list)  # queued work, summed in records
    swarm: object = None  # the SwarmService training our stage (p2pswarm.swarm.service), join only
    diloco: object = None  # its outer rounds and snapshots (p2pswarm.diloco.service), join only
    completer: object = None  # text generation through the swarm (p2pswarm.swarm.generation), once joined
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
        on_device = self.config.serves_layers and self.config.device != "cpu"
        free = free_device_memory_mb(self.config.device) if on_device else free_memory_mb()
        return Capacity(free_memory_mb=free, queue_depth=sum(load() for load in self.load_sources),
                        flags=flags | (FLAG_SNAPSHOT if self.diloco else 0) | (FLAG_GPU if on_device else 0),
                        throughput=round(self.swarm.throughput(), 1) if self.swarm else 0.0,
                        outer_round=self.diloco.outer_round() if self.diloco else 0)

    def signed_record(self, now: float) -> tuple[StageRecord, bytes]:
        record = stage_record(self.identity.peer_id_text, self.addrs(), tuple(self.nat.public_addrs), self.model,
                              self.stage, self.capacity(), now, RECORD_TTL, run=self.run.identity)
        return record, sign_record(record, self.identity)


def free_memory_mb() -> int:
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // (1024 * 1024)
    except (ValueError, OSError):
        return 0


async def _meet_peers(state: NodeState, rng: random.Random, want: int) -> None:
    connected = {str(p) for p in state.host.get_connected_peers()} | {state.identity.peer_id_text}
    await meet_peers(state.stage_map, connected, state.connector.connect, rng, want)


async def _join_dht(state: NodeState, nursery: trio.Nursery, rng: random.Random, api_listeners: list) -> None:
    """Kademlia, the stage index and map, the API, reachability checks, our stage."""
    config, host = state.config, state.host
    bootstrap_infos = [peer_info_from_multiaddr(a) for a in config.bootstrap]
    state.index = StageIndex(host, state.kad, state.control, RecordStore(), server=config.dht_server)
    state.nat.set_dht_server = state.index.set_server
    state.stage_map = StageMap(state.index, state.model, nursery, run=state.run.identity)
    from p2pswarm.swarm.generation import SwarmCompleter  # no torch until a request samples

    state.completer = SwarmCompleter(state.pool, state.stage_map, state.model, state.run,
                                     load_tokenizer(state.run.tokenizer), me=state.identity.peer_id_text,
                                     local=lambda: getattr(state.swarm, "inference", None))  # any node with a map
    reached = await join_network(host, state.kad, bootstrap_infos, BOOTSTRAP_DIAL_TIMEOUT)
    log.info("joined the DHT through %d bootstrap peer(s); routing table holds %d",
             reached, state.kad.get_routing_table_size())
    routes = {}
    nursery.start_soon(state.index.serve_store_pruning)
    nursery.start_soon(serve_routing_upkeep, host, state.kad, bootstrap_infos)
    nursery.start_soon(state.nat.serve_reachability, functools.partial(_meet_peers, state, rng))
    if api_listeners:  # up before our stage is ready: loading it may take minutes, and status shows it meanwhile
        ping = PingRoute(host, state.connector, state.control, state.stage_map.addrs_of)
        routes.update({"/api/stats": state.stats_json, **state.stage_map.routes(), **ping.routes()})
        serve = functools.partial(serve_api, api_listeners, routes, token=config.api_token,
                                  completer=lambda: getattr(state, "completer", None))  # /v1 once it is set
        state.api_address = await nursery.start(serve)
    if config.serves_layers:
        stage = state.model.stage_of(*config.layers) if config.layers else None
        state.stage = stage if stage is not None else await state.stage_map.choose_stage(rng)
        nursery.start_soon(serve_announcements, state.index, state.signed_record)
        state.control.handle(wire.Ping, state.stage_map.answer_ping)  # a peer checking us answered us
        nursery.start_soon(serve_candidate_checks, state.stage_map, neighbour_stages(state.model, state.stage),
                           state.identity.peer_id_text,
                           functools.partial(control_round_trip, state.connector, state.control))
        state.swarm = await nursery.start(_train, state, rng)
        state.load_sources.append(state.swarm.queue_depth)
        routes.update(state.swarm.routes())  # served from now on: the app reads this dict per request
        routes.update(state.diloco.routes())


async def _train(state: NodeState, rng: random.Random, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Train our stage, with DiLoCo between its replicas (imports torch: only a training peer does)."""
    from p2pswarm.diloco.service import DilocoService
    from p2pswarm.swarm.service import SwarmService

    from p2pswarm.swarm.engine import TrainConfig

    config, me, run = state.config, state.identity.peer_id_text, state.run
    snapshot_dir = config.data_dir / "snapshots" / f"{state.model.name.replace('/', '-')}-{run.identity}" \
        f"-stage{state.stage}" if config.data_dir else None  # one run's snapshots never load into another
    state.diloco = DilocoService(settings=run.diloco(config.diloco), spec=state.model, stage=state.stage, me=me, pool=state.pool,
                                 stage_map=state.stage_map, snapshot_dir=snapshot_dir, run=run)
    service = SwarmService(spec=state.model, stage=state.stage, me=me, pool=state.pool,
                           stage_map=state.stage_map, host=state.host, data=config.data,
                           threads=config.threads, rng=rng, extensions=[state.diloco],
                           placement=Placement(config.device, config.precision),
                           config=TrainConfig(**run.train_values()), run=run,
                           tokenizer=load_tokenizer(run.tokenizer))  # resolved already: an absolute path or "bytes"
    await service.run(task_status=task_status)


async def run_node(config: NodeConfig, *, on_listening: Callable[[list[str]], None] = lambda addrs: None,
                   rng: random.Random | None = None, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Run a node until cancelled."""
    rng = rng or random.Random()
    run = config.training_run
    model = run.spec()
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

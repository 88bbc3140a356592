"""Node configuration: one frozen dataclass built by the CLI, with every default named here."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from p2pswarm.run.diloco import DilocoSettings
from p2pswarm.model.catalog import DEFAULT_MODEL
from p2pswarm.run.spec import RunSpec, agreed_diloco, default_run
from p2pswarm.run.tunables import Tunables
from p2pswarm.nat.policy import DhtMode, Role
from p2pswarm.nat.relay_service import RelayConfig
from p2pswarm.net.host import DEFAULT_LIMITS
from p2pswarm.swarm.device import DEFAULT_DEVICE, DEFAULT_PRECISION

DEFAULT_LISTEN = "/ip4/0.0.0.0/tcp/0"  # any free port on every interface
DEFAULT_BOOTSTRAP_LISTEN = "/ip4/0.0.0.0/tcp/4001"  # the conventional libp2p port, easy to firewall
DEFAULT_RELAY_LISTEN = DEFAULT_BOOTSTRAP_LISTEN  # a relay is a public DHT server too, on its own machine
BOOTSTRAP_DIAL_TIMEOUT = 10.0  # a bootstrap peer across the internet may take a few round trips
DEFAULT_BACKUP_BUDGET_MB = 2048  # disk for other stages' backups: a few copies of a mid-size stage (heal.backups)



@dataclass(frozen=True)
class NodeConfig:
    role: Role
    listen: tuple[str, ...] = (DEFAULT_LISTEN,)
    bootstrap: tuple[str, ...] = ()
    key_path: Path | None = None  # None: <data_dir>/node.key, or an ephemeral key without a data dir
    data_dir: Path | None = None
    api: str | None = None  # HOST:PORT of the status API, off when None
    api_token: str | None = field(default=None, repr=False)  # API requests must carry it (Bearer); None: no check
    model: str = DEFAULT_MODEL
    layers: tuple[int, int] | None = None  # None: choose the least-served stage at join time
    dht_mode: DhtMode = DhtMode.AUTO
    stun: tuple[str, int] | None = None  # STUN server to learn our public UDP address and NAT type
    relay: RelayConfig | None = None  # limits of the relay service; only used with Role.RELAY
    relays: tuple[str, ...] = ()  # relays (multiaddrs ending in /p2p/<id>) to reserve on while PRIVATE
    data: str | None = None  # training text (a file or a folder) for stage 0; None: the embedded stdlib corpus
    threads: int | None = None  # torch compute threads; None: torch's default (all cores)
    device: str = DEFAULT_DEVICE  # a resolved torch device ("cpu", "cuda:0", "mps"): the CLI resolves --device auto
    precision: str = DEFAULT_PRECISION  # "fp32", or "bf16" (autocast over fp32 master weights)
    diloco: DilocoSettings = DilocoSettings()  # outer rounds between the replicas of our stage
    max_connections: int = DEFAULT_LIMITS.max_connections  # peers connected at once, both directions
    run: RunSpec | None = None  # what the swarm trains (--run); None: the default run on ``model``
    rebalance: bool = False  # move to an under-served stage at runtime (heal.rebalance); the CLI turns it on with
    #                          --layers auto; off, the peer announces FLAG_PINNED and never moves
    backup_budget_mb: int = DEFAULT_BACKUP_BUDGET_MB  # disk for the other stages' backups we hold
    tunables: Tunables = Tunables()  # benches' and tests' knobs (--tune): defaults on a real peer

    @property
    def training_run(self) -> RunSpec:
        """The run this node trains: ``run``, or the default run's settings on ``model`` with ``diloco``'s
        agreed values (``--model`` without ``--run``: the default run's identity when nothing differs)."""
        if self.run is not None:
            return self.run
        return default_run().with_values(model=self.model, **agreed_diloco(self.diloco))

    @property
    def serves_layers(self) -> bool:
        return self.role is Role.JOIN

    @property
    def dht_server(self) -> bool:
        """Kademlia server mode at start. A joining peer in auto mode starts as a client (as
        go-libp2p does): were it a server until found NATed, it would enter other peers' routing
        tables with addresses nobody can dial, and their lookups would wait on it."""
        if self.dht_mode is DhtMode.AUTO:
            return self.role is not Role.JOIN
        return self.dht_mode is DhtMode.SERVER

    def resolved_key_path(self) -> Path | None:
        if self.key_path is not None:
            return self.key_path
        return self.data_dir / "node.key" if self.data_dir is not None else None

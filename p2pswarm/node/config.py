"""Node configuration: one frozen dataclass built by the CLI, with every default named here."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from p2pswarm.nat.policy import DhtMode, Role
from p2pswarm.nat.relay_service import RelayConfig
from p2pswarm.net.host import DEFAULT_LIMITS
from p2pswarm.run.spec import RunSpec, default_run
from p2pswarm.run.training import Training

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
    training: Training = field(default_factory=lambda: Training.of(default_run()))  # the one run object: what
    #   a trainer trains and how (built once by the CLI); a bootstrap or relay shows this run's stage map
    layers: tuple[int, int] | None = None  # None: choose the least-served stage at join time
    dht_mode: DhtMode = DhtMode.AUTO
    stun: tuple[str, int] | None = None  # STUN server to learn our public UDP address and NAT type
    relay: RelayConfig | None = None  # limits of the relay service; only used with Role.RELAY
    relays: tuple[str, ...] = ()  # relays (multiaddrs ending in /p2p/<id>) to reserve on while PRIVATE
    data: str | None = None  # training text (a file or a folder) for stage 0; None: the embedded stdlib corpus
    threads: int | None = None  # torch compute threads; None: torch's default (all cores)
    max_connections: int = DEFAULT_LIMITS.max_connections  # peers connected at once, both directions
    rebalance: bool = False  # move to an under-served stage at runtime (heal.rebalance); the CLI turns it on with
    #                          --layers auto; off, the peer announces FLAG_PINNED and never moves
    backup_budget_mb: int = DEFAULT_BACKUP_BUDGET_MB  # disk for the other stages' backups we hold

    @property
    def run(self) -> RunSpec:
        """The run of our records and stage map (``training.run``)."""
        return self.training.run

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

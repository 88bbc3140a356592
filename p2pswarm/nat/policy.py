"""How a node reacts to a reachability verdict. Pure policy, no I/O.

A verdict (``nat.reachability``) changes three things: the DHT mode of a joining peer in
``--dht-mode auto``, whether it holds relay reservations, and which dial-back-confirmed
addresses it advertises besides its listen addresses (a DMZ or port-forwarding router's).
``nat.traversal`` carries the reaction out.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from p2pswarm.nat.reachability import Reachability


class Role(enum.Enum):
    BOOTSTRAP = "bootstrap"  # a public DHT server that serves no layers
    JOIN = "join"  # a peer that serves a layer range
    RELAY = "relay"  # a public DHT server that also relays circuits (circuit relay v2 hop)


class DhtMode(enum.Enum):
    AUTO = "auto"  # a joining peer is a client until reachability detection says it is public
    SERVER = "server"
    CLIENT = "client"


class RelayAction(enum.Enum):
    START = "start"  # reserve on relays (no-op when already reserving)
    STOP = "stop"  # drop reservations (no-op when none)
    KEEP = "keep"  # leave whatever runs


@dataclass(frozen=True)
class Reaction:
    public_addrs: tuple[str, ...]  # confirmed addresses to advertise that we do not listen on
    dht_server: bool | None  # the DHT mode to switch to, None to leave it
    relays: RelayAction


def react(verdict: Reachability, *, role: Role, dht_mode: DhtMode, confirmed: Sequence[str],
          listening: Sequence[str]) -> Reaction:
    """What to do on ``verdict``.

    A joining peer in auto mode is a DHT server once PUBLIC and a client once PRIVATE; it holds
    relay reservations from the first PRIVATE verdict until a PUBLIC one. UNKNOWN changes
    neither (a verdict that lapsed says nothing new about the NAT). Confirmed addresses count
    only while PUBLIC.
    """
    public = tuple(a for a in confirmed if a not in listening) if verdict is Reachability.PUBLIC else ()
    joining = role is Role.JOIN
    dht_server = None
    if joining and dht_mode is DhtMode.AUTO and verdict is not Reachability.UNKNOWN:
        dht_server = verdict is Reachability.PUBLIC
    relays = RelayAction.KEEP
    if joining and verdict is Reachability.PRIVATE:
        relays = RelayAction.START
    elif joining and verdict is Reachability.PUBLIC:
        relays = RelayAction.STOP
    return Reaction(public_addrs=public, dht_server=dht_server, relays=relays)

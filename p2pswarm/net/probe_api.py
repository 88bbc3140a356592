"""The ``/api/ping`` route: check the query, find the peer's addresses, run the probe.

``/api/ping?peer=<peer id or multiaddr>&bytes=N[&fresh=1][&upgrade_wait=S]`` reaches a peer
(anew with fresh=1) and measures the path (``net/probe.py``); ``p2pswarm ping`` prints it. A
bad parameter is a ``ConfigError`` (400), an unreachable peer a ``DialError`` (502).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from p2pswarm.errors import ConfigError
from p2pswarm.net import probe
from p2pswarm.net.host import parse_multiaddr

MAX_UPGRADE_WAIT = 30.0  # /api/ping?upgrade_wait=S: longest wait for a relayed connection to turn direct


def parse_peer(text: str) -> tuple[str, tuple[str, ...]] | None:
    """(peer id, addresses) from a multiaddr ending in /p2p/<id>; None for a bare peer id."""
    if not text:
        raise ConfigError("say which peer: ?peer=<peer id or multiaddr ending in /p2p/<id>>")
    if not text.startswith("/"):
        return None
    parse_multiaddr(text)
    head, sep, peer = text.rpartition("/p2p/")
    if not sep or "/" in peer:
        raise ConfigError(f"multiaddr {text} must end in /p2p/<peer id>")
    return peer, (head,) if head else ()


def _number(params: dict, name: str, kind: type, default: str, low: float, high: float, unit: str):
    try:
        value = kind(params.get(name, default))
    except ValueError:
        raise ConfigError(f"{name} must be {unit}, not {params[name]!r}") from None
    if not low <= value <= high:
        raise ConfigError(f"{name} must be between {low:g} and {high:g}")
    return value


class PingRoute:
    """``/api/ping`` for a node: its host, connector and control channel, and where addresses
    of a bare peer id come from (the stage map)."""

    def __init__(self, host, connector, control, addrs_of: Callable[[str], Awaitable[tuple[str, ...]]]) -> None:
        self._host, self._connector, self._control, self._addrs_of = host, connector, control, addrs_of

    async def ping_json(self, params: dict) -> dict:
        parsed = parse_peer(params.get("peer", ""))
        peer, addrs = parsed if parsed is not None else (params["peer"], await self._addrs_of(params["peer"]))
        nbytes = _number(params, "bytes", int, "0", 0, probe.MAX_PROBE_BYTES, "an integer")
        upgrade_wait = _number(params, "upgrade_wait", float, "0", 0, MAX_UPGRADE_WAIT, "seconds")
        result = await probe.probe(self._host, self._connector, self._control, peer, addrs, nbytes,
                                   fresh=params.get("fresh") == "1", upgrade_wait=upgrade_wait)
        return result.doc()

    def routes(self) -> dict:
        return {"/api/ping": self.ping_json}

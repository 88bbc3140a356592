"""Connection events from py-libp2p's network, as plain callbacks.

py-libp2p calls a *notifee* (an object with six async methods) on every connection and stream
opened or closed and every listener started or stopped. p2pswarm only ever needs connections
opening and closing; ``ConnectionEvents`` takes those two callbacks and ignores the rest.
"""

from __future__ import annotations

from collections.abc import Callable

Callback = Callable[[object], None]  # called with the py-libp2p connection (INetConn)


def _ignore(conn) -> None:
    pass


class ConnectionEvents:
    """A notifee calling ``on_connected(conn)`` and ``on_disconnected(conn)`` (synchronous, quick)."""

    def __init__(self, on_connected: Callback = _ignore, on_disconnected: Callback = _ignore) -> None:
        self._on_connected = on_connected
        self._on_disconnected = on_disconnected

    async def connected(self, network, conn) -> None:
        self._on_connected(conn)

    async def disconnected(self, network, conn) -> None:
        self._on_disconnected(conn)

    async def opened_stream(self, network, stream) -> None:
        pass

    async def closed_stream(self, network, stream) -> None:
        pass

    async def listen(self, network, multiaddr) -> None:
        pass

    async def listen_close(self, network, multiaddr) -> None:
        pass


def watch_connections(host, on_connected: Callback = _ignore, on_disconnected: Callback = _ignore) -> ConnectionEvents:
    """Call back on every connection of ``host`` opening and closing, from now on (``stop_watching`` ends it)."""
    events = ConnectionEvents(on_connected, on_disconnected)
    host.get_network().register_notifee(events)
    return events


def stop_watching(host, events: ConnectionEvents) -> None:
    """No more callbacks from ``events``: for a watcher that ends before its host (one started again and
    again would otherwise leave a notifee behind each time, each called on every connection)."""
    host.get_network().remove_notifee(events)

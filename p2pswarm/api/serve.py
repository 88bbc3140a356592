"""The node's HTTP API: JSON status documents (``p2pswarm status``), the OpenAI-compatible
``/v1`` endpoints (``p2pswarm generate``, any OpenAI client), served by hypercorn on trio.

hypercorn (``api/server.py``) speaks HTTP/1.1 over listeners bound early (``open_api_listeners``:
a port in use fails before the node listens for peers); our own small ASGI app (``api/app.py``)
answers. The limits are in ``api/http.py``, read when used (tests shorten them). What a client
does (garbage, a reset, a stall, a huge body) ends in its connection's task: nothing escapes into
``serve_api`` and so into the node.

Routes map a path to an async function taking the query parameters (a dict) and returning a
JSON-able dict; ``ConfigError`` is a 400, ``DialError`` a 502 (also inside an exception group).
"""

from __future__ import annotations

import ipaddress
import logging

import trio

from p2pswarm.api.app import ApiApp
from p2pswarm.api.http import CompleterSource, Routes
from p2pswarm.errors import ConfigError, StartupError

log = logging.getLogger(__name__)

LOOPBACK_NAMES = ("localhost",)  # host names that are loopback without resolving them


def parse_host_port(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ConfigError(f"--api must be HOST:PORT, not {text!r}")
    return host, int(port)


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host.lower() in LOOPBACK_NAMES


def check_api_exposure(address: str, token: str | None) -> None:
    """ConfigError unless the API binds to loopback or requests must carry a token."""
    host, _ = parse_host_port(address)
    if not is_loopback(host) and not token:
        raise ConfigError(f"--api {address} is reachable beyond this machine: give --api-token TOKEN "
                          f"(or P2PSWARM_API_TOKEN), or bind to 127.0.0.1")


async def open_api_listeners(address: str) -> list[trio.SocketListener]:
    """Bind the API's address (HOST:PORT) now; StartupError if it cannot be (a port in use, a bad
    host), so a node fails before it listens for peers rather than after."""
    host, port = parse_host_port(address)
    try:
        return list(await trio.open_tcp_listeners(port, host=host))
    except OSError as exc:
        raise StartupError(f"cannot serve the API on {address}: {exc.strerror or exc}") from None


async def serve_api(address: str | list[trio.SocketListener], routes: Routes, *,
                    completer: CompleterSource = lambda: None, token: str | None = None,
                    task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Serve ``routes`` (and ``/v1`` when ``completer()`` gives one) on ``address`` (HOST:PORT, or
    listeners already bound) until cancelled; with ``token``, every request must carry it."""
    # Lazy: hypercorn is imported by a serving node only, not by the CLI's status and generate.
    from p2pswarm.api.server import serve_asgi

    listeners = await open_api_listeners(address) if isinstance(address, str) else address
    bound = listeners[0].socket.getsockname()
    log.info("status API on http://%s:%d/api/stats%s", bound[0], bound[1], " (token required)" if token else "")
    task_status.started(f"{bound[0]}:{bound[1]}")
    await serve_asgi(ApiApp(routes, completer, token), listeners)

"""The node's HTTP status API: small JSON documents for ``p2pswarm status`` and for operators.

A minimal HTTP/1.1 server on trio (GET only, one request per connection, bounded request size)
so the node needs no web framework. Routes map a path to an async function returning a JSON-able
dict (async so that an endpoint may refresh what it shows before answering). A route gets the
query parameters (``?peer=...&bytes=...``) as a dict; a ``ConfigError`` it raises is a 400 (bad
parameters), a ``DialError`` a 502 (the peer asked about could not be reached), also when it
arrives inside an exception group.
"""

from __future__ import annotations

import json
import logging
import urllib.parse
from collections.abc import Awaitable, Callable

import trio

from p2pswarm.errors import ConfigError, DialError, StartupError, first_error

log = logging.getLogger(__name__)

MAX_REQUEST_BYTES = 8 * 1024  # a GET with headers; anything longer is not a status query
MAX_QUERY_FIELDS = 16  # endpoints take two or three parameters
REQUEST_TIMEOUT = 5.0  # a client that has not sent its request in 5 s is dropped
REPLY_TIMEOUT = 10.0  # a reply is a small JSON document; a client that will not take it in 10 s is dropped

Routes = dict[str, Callable[[dict[str, str]], Awaitable[dict]]]


def parse_host_port(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ConfigError(f"--api must be HOST:PORT, not {text!r}")
    return host, int(port)


def _response(status: str, body: dict) -> bytes:
    data = json.dumps(body, indent=1, sort_keys=True).encode()
    head = (
        f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + data


async def respond(request: bytes, routes: Routes) -> bytes:
    """The full HTTP response to one raw request (no sockets: testable on its own)."""
    line = request.split(b"\r\n", 1)[0].decode("latin-1").split()
    if len(line) != 3:
        return _response("400 Bad Request", {"error": "malformed request line"})
    method, target, _ = line
    if method != "GET":
        return _response("405 Method Not Allowed", {"error": "only GET is served"})
    path, _, query = target.partition("?")
    route = routes.get(path)
    if route is None:
        return _response("404 Not Found", {"error": f"no such endpoint; try {', '.join(sorted(routes))}"})
    try:
        params = {k: v[-1] for k, v in urllib.parse.parse_qs(query, max_num_fields=MAX_QUERY_FIELDS).items()}
    except ValueError:
        return _response("400 Bad Request", {"error": f"more than {MAX_QUERY_FIELDS} query parameters"})
    try:
        return _response("200 OK", await route(params))
    except Exception as exc:  # an exception group from a route's nursery too
        error = first_error(exc)
        if isinstance(error, ConfigError):
            return _response("400 Bad Request", {"error": str(error)})
        if isinstance(error, DialError):
            return _response("502 Bad Gateway", {"error": str(error)})
        log.exception("status endpoint %s failed", target)
        return _response("500 Internal Server Error", {"error": "endpoint failed"})


async def _read_request(stream: trio.SocketStream) -> bytes:
    """The request head as far as the client sent it within REQUEST_TIMEOUT and MAX_REQUEST_BYTES."""
    request = b""
    with trio.move_on_after(REQUEST_TIMEOUT):
        while b"\r\n\r\n" not in request and len(request) < MAX_REQUEST_BYTES:
            chunk = await stream.receive_some(4096)
            if not chunk:
                break
            request += chunk
    return request


async def _serve_connection(stream: trio.SocketStream, routes: Routes) -> None:
    """Answer one request. Whatever the client does (reset, stall, garbage) ends here, in this
    connection's task: an exception escaping it would end ``serve_listeners`` and the node."""
    try:
        response = await respond(await _read_request(stream), routes)
        with trio.move_on_after(REPLY_TIMEOUT) as sending:
            await stream.send_all(response)
        if sending.cancelled_caught:
            log.info("status API client did not take its reply within %.0f s; dropped", REPLY_TIMEOUT)
    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
        log.debug("status API client went away: %s", exc)
    finally:
        await stream.aclose()


async def open_api_listeners(address: str) -> list[trio.SocketListener]:
    """Bind the API's address (HOST:PORT) now; StartupError if it cannot be (a port in use, a bad
    host), so a node fails before it listens for peers rather than after."""
    host, port = parse_host_port(address)
    try:
        return await trio.open_tcp_listeners(port, host=host)
    except OSError as exc:
        raise StartupError(f"cannot serve the API on {address}: {exc.strerror or exc}") from None


async def serve_api(address: str | list[trio.SocketListener], routes: Routes, *,
                    task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Serve ``routes`` on ``address`` (HOST:PORT, or listeners already bound) until cancelled."""
    listeners = await open_api_listeners(address) if isinstance(address, str) else address
    bound = listeners[0].socket.getsockname()
    log.info("status API on http://%s:%d/api/stats", bound[0], bound[1])
    task_status.started(f"{bound[0]}:{bound[1]}")
    await trio.serve_listeners(lambda s: _serve_connection(s, routes), listeners)

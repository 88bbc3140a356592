"""The HTTP pieces every part of the API uses: its limits, the routes' types, JSON replies,
bounded request bodies and errors as statuses with a JSON body.

The bottom of ``p2pswarm.api``: ``serve`` (binding, the entry point), ``app`` (the ASGI app),
``openai_v1`` (the ``/v1`` routes) and ``server`` (hypercorn) import it, and it imports none of
them. The limits are read when used (tests shorten them).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

import trio

from p2pswarm.errors import ConfigError, DialError, NoCandidates, Overloaded, first_error
from p2pswarm.swarm.completions import Completer

log = logging.getLogger("p2pswarm.api.serve")  # one logger for the whole API

MAX_HEADER_BYTES = 16 * 1024  # a request head still incomplete past it is a 431; ours need far less
MAX_BODY_BYTES = 4 * 1024 * 1024  # a completion request: a 1 MiB prompt as UTF-8 JSON fits, with room (413 beyond)
MAX_QUERY_FIELDS = 16  # endpoints take two or three parameters
REQUEST_TIMEOUT = 5.0  # a client that has not sent its request head in 5 s (or is idle between requests) is dropped
BODY_TIMEOUT = 30.0  # a request body of MAX_BODY_BYTES arrives in 30 s over a ~1 Mbit/s link (408 beyond)
REPLY_TIMEOUT = 10.0  # a client that will not take a piece of its reply in 10 s is dropped



@dataclass(frozen=True)
class TextReply:
    """A route's answer that is not JSON (``GET /metrics``): ``body`` as it is, of ``content_type``."""

    body: bytes
    content_type: bytes
    headers: tuple[tuple[bytes, bytes], ...] = ()  # more response headers (the dashboard's security headers)


Route = Callable[[dict[str, str]], Awaitable[dict | TextReply]]
Routes = dict[str, Route]
CompleterSource = Callable[[], Completer | None]  # read per request: generation may start after the API

JSON = [(b"content-type", b"application/json")]


class HttpError(Exception):
    """A request answered with ``status`` and an OpenAI-style error body."""

    def __init__(self, status: int, message: str, code: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.code, self.kind = status, code, kind

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "code": self.code}}


class ClientGone(Exception):
    """The client closed its connection before we answered."""


def error_for(exc: BaseException, what: str) -> HttpError:
    """The HTTP error for what a route or a Completer raised (also inside an exception group)."""
    error = first_error(exc)
    if isinstance(error, HttpError):
        return error
    if isinstance(error, ConfigError):
        return HttpError(400, str(error))
    if isinstance(error, Overloaded):
        return HttpError(429, str(error), "overloaded", "rate_limit_error")
    if isinstance(error, NoCandidates):
        return HttpError(503, str(error), "no_replica", "api_error")
    if isinstance(error, DialError):
        return HttpError(502, str(error), "peer_unreachable", "api_error")
    log.error("%s failed", what, exc_info=exc)
    return HttpError(500, f"{what} failed", "internal_error", "api_error")


async def send_json(send, status: int, body: dict, headers: list | None = None) -> None:
    data = json.dumps(body, indent=1, sort_keys=True).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": JSON + [(b"content-length", str(len(data)).encode())] + (headers or [])})
    await send({"type": "http.response.body", "body": data})


async def send_text(send, status: int, reply: TextReply) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", reply.content_type), (b"content-length", str(len(reply.body)).encode()),
                            *reply.headers]})
    await send({"type": "http.response.body", "body": reply.body})


async def read_docs(routes: Routes, paths: tuple[str, ...]) -> dict[str, Mapping]:
    """The JSON documents of ``paths`` a node serves now, read through its routes (``/metrics``, the summary
    line); a route it lacks, or one that fails now (a stage being moved), is left out."""
    docs: dict[str, Mapping] = {}
    for path in paths:
        route = routes.get(path)
        try:
            doc = await route({}) if route is not None else None
        except Exception:
            log.debug("reading %s failed", path, exc_info=True)
            continue
        if isinstance(doc, Mapping):
            docs[path] = doc
    return docs


def header(scope: dict, name: bytes) -> bytes | None:
    return next((value for key, value in scope["headers"] if key.lower() == name), None)


async def read_body(scope: dict, receive) -> bytes:
    """The request body, at most MAX_BODY_BYTES (413) within BODY_TIMEOUT (408)."""
    length = header(scope, b"content-length")
    if length is not None and length.isdigit() and int(length) > MAX_BODY_BYTES:
        raise HttpError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes", "request_too_large")
    body = bytearray()
    with trio.move_on_after(BODY_TIMEOUT) as reading:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ClientGone()
            body += message.get("body", b"")
            if len(body) > MAX_BODY_BYTES:
                raise HttpError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes",
                                "request_too_large")
            if not message.get("more_body", False):
                return bytes(body)
    assert reading.cancelled_caught
    raise HttpError(408, f"the request body did not arrive within {BODY_TIMEOUT:.0f} s", "request_timeout")


async def cancel_on_disconnect(receive, scope: trio.CancelScope) -> None:
    """Cancel ``scope`` when the client goes away (the body has been read: only a disconnect comes)."""
    while (await receive())["type"] != "http.disconnect":
        pass
    scope.cancel()

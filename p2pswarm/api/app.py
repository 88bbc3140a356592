"""The API's ASGI app (no web framework): authentication, the JSON GET routes, the ``/v1`` routes
(``api_openai.py``), bounded request bodies, and every error as a status with a JSON body.

The app never raises into hypercorn: a bug in a route is a 500 and a log line.
"""

from __future__ import annotations

import hmac
import json
import logging
import urllib.parse

import trio

from p2pswarm.api import serve as api
from p2pswarm.errors import ConfigError, DialError, NoCandidates, Overloaded, first_error

log = logging.getLogger("p2pswarm.api.serve")

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


def header(scope: dict, name: bytes) -> bytes | None:
    return next((value for key, value in scope["headers"] if key.lower() == name), None)


async def read_body(scope: dict, receive) -> bytes:
    """The request body, at most MAX_BODY_BYTES (413) within BODY_TIMEOUT (408)."""
    length = header(scope, b"content-length")
    if length is not None and length.isdigit() and int(length) > api.MAX_BODY_BYTES:
        raise HttpError(413, f"the request body is larger than {api.MAX_BODY_BYTES} bytes", "request_too_large")
    body = bytearray()
    with trio.move_on_after(api.BODY_TIMEOUT) as reading:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ClientGone()
            body += message.get("body", b"")
            if len(body) > api.MAX_BODY_BYTES:
                raise HttpError(413, f"the request body is larger than {api.MAX_BODY_BYTES} bytes",
                                "request_too_large")
            if not message.get("more_body", False):
                return bytes(body)
    assert reading.cancelled_caught
    raise HttpError(408, f"the request body did not arrive within {api.BODY_TIMEOUT:.0f} s", "request_timeout")


async def cancel_on_disconnect(receive, scope: trio.CancelScope) -> None:
    """Cancel ``scope`` when the client goes away (the body has been read: only a disconnect comes)."""
    while (await receive())["type"] != "http.disconnect":
        pass
    scope.cancel()


class ApiApp:
    """ASGI: ``routes`` (JSON GET), ``/v1`` when ``completer()`` gives a Completer, ``token`` checked first."""

    def __init__(self, routes: api.Routes, completer: api.CompleterSource, token: str | None) -> None:
        self.routes, self.completer = routes, completer
        self.token = token.encode() if token else None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1003})
        if scope["type"] != "http":
            return
        try:
            await self.dispatch(scope, receive, send)
        except ClientGone:
            log.debug("API client went away before its answer")
        except Exception as exc:  # noqa: BLE001 - a bug of ours: a 500, the node goes on
            error = error_for(exc, f"{scope['method']} {scope['path']}")
            try:
                await send_json(send, error.status, error.body())
            except Exception:  # noqa: BLE001 - the reply had started: the client sees a cut reply
                log.debug("could not send the error reply", exc_info=True)

    def authorized(self, scope: dict) -> bool:
        """No token set, or ``Authorization: Bearer TOKEN`` (compared in constant time)."""
        scheme, _, credentials = (header(scope, b"authorization") or b"").partition(b" ")
        return self.token is None or (scheme.lower() == b"bearer" and hmac.compare_digest(credentials, self.token))

    async def dispatch(self, scope, receive, send) -> None:
        if not self.authorized(scope):
            raise HttpError(401, "this API needs 'Authorization: Bearer TOKEN' with the node's --api-token",
                            "invalid_api_key")
        path, method = scope["path"], scope["method"]
        if path.startswith("/v1/"):
            from p2pswarm.api.openai_v1 import serve_v1

            return await serve_v1(self.completer(), scope, receive, send)
        route = self.routes.get(path)
        if route is None:
            return await send_json(send, 404, {"error": f"no such endpoint; try {', '.join(sorted(self.routes))}"})
        if method not in ("GET", "HEAD"):
            return await send_json(send, 405, {"error": f"{path} answers GET only"}, [(b"allow", b"GET")])
        query = scope["query_string"].decode("latin-1")
        try:
            params = {k: v[-1] for k, v in urllib.parse.parse_qs(query, max_num_fields=api.MAX_QUERY_FIELDS).items()}
        except ValueError:
            return await send_json(send, 400, {"error": f"more than {api.MAX_QUERY_FIELDS} query parameters"})
        try:
            doc = await route(params)
        except Exception as exc:  # an exception group from a route's nursery too
            error = error_for(exc, f"status endpoint {path}")
            return await send_json(send, error.status, {"error": str(error)})
        await send_json(send, 200, doc)

"""The API's ASGI app (no web framework): the dashboard's files (``dashboard.py``), authentication, the
JSON GET routes, the ``/v1`` routes (``openai_v1.py``), bounded request bodies, and every error as a
status with a JSON body.

The app never raises into hypercorn: a bug in a route is a 500 and a log line.
"""

from __future__ import annotations

import hmac
import logging
import urllib.parse

from p2pswarm.api import dashboard, http
from p2pswarm.api.http import ClientGone, HttpError, TextReply, error_for, header, send_json, send_text
from p2pswarm.api.openai_v1 import serve_v1
from p2pswarm.api.shares import ClientShares

log = logging.getLogger("p2pswarm.api.serve")


class ApiApp:
    """ASGI: ``routes`` (JSON GET), ``/v1`` when ``completer()`` gives a Completer, ``token`` checked first."""

    def __init__(self, routes: http.Routes, completer: http.CompleterSource, token: str | None) -> None:
        self.routes, self.completer = routes, completer
        self.token = token.encode() if token else None
        self.shares = ClientShares()  # generations per client (api/shares.py): a flood gets half at most

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1003})
        if scope["type"] != "http":
            return
        try:
            await self.dispatch(scope, receive, send)
        except ClientGone:
            log.debug("API client went away before its answer")
        except Exception as exc:
            error = error_for(exc, f"{scope['method']} {scope['path']}")
            try:
                await send_json(send, error.status, error.body())
            except Exception:
                log.debug("could not send the error reply", exc_info=True)

    async def generate(self, scope, receive, send) -> None:
        """``/v1/completions`` within its client's share (``api/shares.py``): 429 at once past it."""
        client = (scope.get("client") or ("unknown", 0))[0]  # the source address: a new one costs a client more
        refused = self.shares.take(client)
        if refused is not None:
            raise HttpError(429, refused, "overloaded", "rate_limit_error")
        try:
            await serve_v1(self.completer(), scope, receive, send)
        finally:
            self.shares.give_back(client)

    def authorized(self, scope: dict) -> bool:
        """No token set, or ``Authorization: Bearer TOKEN`` (compared in constant time)."""
        scheme, _, credentials = (header(scope, b"authorization") or b"").partition(b" ")
        return self.token is None or (scheme.lower() == b"bearer" and hmac.compare_digest(credentials, self.token))

    async def dispatch(self, scope, receive, send) -> None:
        page = dashboard.asset(scope["path"]) if scope["method"] in ("GET", "HEAD") else None
        if page is not None:  # the dashboard's files: no data in them, so no token (api/dashboard.py)
            return await send_text(send, 200, page)
        if not self.authorized(scope):
            raise HttpError(401, "this API needs 'Authorization: Bearer TOKEN' with the node's --api-token",
                            "invalid_api_key")
        path, method = scope["path"], scope["method"]
        if path == "/v1/completions" and method == "POST":
            return await self.generate(scope, receive, send)
        if path.startswith("/v1/"):
            return await serve_v1(self.completer(), scope, receive, send)
        route = self.routes.get(path)
        if route is None:
            return await send_json(send, 404, {"error": f"no such endpoint; try {', '.join(sorted(self.routes))}"})
        if method not in ("GET", "HEAD"):
            return await send_json(send, 405, {"error": f"{path} answers GET only"}, [(b"allow", b"GET")])
        query = scope["query_string"].decode("latin-1")
        try:
            params = {k: v[-1] for k, v in urllib.parse.parse_qs(query, max_num_fields=http.MAX_QUERY_FIELDS).items()}
        except ValueError:
            return await send_json(send, 400, {"error": f"more than {http.MAX_QUERY_FIELDS} query parameters"})
        try:
            doc = await route(params)
        except Exception as exc:  # an exception group from a route's nursery too
            error = error_for(exc, f"status endpoint {path}")
            return await send_json(send, error.status, {"error": str(error)})
        if isinstance(doc, TextReply):
            return await send_text(send, 200, doc)
        await send_json(send, 200, doc)

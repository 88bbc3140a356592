"""hypercorn under the API: its per-connection HTTP/1.1 server driven over our own listeners.

``hypercorn.trio.serve`` binds its own sockets; we bind early (``api.open_api_listeners``), so we
run hypercorn's connection server (``TCPServer``: h11 parsing, the idle timeout before a request
head, keep-alive) on each accepted stream ourselves. Two changes to it:
- every stream is wrapped so that a client that does not take a piece of its reply within
  ``api.REPLY_TIMEOUT`` is dropped (hypercorn's sends wait for ever, shielded from cancellation:
  a client that stopped reading would also keep a node that is asked to stop from stopping);
- HTTP/1.1 only: no switch to h2 (prior knowledge or an h2c upgrade), whose idle connections
  hypercorn does not time out.
"""

from __future__ import annotations

import logging
from functools import partial

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.trio.task_group import TaskGroup
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.typing import ConnectionState
from hypercorn.utils import parse_socket_addr, wrap_app

from p2pswarm.api import http as api

log = api.log


class _ReplyDeadlineStream(trio.abc.HalfCloseableStream):
    """A connection whose every send must finish within api.REPLY_TIMEOUT, else it is closed and
    the send fails as if the client had reset (hypercorn then ends the connection's task)."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.socket = stream.socket  # hypercorn reads the peer's address from it

    async def send_all(self, data) -> None:
        with trio.move_on_after(api.REPLY_TIMEOUT) as sending:
            await self.stream.send_all(data)
        if sending.cancelled_caught:
            log.info("API client did not take its reply within %.0f s; dropped", api.REPLY_TIMEOUT)
            await self.stream.aclose()
            raise trio.BrokenResourceError("client not reading")

    async def wait_send_all_might_not_block(self) -> None:
        await self.stream.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes=None) -> bytes:
        return await self.stream.receive_some(max_bytes)

    async def send_eof(self) -> None:
        await self.stream.send_eof()

    async def aclose(self) -> None:
        await self.stream.aclose()


class _ReplyDeadlineListener(trio.abc.Listener):
    def __init__(self, listener: trio.SocketListener) -> None:
        self.listener = listener

    async def accept(self) -> _ReplyDeadlineStream:
        return _ReplyDeadlineStream(await self.listener.accept())

    async def aclose(self) -> None:
        await self.listener.aclose()


class _Http11Protocol(H11Protocol):
    """HTTP/1.1 only: no switch to h2 (prior knowledge or an h2c upgrade), whose idle connections
    hypercorn does not time out. Such a request is answered as HTTP/1.1."""

    async def _check_protocol(self, event) -> None:
        pass


class _Http11Connection(TCPServer):
    """hypercorn's connection server (idle timeout, reads, shielded sends) speaking ``_Http11Protocol``
    over a plain TCP stream."""

    async def run(self) -> None:
        sock = self.stream.socket  # type: ignore[attr-defined]  # a _ReplyDeadlineStream, not an SSLStream
        try:
            client = parse_socket_addr(sock.family, sock.getpeername())
            server = parse_socket_addr(sock.family, sock.getsockname())
            async with TaskGroup() as task_group:
                self._task_group = task_group
                protocol = _Http11Protocol(self.app, self.config, self.context, task_group,
                                           ConnectionState(self.state), False, client, server, self.protocol_send)
                self.protocol = protocol  # type: ignore[assignment]  # TCPServer calls only what both have
                await self.protocol.initiate()
                await self.idle_task.restart(self._task_group, self._idle_timeout)
                await self._read_data()
        except OSError:
            pass
        finally:
            await self._close()


def hypercorn_config() -> HypercornConfig:
    """Our limits in hypercorn's terms; its messages go to our logger (no access log)."""
    config = HypercornConfig()
    config.h11_max_incomplete_size = api.MAX_HEADER_BYTES
    config.keep_alive_timeout = api.REQUEST_TIMEOUT
    config.include_server_header = False
    config.accesslog = None
    config.errorlog = logging.getLogger("p2pswarm.api.serve.hypercorn")
    return config


async def serve_asgi(app, listeners: list[trio.SocketListener]) -> None:
    """Serve the ASGI ``app`` on ``listeners`` until cancelled."""
    config = hypercorn_config()
    wrapped = wrap_app(app, config.wsgi_max_body_size, "asgi")
    serve_connection = partial(_Http11Connection, wrapped, config, WorkerContext(None), ConnectionState({}))
    await trio.serve_listeners(serve_connection, [_ReplyDeadlineListener(listener) for listener in listeners])

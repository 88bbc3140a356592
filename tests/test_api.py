"""The API's HTTP handling over a real hypercorn server on trio: routes and their error statuses,
garbage, resets, stalls and huge requests that never stop the server, and the exposure rules."""

from __future__ import annotations

import errno
import functools
import json
import logging
import queue
import socket
import struct
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from p2pswarm import wire
from p2pswarm.api import http as api
from p2pswarm.api.serve import check_api_exposure, is_loopback, open_api_listeners, parse_host_port, serve_api
from p2pswarm.errors import ConfigError, DialError, StartupError
from p2pswarm.net.streams import ByteStream

SERVER_DEADLINE = 30.0  # seconds: a failure guard for starting and stopping a test server, never a timing check


async def ok(params: dict) -> dict:
    return {"ok": 1}


async def broken(params: dict) -> dict:
    return 1 / 0


async def echo(params: dict) -> dict:
    if "fail" in params:
        raise {"config": ConfigError, "dial": DialError}[params["fail"]](f"failed: {params['fail']}")
    return params


async def grouped(params: dict) -> dict:
    """A route's nursery wraps what its tasks raise."""
    inner = {"config": ConfigError("bad bytes"), "dial": DialError("cannot reach x"), "bug": ValueError("bug")}
    raise ExceptionGroup("nursery", [ExceptionGroup("inner", [inner[params["fail"]]])])


ROUTES = {"/api/stats": ok, "/api/echo": echo, "/g": grouped, "/x": broken}


@contextmanager
def running_api(routes=ROUTES, **kwargs) -> Iterator[str]:
    """``serve_api`` on 127.0.0.1:0 in its own trio loop in a thread (for blocking clients): yields
    HOST:PORT; on exit stops it and fails the test if the server had ended with an error."""
    started: queue.Queue = queue.Queue()
    outcome: list[BaseException] = []

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            address = await nursery.start(functools.partial(serve_api, "127.0.0.1:0", routes, **kwargs))
            started.put((address, trio.lowlevel.current_trio_token(), nursery.cancel_scope))

    def run() -> None:
        try:
            trio.run(main)
        except BaseException as exc:
            outcome.append(exc)
            started.put(None)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    ready = started.get(timeout=SERVER_DEADLINE)
    assert ready is not None, f"the server did not start: {outcome!r}"
    address, token, scope = ready
    try:
        yield address
    finally:
        if thread.is_alive():
            try:
                trio.from_thread.run_sync(scope.cancel, trio_token=token)
            except trio.RunFinishedError:
                pass
        thread.join(SERVER_DEADLINE)
        assert not thread.is_alive(), "the server did not stop"
        assert not outcome, f"the server ended with {outcome[0]!r}"


def http(address: str, path: str, data: bytes | None = None, headers: dict | None = None,
         method: str | None = None) -> tuple[int, bytes]:
    """(status, body) of one request; error statuses too."""
    request = urllib.request.Request(f"http://{address}{path}", data=data, headers=headers or {}, method=method)
    try:
        with urllib.request.urlopen(request, timeout=SERVER_DEADLINE) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


RESET_BY_SERVER = (errno.EPIPE, errno.ECONNRESET, errno.ENOTCONN)


def raw_exchange(address: str, data: bytes) -> bytes:
    """Send ``data``, close our sending side, read the answer to the end.

    A server that answers before reading everything (a 431) closes a socket with unread bytes, so
    its kernel resets the connection: our send or half-close may then fail, and the answer sent
    before the reset is still ours to read."""
    host, port = parse_host_port(address)
    with socket.create_connection((host, port), timeout=SERVER_DEADLINE) as sock:
        try:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
        except OSError as exc:
            if exc.errno not in RESET_BY_SERVER:
                raise
        answer = b""
        try:
            while chunk := sock.recv(65536):
                answer += chunk
        except ConnectionResetError:
            pass
        return answer


def status_of(response: bytes) -> int:
    return int(response.split(b" ", 2)[1])


def test_query_parameters_reach_the_route_and_errors_map_to_statuses():
    with running_api() as address:
        status, body = http(address, "/api/echo?peer=Qm%2Fx&bytes=5&bytes=7")
        assert status == 200 and json.loads(body) == {"peer": "Qm/x", "bytes": "7"}
        assert http(address, "/api/echo?fail=config")[0] == 400
        status, body = http(address, "/api/echo?fail=dial")
        assert status == 502 and json.loads(body) == {"error": "failed: dial"}
        flood = "&".join(f"p{i}=1" for i in range(api.MAX_QUERY_FIELDS + 1))
        assert http(address, f"/api/echo?{flood}")[0] == 400


def test_errors_inside_exception_groups_map_to_their_statuses(caplog):
    with running_api() as address:
        status, body = http(address, "/g?fail=config")
        assert status == 400 and b"bad bytes" in body
        status, body = http(address, "/g?fail=dial")
        assert status == 502 and b"cannot reach x" in body
        assert http(address, "/g?fail=bug")[0] == 500
    assert [r for r in caplog.records if r.exc_info], "the bug was not logged"


def test_routes_and_methods():
    with running_api() as address:
        assert http(address, "/api/stats") == (200, json.dumps({"ok": 1}, indent=1).encode())
        status, body = http(address, "/nope")
        assert status == 404 and "/api/stats" in json.loads(body)["error"]
        assert http(address, "/api/stats", data=b"{}")[0] == 405  # a POST


def test_failing_endpoint_is_a_500_not_a_crash():
    with running_api() as address:
        status, body = http(address, "/x")
        assert status == 500 and json.loads(body) == {"error": "status endpoint /x failed"}
        assert http(address, "/api/stats")[0] == 200


def test_any_request_bytes_get_an_http_answer():
    """Whatever bytes a client sends before closing its side, it gets an HTTP status line, and the
    server goes on serving (one server for all the examples)."""
    with running_api() as address:

        @settings(max_examples=60)
        @given(st.binary(min_size=1, max_size=300) | st.builds(lambda tail: b"GET /api/stats HTTP/1.1\r\n" + tail,
                                                                st.binary(max_size=200)))
        def answered(request: bytes) -> None:
            assert raw_exchange(address, request).startswith(b"HTTP/1.1 ")

        answered()
        assert http(address, "/api/stats")[0] == 200


def test_an_h2_preface_or_upgrade_is_answered_as_http_1_1():
    """HTTP/2 (whose idle connections hypercorn does not time out) is never spoken."""
    with running_api() as address:
        assert raw_exchange(address, b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n").startswith(b"HTTP/1.1 404")
        upgrade = (b"GET /api/stats HTTP/1.1\r\nHost: x\r\nConnection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\n"
                   b"HTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n\r\n")
        assert raw_exchange(address, upgrade).startswith(b"HTTP/1.1 200")


def test_a_request_head_larger_than_the_bound_is_refused():
    """h11 refuses a head still incomplete past MAX_HEADER_BYTES (what one 64 KiB read brings is parsed whole)."""
    with running_api() as address:
        big = b"GET /api/stats HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (api.MAX_HEADER_BYTES + (1 << 17)) + b"\r\n\r\n"
        assert status_of(raw_exchange(address, big)) == 431
        assert http(address, "/api/stats")[0] == 200


def test_parse_host_port():
    assert parse_host_port("127.0.0.1:8700") == ("127.0.0.1", 8700)
    for bad in ["8700", "host:", ":80", "h:99999", "h:x"]:
        with pytest.raises(ConfigError):
            parse_host_port(bad)


def test_only_loopback_binds_without_a_token():
    assert all(is_loopback(h) for h in ["127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"])
    assert not any(is_loopback(h) for h in ["0.0.0.0", "::", "192.168.1.5", "example.org"])
    check_api_exposure("127.0.0.1:8700", None)
    check_api_exposure("0.0.0.0:8700", "secret")
    for address in ["0.0.0.0:8700", "[::]:8700", "10.0.0.1:80"]:
        with pytest.raises(ConfigError, match="--api-token"):
            check_api_exposure(address, None)


def test_a_port_in_use_fails_at_bind_time():
    async def main():
        listeners = await open_api_listeners("127.0.0.1:0")
        port = listeners[0].socket.getsockname()[1]
        with pytest.raises(StartupError, match="cannot serve the API"):
            await open_api_listeners(f"127.0.0.1:{port}")
        await listeners[0].aclose()

    trio.run(main)


def test_served_over_tcp_on_listeners_bound_early():
    async def main():
        async with trio.open_nursery() as nursery:
            listeners = await open_api_listeners("127.0.0.1:0")
            address = await nursery.start(serve_api, listeners, ROUTES)
            assert address.endswith(f":{listeners[0].socket.getsockname()[1]}")
            body = await trio.to_thread.run_sync(
                lambda: urllib.request.urlopen(f"http://{address}/api/stats", timeout=5).read())
            assert json.loads(body) == {"ok": 1}
            nursery.cancel_scope.cancel()

    trio.run(main)


def _reset(sock: trio.socket.SocketType) -> None:
    """Close ``sock`` with SO_LINGER 0: the kernel sends a TCP RST instead of a FIN."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


async def _get(address: str, path: str = "/api/stats") -> bytes:
    return await trio.to_thread.run_sync(
        lambda: urllib.request.urlopen(f"http://{address}{path}", timeout=5).read())


async def _connected_client(address: str) -> trio.socket.SocketType:
    host, port = parse_host_port(address)
    sock = trio.socket.socket()
    await sock.connect((host, port))
    return sock


def test_a_client_resetting_mid_request_does_not_stop_the_server():
    """Half a request, then RST: the reset stays inside that connection's task."""

    async def main():
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                address = await nursery.start(serve_api, "127.0.0.1:0", ROUTES)
                for _ in range(3):
                    sock = await _connected_client(address)
                    await sock.send(b"GET /api/sta")
                    _reset(sock)
                    assert json.loads(await _get(address)) == {"ok": 1}
                nursery.cancel_scope.cancel()

    trio.run(main)


def test_a_client_resetting_before_the_reply_does_not_stop_the_server():
    """A whole request, then RST while the route is still working: the reply meets a dead socket."""
    reset_done = trio.Event()

    async def slow(params: dict) -> dict:
        await reset_done.wait()
        return {"big": "x" * 100_000}

    async def main():
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                address = await nursery.start(serve_api, "127.0.0.1:0", {"/slow": slow, **ROUTES})
                sock = await _connected_client(address)
                await sock.send(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
                _reset(sock)
                reset_done.set()
                assert json.loads(await _get(address)) == {"ok": 1}
                nursery.cancel_scope.cancel()

    trio.run(main)


async def _read_to_eof(sock: trio.socket.SocketType) -> bytes:
    data = b""
    while chunk := await sock.recv(65536):
        data += chunk
    return data


def test_silent_slow_garbage_and_non_reading_clients_end_in_their_own_task(monkeypatch, caplog):
    """A client that sends nothing, or its request head a byte at a time, is dropped after
    REQUEST_TIMEOUT; garbage gets a 400; a client that never reads its reply is dropped after
    REPLY_TIMEOUT; others are served all along, and the server stops promptly when cancelled."""
    monkeypatch.setattr(api, "REQUEST_TIMEOUT", 0.3)
    monkeypatch.setattr(api, "REPLY_TIMEOUT", 0.3)
    caplog.set_level(logging.INFO, logger=api.log.name)
    big = {"big": "x" * (32 << 20)}  # far more than the socket buffers hold

    async def huge(params: dict) -> dict:
        return big

    async def drip(sock: trio.socket.SocketType) -> None:
        """A request head, a byte every 50 ms, until the server closes the connection."""
        try:
            for byte in b"GET /api/stats HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 10_000:
                await sock.send(bytes([byte]))
                await trio.sleep(0.05)
        except OSError:
            return
        raise AssertionError("a slow request head was never cut off")

    async def main():
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                address = await nursery.start(serve_api, "127.0.0.1:0", {"/huge": huge, **ROUTES})
                silent, garbage, stuck, slow = [await _connected_client(address) for _ in range(4)]
                await garbage.send(b"\x00\xff" * 100 + b"\r\n\r\n")
                await stuck.send(b"GET /huge HTTP/1.1\r\nHost: x\r\n\r\n")
                assert json.loads(await _get(address)) == {"ok": 1}
                assert status_of(await _read_to_eof(garbage)) == 400
                assert await _read_to_eof(silent) == b""  # closed, unanswered
                await drip(slow)
                while not any("did not take its reply" in m for m in caplog.messages):
                    await trio.sleep(0.01)
                assert len(await _read_to_eof(stuck)) < len(json.dumps(big))  # cut off, not delivered
                for sock in (silent, garbage, stuck, slow):
                    sock.close()
                assert json.loads(await _get(address)) == {"ok": 1}
                nursery.cancel_scope.cancel()

    trio.run(main)


def test_a_stuck_client_does_not_hold_up_the_servers_shutdown(monkeypatch):
    """hypercorn's sends are shielded from cancellation, and a cancelled connection waits for its
    app's task: without our reply deadline, a client that never reads would keep a cancelled server
    (a node asked to stop) waiting for ever."""
    monkeypatch.setattr(api, "REPLY_TIMEOUT", 0.5)

    async def huge(params: dict) -> dict:
        return {"big": "x" * (32 << 20)}  # far more than the socket buffers hold

    async def main():
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                address = await nursery.start(serve_api, "127.0.0.1:0", {"/huge": huge})
                stuck = await _connected_client(address)
                await stuck.send(b"GET /huge HTTP/1.1\r\nHost: x\r\n\r\n")
                assert (await stuck.recv(16)).startswith(b"HTTP/1.1 200")  # the reply is on its way
                nursery.cancel_scope.cancel()
        stuck.close()

    trio.run(main)


# --- /api/ping to a peer that does not speak p2pswarm ---------------------------------------------


async def _http_status_and_body(address: str, path: str) -> tuple[int, dict]:
    def fetch() -> tuple[int, dict]:
        try:
            with urllib.request.urlopen(f"http://{address}{path}", timeout=20) as response:
                return response.status, json.load(response)
        except urllib.error.HTTPError as exc:
            return exc.code, json.load(exc)

    return await trio.to_thread.run_sync(fetch)


async def _garbage_ack(raw_stream) -> None:
    """A probe server that reads the pushed frames, then answers with bytes that are no frame."""
    stream = ByteStream(raw_stream)
    while (frame := await wire.read_frame(stream)) is not None and not frame[0].last:
        pass
    await stream.write(b"\x00\x00\x00\x03abc")
    await stream.close()


def test_ping_of_a_peer_without_our_control_protocol_is_a_502_naming_the_reason(caplog):
    """The node's /api/ping route (net/probe_api.py over a real host, ControlService and
    Connector) pinging a plain libp2p host: a 502 with the reason, no 500, no traceback."""
    from p2pswarm.identity import generate_identity
    from p2pswarm.net import probe
    from p2pswarm.net.connect import Connector
    from p2pswarm.net.control import CONTROL_PROTOCOL, ControlService
    from p2pswarm.net.host import open_host
    from p2pswarm.net.probe_api import PingRoute

    async def no_addrs(peer: str) -> tuple[str, ...]:
        return ()

    async def main():
        with trio.fail_after(60):
            async with open_host(generate_identity(), ["/ip4/127.0.0.1/tcp/0"]) as plain, \
                    open_host(generate_identity(), ["/ip4/127.0.0.1/tcp/0"]) as host, trio.open_nursery() as nursery:
                connector = Connector(host, nursery)
                control = ControlService(host, nursery, connector)
                probe.register(host, control)
                routes = PingRoute(host, connector, control, no_addrs).routes()
                address = await nursery.start(serve_api, "127.0.0.1:0", routes)
                query = urllib.parse.urlencode({"peer": str(plain.get_addrs()[0]), "bytes": 1024})
                status, body = await _http_status_and_body(address, f"/api/ping?{query}")
                assert status == 502, body
                assert CONTROL_PROTOCOL in body["error"] and str(plain.get_id()) in body["error"], body
                with pytest.raises(DialError):  # the plain error, not an exception group
                    await probe.probe(host, connector, control, str(plain.get_id()))

                # Now it answers pings but acknowledges a push with garbage: still a 502.
                ControlService(plain, nursery).handle(wire.Ping, probe.answer_ping)
                plain.set_stream_handler(probe.PROBE_PROTOCOL, _garbage_ack)
                status, body = await _http_status_and_body(address, f"/api/ping?{query}")
                assert status == 502 and "invalid frame" in body["error"], body
                nursery.cancel_scope.cancel()

    trio.run(main)
    assert not [r for r in caplog.records if r.name == api.log.name and r.exc_info], "a traceback was logged"

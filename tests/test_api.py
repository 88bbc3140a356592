"""The status API's HTTP handling, pure (no sockets) and over a real trio listener."""

from __future__ import annotations

import json
import logging
import socket
import struct
import urllib.error
import urllib.parse
import urllib.request

import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from p2pswarm import api, wire
from p2pswarm.api import parse_host_port, serve_api
from p2pswarm.errors import ConfigError, DialError
from p2pswarm.net.streams import ByteStream

async def ok(params: dict) -> dict:
    return {"ok": 1}


async def broken(params: dict) -> dict:
    return 1 / 0


async def echo(params: dict) -> dict:
    if "fail" in params:
        raise {"config": ConfigError, "dial": DialError}[params["fail"]](f"failed: {params['fail']}")
    return params


ROUTES = {"/api/stats": ok}


def respond(request: bytes, routes) -> bytes:
    return trio.run(api.respond, request, routes)


def status_of(response: bytes) -> int:
    return int(response.split(b" ", 2)[1])


def test_query_parameters_reach_the_route_and_errors_map_to_statuses():
    routes = {"/api/echo": echo}
    response = respond(b"GET /api/echo?peer=Qm%2Fx&bytes=5&bytes=7 HTTP/1.1\r\n\r\n", routes)
    assert status_of(response) == 200
    assert json.loads(response.split(b"\r\n\r\n", 1)[1]) == {"peer": "Qm/x", "bytes": "7"}
    assert status_of(respond(b"GET /api/echo?fail=config HTTP/1.1\r\n\r\n", routes)) == 400
    dial = respond(b"GET /api/echo?fail=dial HTTP/1.1\r\n\r\n", routes)
    assert status_of(dial) == 502 and b"failed: dial" in dial
    flood = "&".join(f"p{i}=1" for i in range(api.MAX_QUERY_FIELDS + 1))
    assert status_of(respond(f"GET /api/echo?{flood} HTTP/1.1\r\n\r\n".encode(), routes)) == 400


def test_errors_inside_exception_groups_map_to_their_statuses():
    """A route's nursery wraps what its tasks raise: the status comes from the error inside."""

    async def grouped(params: dict) -> dict:
        inner = {"config": ConfigError("bad bytes"), "dial": DialError("cannot reach x"), "bug": ValueError("bug")}
        raise ExceptionGroup("nursery", [ExceptionGroup("inner", [inner[params["fail"]]])])

    routes = {"/g": grouped}
    config = respond(b"GET /g?fail=config HTTP/1.1\r\n\r\n", routes)
    assert status_of(config) == 400 and b"bad bytes" in config
    dial = respond(b"GET /g?fail=dial HTTP/1.1\r\n\r\n", routes)
    assert status_of(dial) == 502 and b"cannot reach x" in dial
    assert status_of(respond(b"GET /g?fail=bug HTTP/1.1\r\n\r\n", routes)) == 500


def test_routes():
    assert status_of(respond(b"GET /api/stats HTTP/1.1\r\n\r\n", ROUTES)) == 200
    assert json.loads(respond(b"GET /api/stats HTTP/1.1\r\n\r\n", ROUTES).split(b"\r\n\r\n", 1)[1]) == {"ok": 1}
    assert status_of(respond(b"GET /nope HTTP/1.1\r\n\r\n", ROUTES)) == 404
    assert status_of(respond(b"POST /api/stats HTTP/1.1\r\n\r\n", ROUTES)) == 405


@given(st.binary(max_size=300))
def test_any_request_bytes_get_an_http_answer(request):
    assert respond(request, ROUTES).startswith(b"HTTP/1.1 ")


def test_failing_endpoint_is_a_500_not_a_crash():
    assert status_of(respond(b"GET /x HTTP/1.1\r\n\r\n", {"/x": broken})) == 500


def test_parse_host_port():
    assert parse_host_port("127.0.0.1:8700") == ("127.0.0.1", 8700)
    for bad in ["8700", "host:", ":80", "h:99999", "h:x"]:
        with pytest.raises(ConfigError):
            parse_host_port(bad)


def test_served_over_tcp():
    async def main():
        async with trio.open_nursery() as nursery:
            address = await nursery.start(serve_api, "127.0.0.1:0", ROUTES)
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
                await sock.send(b"GET /slow HTTP/1.1\r\n\r\n")
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


def test_silent_garbage_and_non_reading_clients_end_in_their_own_task(monkeypatch, caplog):
    """A client that sends nothing gets a 400 after REQUEST_TIMEOUT, garbage gets a 400, a client
    that never reads its reply is dropped after REPLY_TIMEOUT; others are served all along."""
    monkeypatch.setattr(api, "REQUEST_TIMEOUT", 0.2)
    monkeypatch.setattr(api, "REPLY_TIMEOUT", 0.2)
    caplog.set_level(logging.INFO, logger=api.log.name)
    big = {"big": "x" * (32 << 20)}  # far more than the socket buffers hold

    async def huge(params: dict) -> dict:
        return big

    async def main():
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                address = await nursery.start(serve_api, "127.0.0.1:0", {"/huge": huge, **ROUTES})
                silent, garbage, stuck = [await _connected_client(address) for _ in range(3)]
                await garbage.send(b"\x00\xff" * 100 + b"\r\n\r\n")
                await stuck.send(b"GET /huge HTTP/1.1\r\n\r\n")
                assert json.loads(await _get(address)) == {"ok": 1}
                assert status_of(await _read_to_eof(garbage)) == 400
                assert status_of(await _read_to_eof(silent)) == 400
                while not any("did not take its reply" in m for m in caplog.messages):
                    await trio.sleep(0.01)
                assert len(await _read_to_eof(stuck)) < len(json.dumps(big))  # cut off, not delivered
                for sock in (silent, garbage, stuck):
                    sock.close()
                assert json.loads(await _get(address)) == {"ok": 1}
                nursery.cancel_scope.cancel()

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

"""The relay: its pure admission core, then real hosts on loopback, then the command line."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st
from libp2p.network.stream.exceptions import StreamEOF

from p2pswarm.errors import ConfigError
from p2pswarm.identity import generate_identity
from p2pswarm.nat.relay_service import (
    HOP_PROTOCOL,
    STATUS_NO_RESERVATION,
    STATUS_OK,
    STATUS_RESERVATION_REFUSED,
    STATUS_RESOURCE_LIMIT_EXCEEDED,
    Refusal,
    RelayBook,
    RelayConfig,
    load_relay_config,
    serve_relay,
)
from p2pswarm.net.host import connect, open_host, peer_info_from_multiaddr
from tests.test_cli import assert_one_line_error, run

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
SMALL = RelayConfig(max_reservations=3, max_reservations_per_ip=2, reservation_ttl=10, max_circuits_per_peer=2,
                    max_circuits=3)

# ---------------------------------------------------------------- pure core

ops = st.lists(st.tuples(st.sampled_from(["reserve", "release", "open", "close", "tick"]),
                         st.integers(0, 5), st.integers(0, 5), st.sampled_from(["1.1.1.1", "2.2.2.2", None])),
               max_size=80)


@given(ops)
def test_book_never_admits_past_a_limit(steps):
    book, now, open_ids = RelayBook(SMALL), 0.0, []
    for op, a, b, ip in steps:
        if op == "reserve":
            book.reserve(a, ip, now)
        elif op == "release":
            book.release_reservation(a)
        elif op == "open":
            result = book.open_circuit(a, b, now)
            if not isinstance(result, Refusal):
                open_ids.append(result)
        elif op == "close" and open_ids:
            book.close_circuit(open_ids.pop(a % len(open_ids)))
        else:
            now += 4
        book.expire(now)
        assert len(book.reservations) <= SMALL.max_reservations
        per_ip = [i for i, _ in book.reservations.values() if i is not None]
        assert all(per_ip.count(i) <= SMALL.max_reservations_per_ip for i in per_ip)
        assert len(book.circuits) <= SMALL.max_circuits
        assert all(book.circuits_of(p) <= SMALL.max_circuits_per_peer for p in range(6))
    for circuit_id in open_ids:
        book.close_circuit(circuit_id)
    book.expire(now + SMALL.reservation_ttl)
    assert book.stats(now + SMALL.reservation_ttl)["reservations_active"] == 0
    assert book.stats(now)["circuits_active"] == 0


def test_book_refuses_with_the_spec_status_and_counts_reasons():
    book = RelayBook(SMALL)
    assert book.reserve("a", "1.1.1.1", 0) is None
    assert book.reserve("b", "1.1.1.1", 0) is None
    assert book.reserve("c", "1.1.1.1", 0) == Refusal("reservations_per_ip", STATUS_RESERVATION_REFUSED)
    assert book.reserve("a", "1.1.1.1", 1) is None  # a refresh is not a new slot
    assert book.reserve("c", "2.2.2.2", 0) is None
    assert book.reserve("d", "3.3.3.3", 0) == Refusal("reservations_total", STATUS_RESERVATION_REFUSED)
    assert book.open_circuit("x", "nobody", 0) == Refusal("no_reservation", STATUS_NO_RESERVATION)
    first, second = book.open_circuit("x", "a", 0), book.open_circuit("y", "a", 0)
    assert book.open_circuit("z", "a", 0) == Refusal("circuits_per_peer", STATUS_RESOURCE_LIMIT_EXCEEDED)
    book.open_circuit("z", "b", 0)
    assert book.open_circuit("w", "c", 0) == Refusal("circuits_total", STATUS_RESOURCE_LIMIT_EXCEEDED)
    book.close_circuit(first)
    assert not isinstance(book.open_circuit("z", "a", 0), Refusal)
    assert book.stats(0)["refused"] == {"circuits_per_peer": 1, "circuits_total": 1, "no_reservation": 1,
                                        "reservations_per_ip": 1, "reservations_total": 1}
    assert book.stats(10.5)["reservations_active"] == 1  # a, refreshed at t=1, outlives b and c
    assert book.stats(11)["reservations_active"] == 0
    del second


def test_config_file(tmp_path):
    good = tmp_path / "good.toml"
    good.write_text("max_reservations = 7\ncircuit_duration = 30\n")
    assert load_relay_config(good) == RelayConfig(max_reservations=7, circuit_duration=30)
    for text, word in [("bogus = 1", "unknown key"), ("max_reservations = -1", "positive"),
                       ("max_reservations = 1.5", "integer"), ("circuit_bytes = 'lots'", "positive"),
                       ("max_reservations = ", "TOML")]:
        (tmp_path / "bad.toml").write_text(text)
        with pytest.raises(ConfigError, match=word):
            load_relay_config(tmp_path / "bad.toml")


# ---------------------------------------------------------------- real hosts

def with_relay(config: RelayConfig, test, n_clients: int = 2):
    """Run ``test(relay_protocol, relay_host, clients)`` with clients connected to a relay host."""
    async def main():
        async with open_host(generate_identity(), LOOPBACK) as relay_host:
            clients = []
            async with trio.open_nursery() as nursery:
                protocol = await nursery.start(serve_relay, relay_host, config)
                relay_info = peer_info_from_multiaddr(str(relay_host.get_addrs()[0]))
                async with _open_hosts(n_clients) as clients:
                    for client in clients:
                        await connect(client, relay_info)
                    with trio.fail_after(25):
                        await test(protocol, relay_host, clients)
                nursery.cancel_scope.cancel()

    trio.run(main)


def _open_hosts(n: int):
    from contextlib import AsyncExitStack, asynccontextmanager

    @asynccontextmanager
    async def hosts():
        async with AsyncExitStack() as stack:
            yield [await stack.enter_async_context(open_host(generate_identity(), LOOPBACK)) for _ in range(n)]
    return hosts()


async def hop(client, relay_id, message):
    """Send one HOP message on a new stream; the stream and the relay's STATUS reply."""
    from libp2p.relay.circuit_v2.pb.circuit_pb2 import HopMessage
    from libp2p.relay.circuit_v2.utils import read_delimited_msg, write_delimited_msg

    stream = await client.new_stream(relay_id, [HOP_PROTOCOL])
    await write_delimited_msg(stream, message)
    return stream, await read_delimited_msg(stream, HopMessage)


async def raw_reserve(client, relay_id) -> int:
    from libp2p.relay.circuit_v2.pb.circuit_pb2 import HopMessage

    stream, reply = await hop(client, relay_id, HopMessage(type=HopMessage.RESERVE))
    await stream.close()
    return reply.status


def accept_circuits(host, received: list, closed: trio.Event):
    """A destination's STOP handler: accept, then collect relayed bytes until the circuit ends."""
    from libp2p.relay.circuit_v2.pb.circuit_pb2 import StopMessage
    from libp2p.relay.circuit_v2.protocol import STOP_PROTOCOL_ID
    from libp2p.relay.circuit_v2.utils import read_delimited_msg, write_delimited_msg

    async def handler(stream):
        await read_delimited_msg(stream, StopMessage)
        await write_delimited_msg(stream, StopMessage(type=StopMessage.STATUS, status=STATUS_OK))
        try:
            while data := await stream.read(65536):
                received.append(data)
                if data == b"ping":  # a one-shot exchange: answer, then close our side
                    await stream.write(b"pong")
                    await stream.close()
                    break
        except Exception:  # a reset ends the circuit as much as an EOF does
            pass
        closed.set()

    host.set_stream_handler(STOP_PROTOCOL_ID, handler)


async def open_circuit(source, relay_id, destination_id):
    from libp2p.relay.circuit_v2.pb.circuit_pb2 import HopMessage, PeerId

    return await hop(source, relay_id, HopMessage(type=HopMessage.CONNECT, peer=PeerId(id=destination_id.to_bytes())))


def test_reservation_with_py_libp2p_client_then_refusal_past_the_limit():
    async def test(protocol, relay_host, clients):
        from libp2p.relay.circuit_v2.config import RelayConfig as LibRelayConfig
        from libp2p.relay.circuit_v2.protocol import CircuitV2Protocol
        from libp2p.relay.circuit_v2.transport import CircuitV2Transport

        first, second = clients
        transport = CircuitV2Transport(first, CircuitV2Protocol(first), LibRelayConfig())
        async with trio.open_nursery() as nursery:
            stream = await first.new_stream(relay_host.get_id(), [HOP_PROTOCOL])
            assert await transport.reserve(stream, relay_host.get_id(), nursery)
            nursery.cancel_scope.cancel()
        assert await raw_reserve(second, relay_host.get_id()) == STATUS_RESERVATION_REFUSED
        stats = protocol.book.stats(time.monotonic())
        assert stats["reservations_active"] == 1 and stats["refused"] == {"reservations_total": 1}

    with_relay(RelayConfig(max_reservations=1), test)


def test_a_reservation_ends_with_its_last_connection():
    """Clients from one IP come and go, one after another, more of them than the per-IP and total
    limits: each is accepted, because a departed client's reservation is dropped from our book and
    from the library's own table (which used to keep it for the whole TTL and refuse everyone)."""
    from p2pswarm.testing.churn import one_lifetime, reserve_work

    async def test(protocol, relay_host, clients):
        addr = str(relay_host.get_addrs()[0])
        for _ in range(3 * SMALL.max_reservations):
            await one_lifetime(addr, reserve_work)
        with trio.fail_after(10):
            while protocol.book.reservations or protocol.resource_manager._reservations:
                await trio.sleep(0.05)
        assert protocol.book.refused == {}
        await raw_reserve(clients[0], relay_host.get_id())  # a connected client keeps its reservation
        await clients[1].disconnect(relay_host.get_id())
        assert list(protocol.book.reservations) == [clients[0].get_id()]

    with_relay(SMALL, test)


def test_circuit_carries_data_and_refusals_use_spec_codes():
    async def test(protocol, relay_host, clients):
        source, destination, stranger = clients
        received, closed = [], trio.Event()
        accept_circuits(destination, received, closed)
        relay_id = relay_host.get_id()
        _, reply = await open_circuit(source, relay_id, destination.get_id())
        assert reply.status == STATUS_NO_RESERVATION  # the destination has not reserved yet
        assert await raw_reserve(destination, relay_id) == STATUS_OK
        stream, reply = await open_circuit(source, relay_id, destination.get_id())
        assert reply.status == STATUS_OK and reply.limit.data == 16 * 1024 * 1024
        await stream.write(b"ping")
        assert await stream.read(4) == b"pong"
        assert protocol.book.stats(0)["circuits_active"] == 1
        _, reply = await open_circuit(stranger, relay_id, destination.get_id())
        assert reply.status == STATUS_RESOURCE_LIMIT_EXCEEDED  # one circuit per peer here
        with trio.fail_after(10):
            await closed.wait()
            with pytest.raises(StreamEOF):  # the relay passed the destination's close on
                assert await stream.read(4) == b""
            await stream.close()
            while protocol.book.circuits:
                await trio.sleep(0.05)
        assert received[0] == b"ping"

    with_relay(RelayConfig(max_circuits_per_peer=1), test, n_clients=3)


def test_idle_circuit_is_closed_at_its_duration():
    async def test(protocol, relay_host, clients):
        source, destination = clients
        received, closed = [], trio.Event()
        accept_circuits(destination, received, closed)
        assert await raw_reserve(destination, relay_host.get_id()) == STATUS_OK
        stream, reply = await open_circuit(source, relay_host.get_id(), destination.get_id())
        assert reply.status == STATUS_OK and protocol.book.closed_at_duration == 0
        with trio.fail_after(10):  # a failure guard: the circuit lasts 1 s
            await closed.wait()  # no byte ever flows, yet the relay ends the circuit
        assert received == []
        with trio.fail_after(5):
            try:
                assert await stream.read(100) == b""
            except Exception:
                pass  # reset: the source sees the end too
        with trio.fail_after(5):
            while protocol.book.circuits:  # released once both directions have stopped
                await trio.sleep(0.02)
        assert protocol.book.closed_at_duration == 1  # its duration timer ended it, nothing else

    with_relay(RelayConfig(circuit_duration=1.0), test)


def test_circuit_is_closed_after_its_byte_budget():
    async def test(protocol, relay_host, clients):
        source, destination = clients
        received, closed = [], trio.Event()
        accept_circuits(destination, received, closed)
        assert await raw_reserve(destination, relay_host.get_id()) == STATUS_OK
        stream, reply = await open_circuit(source, relay_host.get_id(), destination.get_id())
        assert reply.status == STATUS_OK and reply.limit.data == 1000
        try:
            for _ in range(30):
                await stream.write(b"x" * 100)
                await trio.sleep(0.02)
        except Exception:
            pass  # the relay reset the stream
        with trio.fail_after(10):
            await closed.wait()
        assert 0 < sum(map(len, received)) <= 1000

    with_relay(RelayConfig(circuit_bytes=1000), test)


# ---------------------------------------------------------------- command line

@pytest.mark.integration
def test_relay_with_bad_config_exits_1_with_one_line(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("max_reservations = 0\n")
    assert_one_line_error(run("relay", "--listen", "/ip4/127.0.0.1/tcp/0", "--config", str(bad)), "max_reservations")
    bad.write_text("nonsense = 1\n")
    assert_one_line_error(run("relay", "--config", str(bad)), "unknown key")


@pytest.mark.integration
def test_relay_prints_its_address_and_stops_on_sigint(tmp_path):
    config = tmp_path / "relay.toml"
    config.write_text("max_reservations = 8\n")
    process = subprocess.Popen([sys.executable, "-m", "p2pswarm", "relay", "--listen", "/ip4/127.0.0.1/tcp/0",
                                "--config", str(config)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        addr = process.stdout.readline().strip()
        assert addr.startswith("/ip4/127.0.0.1/tcp/") and "/p2p/12D3" in addr
        port = int(addr.split("/")[4])
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=25)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, stderr
    with socket.socket() as probe:
        assert probe.connect_ex(("127.0.0.1", port)) != 0, "the listener outlived the node"


def test_an_older_circuit_ending_leaves_the_newer_one_to_the_same_peer_alone():
    """py-libp2p keeps one circuit per peer in ``_active_relays``: when a peer's older circuit
    ended, the library closed the streams of its newer one (a reconnect died seconds later)."""

    async def test(protocol, relay_host, clients):
        source, destination = clients
        received, closed = [], trio.Event()
        accept_circuits(destination, received, closed)
        relay_id = relay_host.get_id()
        assert await raw_reserve(destination, relay_id) == STATUS_OK
        older, reply = await open_circuit(source, relay_id, destination.get_id())
        assert reply.status == STATUS_OK
        newer, reply = await open_circuit(source, relay_id, destination.get_id())
        assert reply.status == STATUS_OK
        await older.write(b"ping")
        with trio.fail_after(10):
            assert await older.read(4) == b"pong"
            await closed.wait()  # the destination ended the older circuit
            while len(protocol.book.circuits) > 1:  # released after the library's own clean-up ran
                await trio.sleep(0.02)
        await newer.write(b"still here")
        with trio.fail_after(5):
            while b"still here" not in received:
                await trio.sleep(0.02)
        assert len(protocol.book.circuits) == 1

    with_relay(RelayConfig(), test)

"""The STUN client: a total decoder, hard packet and time bounds, and real stund on loopback.

Time bounds (the retransmission schedule, the classification timeout) are asserted on trio's
MockClock against an in-memory silent socket: virtual time, exact, whatever the machine's load.
Tests on real sockets assert packets, answers and verdicts; their deadlines only guard against
a hang. Network: 127.0.0.0/8 only. stund (Debian ``stun-server``) runs as a subprocess in single-IP mode
(``-h 127.0.0.1``: it advertises CHANGED-ADDRESS 0.0.0.0 and drops change-IP requests) and in full
mode on 127.0.0.1 + 127.0.0.2. NAT behaviours are simulated by an in-process four-socket server
that lies about the mapped address and drops what the simulated NAT would filter.
"""

import ipaddress
import logging
import os
import random
import shutil
import signal
import socket
import struct
import subprocess

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st
from trio.testing import MockClock

from p2pswarm.errors import ConfigError, LocalProtocolError, RemoteProtocolError
from p2pswarm.nat import stun
from p2pswarm.nat.stun import (
    MAGIC_COOKIE,
    MAX_CLASSIFY_PACKETS,
    BindingResult,
    NatType,
    binding,
    classify_nat,
    decode_binding_response,
    encode_binding_request,
    parse_stun_server,
)

FAST = settings(max_examples=300, deadline=None)
UDP = (socket.AF_INET, socket.SOCK_DGRAM)
TRIO_SOCKET = trio.socket.socket  # tests' own sockets; the ``sent`` fixture counts only stun.py's
EVENT_GUARD_S = 10.0  # failure guard only: a loopback packet arrives in microseconds
POLL_S = 0.01  # how often a test looks again for the event it waits for

# ------------------------------------------------------------------- test-side encoder


def address_attr(attr_type: int, ip: str, port: int, xor: bool = False) -> tuple[int, bytes]:
    raw_ip = int(ipaddress.IPv4Address(ip))
    if xor:
        port, raw_ip = port ^ (MAGIC_COOKIE >> 16), raw_ip ^ MAGIC_COOKIE
    return attr_type, struct.pack("!BBHI", 0, 1, port, raw_ip)


def error_attr(code: int, reason: bytes = b"Unknown Attribute") -> tuple[int, bytes]:
    return 0x0009, struct.pack("!HBB", 0, code // 100, code % 100) + reason


def response(tid: bytes, attrs=(), kind: int = 0x0101, cookie: int = MAGIC_COOKIE) -> bytes:
    body = b""
    for attr_type, value in attrs:
        body += struct.pack("!HH", attr_type, len(value)) + value + b"\0" * (-len(value) % 4)
    return struct.pack("!HHI", kind, len(body), cookie) + tid + body


tids = st.binary(min_size=12, max_size=12)
ipv4s = st.integers(0, 2**32 - 1).map(lambda n: str(ipaddress.IPv4Address(n)))
ports = st.integers(0, 65535)


def valid_response(tid: bytes) -> bytes:
    return response(tid, [address_attr(0x0020, "203.0.113.9", 4242, xor=True),
                          address_attr(0x802C, "198.51.100.1", 3479)])

# ------------------------------------------------------------------------------- codec


@FAST
@given(st.binary(max_size=1600), tids)
def test_decoder_is_total_on_arbitrary_bytes(data, tid):
    try:
        result = decode_binding_response(data, tid)
    except RemoteProtocolError:
        return
    assert isinstance(result, BindingResult)


@FAST
@given(tids, st.lists(st.tuples(st.sampled_from([0x0001, 0x0005, 0x0009, 0x0020, 0x802C, 0x8022, 0x0004])
                                | st.integers(0, 0xFFFF), st.binary(max_size=24)), max_size=6),
       st.sampled_from([0x0101, 0x0111]))
def test_decoder_is_total_on_well_framed_attributes(tid, attrs, kind):
    """A valid header with random attributes reaches every attribute parser."""
    try:
        result = decode_binding_response(response(tid, attrs, kind), tid)
    except RemoteProtocolError:
        return
    assert (result.error_code is None) == (result.mapped is not None)


@FAST
@given(tids, ipv4s, ports, st.sampled_from([0x0020, 0x0001]), st.none() | st.tuples(ipv4s, ports),
       st.sampled_from([0x802C, 0x0005]))
def test_round_trip(tid, ip, port, mapped_type, other, other_type):
    attrs = [address_attr(mapped_type, ip, port, xor=mapped_type == 0x0020)]
    if other:
        attrs.append(address_attr(other_type, *other))
    assert decode_binding_response(response(tid, attrs), tid) == BindingResult((ip, port), other, None)


@FAST
@given(tids, tids, st.integers(0, 2**32 - 1), st.integers(-8, 8))
def test_wrong_transaction_cookie_or_length_rejected(tid, other_tid, cookie, delta):
    data = valid_response(tid)
    if other_tid != tid:
        with pytest.raises(RemoteProtocolError, match="transaction"):
            decode_binding_response(data, other_tid)
    if cookie != MAGIC_COOKIE:
        with pytest.raises(RemoteProtocolError, match="cookie"):
            decode_binding_response(response(tid, [address_attr(0x0001, "1.2.3.4", 5)], cookie=cookie), tid)
    if delta:
        bad = data[:2] + struct.pack("!H", len(data) - 20 + delta) + data[4:]
        with pytest.raises(RemoteProtocolError):
            decode_binding_response(bad, tid)


@FAST
@given(tids, st.data())
def test_truncations_rejected(tid, data):
    full = valid_response(tid)
    cut = data.draw(st.integers(0, len(full) - 1))
    with pytest.raises(RemoteProtocolError):
        decode_binding_response(full[:cut], tid)
    fixed_up = full[:2] + struct.pack("!H", max(cut - 20, 0)) + full[4:max(cut, 20)]
    if cut == 20 + 12:  # ends right after XOR-MAPPED-ADDRESS: a valid, shorter response
        assert decode_binding_response(fixed_up, tid) == BindingResult(("203.0.113.9", 4242), None, None)
    else:
        with pytest.raises(RemoteProtocolError):  # cut inside an attribute, length fixed up
            decode_binding_response(fixed_up, tid)


def test_specific_rejections_and_choices():
    tid = bytes(range(12))
    ok = decode_binding_response(valid_response(tid), tid)
    assert ok == BindingResult(("203.0.113.9", 4242), ("198.51.100.1", 3479), None)
    # XOR-MAPPED wins over MAPPED; OTHER-ADDRESS over CHANGED-ADDRESS; first duplicate counts
    both = response(tid, [address_attr(0x0001, "10.0.0.1", 1), address_attr(0x0020, "9.9.9.9", 9, xor=True),
                          address_attr(0x0005, "10.0.0.2", 2), address_attr(0x802C, "8.8.8.8", 8),
                          address_attr(0x802C, "7.7.7.7", 7)])
    assert decode_binding_response(both, tid) == BindingResult(("9.9.9.9", 9), ("8.8.8.8", 8), None)
    ipv6 = (0x0020, struct.pack("!BBH", 0, 2, 1) + bytes(16))
    assert decode_binding_response(response(tid, [ipv6, address_attr(0x0001, "1.2.3.4", 5)]),
                                   tid).mapped == ("1.2.3.4", 5)
    for attrs in ([ipv6], [], [(0x0001, b"\0\1\0\5\1\2\3")], [(0x0001, b"\0\3\0\5\1\2\3\4")]):
        with pytest.raises(RemoteProtocolError):
            decode_binding_response(response(tid, attrs), tid)
    assert decode_binding_response(response(tid, [error_attr(420)], kind=0x0111), tid) == BindingResult(None, None, 420)
    for attrs in ([], [error_attr(220)], [(0x0009, b"\0\0\4\x64")], [(0x0009, b"\0\0")]):
        with pytest.raises(RemoteProtocolError):
            decode_binding_response(response(tid, attrs, kind=0x0111), tid)
    for kind in (0x0001, 0x0112, 0xC101):
        with pytest.raises(RemoteProtocolError, match="type"):
            decode_binding_response(response(tid, [address_attr(0x0001, "1.2.3.4", 5)], kind=kind), tid)
    padded = response(tid, [(0x8022, b"x" * 1500)])
    with pytest.raises(RemoteProtocolError, match="bytes"):
        decode_binding_response(padded, tid)
    with pytest.raises(RemoteProtocolError, match="match"):  # body length not a multiple of 4
        decode_binding_response(response(tid, [address_attr(0x0001, "1.2.3.4", 5)]) + b"\0", tid)
    with pytest.raises(LocalProtocolError):
        decode_binding_response(valid_response(tid), b"short")


@given(tids, st.booleans(), st.booleans())
def test_encode_binding_request(tid, change_ip, change_port):
    data = encode_binding_request(tid, change_ip, change_port)
    kind, length, cookie = struct.unpack_from("!HHI", data)
    assert (kind, cookie, data[8:20], length) == (1, MAGIC_COOKIE, tid, len(data) - 20)
    if change_ip or change_port:
        assert data[20:] == struct.pack("!HHI", 3, 4, 4 * change_ip | 2 * change_port)
    else:
        assert data[20:] == b""


def test_encode_rejects_bad_transaction_id():
    with pytest.raises(LocalProtocolError):
        encode_binding_request(b"\0" * 16)


def test_parse_stun_server():
    assert parse_stun_server("stun.example.org") == ("stun.example.org", 3478)
    assert parse_stun_server(" 127.0.0.1:40000 ") == ("127.0.0.1", 40000)
    assert parse_stun_server("stun.l.google.com:19302") == ("stun.l.google.com", 19302)
    for bad in ("", ":3478", "host:", "host:0", "host:65536", "host:x", "host:+1", "host: 1", "[::1]:3478",
                "::1", "256.1.1.1", "1.2.3", "bad_host", "-a.b", "a..b", "host:٣"):
        with pytest.raises(ConfigError):
            parse_stun_server(bad)

# --------------------------------------------------------------------- socket helpers


class CountingSocket:
    """Wraps a trio socket and records every destination it sends to."""

    def __init__(self, sock, sent: list):
        self._sock, self._sent = sock, sent

    async def sendto(self, data, address):
        self._sent.append(address)
        return await self._sock.sendto(data, address)

    def __getattr__(self, name):
        return getattr(self._sock, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._sock.close()


@pytest.fixture
def sent(monkeypatch):
    """Every packet sent by sockets that stun.py creates, counted outside the code under test."""
    log: list = []
    monkeypatch.setattr(trio.socket, "socket", lambda *a, **k: CountingSocket(TRIO_SOCKET(*a, **k), log))
    return log


async def udp_socket(ip="127.0.0.1", port=0):
    sock = TRIO_SOCKET(*UDP)
    await sock.bind((ip, port))
    return sock


async def until(predicate) -> None:
    """Wait for an event by polling ``predicate``; the deadline only turns a hang into a failure."""
    with trio.fail_after(EVENT_GUARD_S):
        while not predicate():
            await trio.sleep(POLL_S)


def timed_out(caplog) -> bool:
    """Whether a classification ended at its ``timeout`` (classify_nat logs it) rather than by a verdict."""
    return any("timed out" in record.getMessage() for record in caplog.records if record.name == stun.__name__)


@pytest.fixture
def stun_warnings(caplog):
    caplog.set_level(logging.WARNING, logger=stun.__name__)
    return caplog

# ------------------------------------------------------------------------------ stund


def free_port_pair() -> int:
    """A port p with p and p+1 free on 127.0.0.1 and 127.0.0.2 (stund binds all four)."""
    for _ in range(100):
        port = random.randint(20000, 60000)
        probes = []
        try:
            for ip in ("127.0.0.1", "127.0.0.2"):
                for p in (port, port + 1):
                    probes.append(socket.socket(*UDP))
                    probes[-1].bind((ip, p))
            return port
        except OSError:
            continue
        finally:
            for probe in probes:
                probe.close()
    raise RuntimeError("no free UDP port pair")


def start_stund(*ip_args: str):
    if shutil.which("stund") is None:
        pytest.skip("stund not installed (Debian package stun-server)")
    port = free_port_pair()
    process = subprocess.Popen(["stund", *ip_args, "-p", str(port), "-o", str(port + 1)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    with socket.socket(*UDP) as probe:  # ready when it answers a plain binding request
        probe.bind(("127.0.0.1", 0))
        probe.settimeout(0.1)
        for _ in range(50):
            if process.poll() is not None:
                pytest.fail(f"stund exited with {process.returncode}")
            probe.sendto(encode_binding_request(b"r" * 12), ("127.0.0.1", port))
            try:
                probe.recvfrom(2048)
                return process, ("127.0.0.1", port)
            except TimeoutError:
                continue
    stop(process)
    pytest.fail("stund did not answer within 5 s")


def stop(process):
    if process.poll() is None:
        os.kill(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            os.kill(process.pid, signal.SIGKILL)
            process.wait()


@pytest.fixture
def stund_single():
    process, address = start_stund("-h", "127.0.0.1")
    yield address
    stop(process)


@pytest.fixture
def stund_full():
    process, address = start_stund("-h", "127.0.0.1", "-a", "127.0.0.2")
    yield address
    stop(process)


def test_binding_against_stund_returns_our_address(stund_single):
    async def main():
        sock = await udp_socket()
        with sock:
            result = await binding(sock, stund_single)
            port_only = await binding(sock, stund_single, change_port=True)  # stund can change port
            ip_change = await binding(sock, stund_single, change_ip=True, rto=0.05)  # but not IP
            return sock.getsockname(), result, port_only, ip_change

    local, result, port_only, ip_change = trio.run(main)
    assert result.mapped == local and result.error_code is None
    assert result.other == ("0.0.0.0", stund_single[1] + 1)  # stund's "no second IP"
    assert port_only.mapped == local
    assert ip_change is None


def test_classify_against_single_ip_stund_stops_after_test_one(stund_single, sent, stun_warnings):
    report = trio.run(lambda: classify_nat(stund_single, source_ip="127.0.0.1", timeout=EVENT_GUARD_S))
    assert report.nat_type is NatType.UNKNOWN
    assert report.public[0] == "127.0.0.1"
    assert report.packets_sent == len(sent) == 1  # test I, then stop: no usable second address
    assert sent == [stund_single]
    assert not timed_out(stun_warnings)  # a verdict of its own, not the timeout ending a wait


@pytest.mark.parametrize("source_ip", ["127.0.0.1", "0.0.0.0"])
def test_classify_against_two_ip_stund_is_open_internet(stund_full, sent, source_ip):
    report = trio.run(lambda: classify_nat(stund_full, source_ip=source_ip, timeout=5.0))
    assert report.nat_type is NatType.OPEN_INTERNET
    assert report.public[0] == "127.0.0.1"
    assert report.packets_sent == len(sent) == 2  # test I, test II, each answered at the first try

# ----------------------------------------------------------------------- fake servers


async def serve(sock, answer, log: list):
    """Receive forever; ``answer(data, source)`` returns packets to send back (or none)."""
    while True:
        data, source = await sock.recvfrom(2048)
        log.append(data)
        for packet in answer(data, source):
            await sock.sendto(packet, source)


def request_flags(data: bytes) -> int:
    return struct.unpack_from("!I", data, 24)[0] if len(data) >= 28 else 0


def test_silent_server(sent):
    async def main():
        server = await udp_socket()
        received: list = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(serve, server, lambda data, source: [], received)
            client = await udp_socket()
            with client:
                result = await binding(client, server.getsockname(), rto=0.05, max_tries=3)
            report = await classify_nat(server.getsockname(), source_ip="127.0.0.1", timeout=5.0)
            await until(lambda: len(received) >= 3 + 3)
            nursery.cancel_scope.cancel()
        server.close()
        return result, report, len(received)

    result, report, received = trio.run(main)
    assert result is None
    assert report.nat_type is NatType.UDP_BLOCKED and report.public is None  # a verdict: not timed out
    assert report.packets_sent == stun.CLASSIFY_TRIES == 3
    assert received == 3 + 3  # counted on the server: binding's 3, then classify's 3
    assert len(sent) == 3


class SilentSocket:
    """An in-memory UDP socket nobody answers: it notes the (trio clock) time of every send."""

    def __init__(self) -> None:
        self.sent_at: list[float] = []
        self.address, self.closed = ("0.0.0.0", 0), False

    async def bind(self, address) -> None:
        self.address = (address[0], 40000)

    def getsockname(self):
        return self.address

    async def sendto(self, data, address) -> int:
        self.sent_at.append(trio.current_time())
        return len(data)

    async def recvfrom(self, size):
        await trio.sleep_forever()

    def close(self) -> None:
        self.closed = True


def run_on_virtual_clock(main):
    """``trio.run`` on a clock that jumps to the next deadline whenever every task waits: the
    times a test reads are the schedule the code asked for, exactly, however loaded the machine."""
    return trio.run(main, clock=MockClock(autojump_threshold=0))


def test_binding_retransmits_at_rto_then_doubling_and_gives_up_after_max_tries():
    sock = SilentSocket()

    async def main():
        result = await binding(sock, ("127.0.0.1", 3478), rto=0.05, max_tries=3)
        return result, trio.current_time()

    result, ended_at = run_on_virtual_clock(main)
    assert result is None
    assert sock.sent_at == pytest.approx([0, 0.05, 0.05 + 0.1])  # waits 0.05, 0.1, 0.2
    assert ended_at == pytest.approx(0.05 + 0.1 + 0.2)


@pytest.mark.parametrize("timeout, verdict, sent_at, elapsed", [
    (5.0, NatType.UDP_BLOCKED, [0, 0.25, 0.75], 1.75),  # test I's three tries, then its verdict
    (0.3, NatType.UNKNOWN, [0, 0.25], 0.3),  # the timeout cuts test I short
])
def test_classify_against_silence_keeps_to_its_schedule_and_its_timeout(monkeypatch, stun_warnings, timeout,
                                                                        verdict, sent_at, elapsed):
    sock = SilentSocket()
    monkeypatch.setattr(trio.socket, "socket", lambda *a, **k: sock)
    report = run_on_virtual_clock(lambda: classify_nat(("127.0.0.1", 3478), source_ip="127.0.0.1", timeout=timeout))
    assert report.nat_type is verdict and report.public is None
    assert report.packets_sent == len(sent_at) and sock.sent_at == pytest.approx(sent_at)
    assert report.elapsed == pytest.approx(elapsed)
    assert timed_out(stun_warnings) == (verdict is NatType.UNKNOWN)
    assert sock.closed


@pytest.mark.parametrize("refuse, packets", [(True, 2), (False, 7)])
def test_server_refusing_or_ignoring_change_request(monkeypatch, sent, stun_warnings, refuse, packets):
    """Single-IP servers: one refuses CHANGE-REQUEST with 420 (where pystun3 floods), one ignores
    it and answers from its own address, which must not count as a changed-address answer."""
    monkeypatch.setattr(stun, "CLASSIFY_RTO", 0.02)

    async def main():
        server = await udp_socket()
        received: list = []

        def answer(data, source):
            tid = data[8:20]
            if request_flags(data) and refuse:
                return [response(tid, [error_attr(420)], kind=0x0111)]
            return [response(tid, [address_attr(0x0020, PUBLIC_IP, 1, xor=True), address_attr(0x802C, "127.0.0.2", 9)])]

        async with trio.open_nursery() as nursery:
            nursery.start_soon(serve, server, answer, received)
            report = await classify_nat(server.getsockname(), source_ip="127.0.0.1", timeout=EVENT_GUARD_S)
            await until(lambda: len(received) >= (2 if refuse else 4))
            nursery.cancel_scope.cancel()
        server.close()
        return report, len(received)

    report, received = trio.run(main)
    assert report.nat_type is NatType.UNKNOWN and report.public == (PUBLIC_IP, 1)
    assert report.packets_sent == len(sent) == packets  # ignoring: I, II ×3, I to 127.0.0.2:9 ×3
    assert received == (2 if refuse else 4)  # nothing listens on 127.0.0.2:9
    assert not timed_out(stun_warnings)  # UNKNOWN is its verdict, not the timeout's


def test_stray_packets_are_bounded_and_stale_ones_skipped():
    async def main(strays: int, then_answer: bool):
        server = await udp_socket()
        received: list = []
        client_sent: list = []

        def answer(data, source):
            junk = [response(os.urandom(12), [address_attr(0x0001, "6.6.6.6", 6)]) for _ in range(strays)]
            return junk + ([response(data[8:20], [address_attr(0x0001, *source)])] if then_answer else [])

        async with trio.open_nursery() as nursery:
            nursery.start_soon(serve, server, answer, received)
            with CountingSocket(await udp_socket(), client_sent) as client:
                result = await binding(client, server.getsockname(), rto=0.5, max_tries=3)
                local = client.getsockname()
            nursery.cancel_scope.cancel()
        server.close()
        return result, local, len(received), len(client_sent)

    result, local, received, sent = trio.run(main, 5, True)
    assert result.mapped == local and received == sent == 1
    result, _, received, sent = trio.run(main, 200, False)
    assert result is None and received == 1
    assert sent == 1  # the flood ended the wait: no retransmission (max_tries=3 would send 3)


def test_malformed_answer_raises_in_binding_and_is_unknown_in_classify():
    async def main():
        server = await udp_socket()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(serve, server, lambda data, source: [data[:20] + b"\0\1"], [])
            with await udp_socket() as client, pytest.raises(RemoteProtocolError):
                await binding(client, server.getsockname())
            report = await classify_nat(server.getsockname(), source_ip="127.0.0.1")
            nursery.cancel_scope.cancel()
        server.close()
        return report

    report = trio.run(main)
    assert report.nat_type is NatType.UNKNOWN and report.packets_sent == 1


# A simulated NAT: four sockets (127.0.0.1/127.0.0.2 × two ports) play a two-IP STUN server that
# reports a made-up public mapping and drops the answers the simulated NAT would filter.
PUBLIC_IP = "198.51.100.7"


async def simulated_nat(nursery, mapping: str, filtering: str):
    for _ in range(50):  # the 127.0.0.2 sockets need the ports the kernel gave the 127.0.0.1 ones
        a, b = await udp_socket("127.0.0.1"), await udp_socket("127.0.0.1")
        p1, p2 = a.getsockname()[1], b.getsockname()[1]
        try:
            sockets = {("127.0.0.1", p1): a, ("127.0.0.1", p2): b,
                       ("127.0.0.2", p1): await udp_socket("127.0.0.2", p1),
                       ("127.0.0.2", p2): await udp_socket("127.0.0.2", p2)}
            break
        except OSError:
            a.close()
            b.close()
    ips, ports_ = ("127.0.0.1", "127.0.0.2"), (p1, p2)

    def flip(value, pair, change):
        return pair[1 - pair.index(value)] if change else value

    contacted: set = set()
    received: list = []

    async def run(here, sock):
        while True:
            data, source = await sock.recvfrom(2048)
            received.append(here)
            contacted.add(here)
            flags = request_flags(data)
            there = (flip(here[0], ips, flags & 4), flip(here[1], ports_, flags & 2))
            if filtering == "address" and there[0] not in {ip for ip, _ in contacted}:
                continue
            if filtering == "port" and there not in contacted:
                continue
            mapped = source if mapping == "none" else (
                PUBLIC_IP, 40000 + (list(sockets).index(here) if mapping == "symmetric" else 0))
            other = (flip(here[0], ips, True), flip(here[1], ports_, True))
            packet = response(data[8:20], [address_attr(0x0020, *mapped, xor=True), address_attr(0x802C, *other)])
            await sockets[there].sendto(packet, source)

    for here, sock in sockets.items():
        nursery.start_soon(run, here, sock)
    return ("127.0.0.1", p1), received, list(sockets.values())


@pytest.mark.parametrize("mapping, filtering, expected, packets", [
    ("none", "none", NatType.OPEN_INTERNET, 2),
    ("none", "port", NatType.PORT_RESTRICTED, 7),  # RFC 3489's symmetric UDP firewall
    ("eim", "none", NatType.FULL_CONE, 2),
    ("eim", "address", NatType.RESTRICTED_CONE, 6),
    ("eim", "port", NatType.PORT_RESTRICTED, 8),
    ("symmetric", "port", NatType.SYMMETRIC, 5),
])
def test_classify_simulated_nats(monkeypatch, mapping, filtering, expected, packets):
    monkeypatch.setattr(stun, "CLASSIFY_RTO", 0.02)  # silent tests last 0.14 s instead of 1.75 s

    async def main():
        async with trio.open_nursery() as nursery:
            server, received, sockets = await simulated_nat(nursery, mapping, filtering)
            report = await classify_nat(server, source_ip="127.0.0.1", timeout=5.0)
            await until(lambda: len(received) >= report.packets_sent)
            nursery.cancel_scope.cancel()
        for sock in sockets:
            sock.close()
        return report, len(received)

    report, received = trio.run(main)
    assert report.nat_type is expected
    assert report.packets_sent == received == packets <= MAX_CLASSIFY_PACKETS
    assert report.public == ((PUBLIC_IP, 40000) if mapping != "none" else report.public)


@pytest.mark.integration
def test_node_reports_stun_result_in_its_status(stund_full, tmp_path):
    """`p2pswarm bootstrap --stun` classifies once at start-up and shows it in /api/stats."""
    from tests.procs import Swarm, free_port, get_json, wait_until

    host, port = stund_full
    api = f"127.0.0.1:{free_port()}"
    swarm = Swarm(tmp_path)
    try:
        process = swarm.start("bootstrap", "--listen", "/ip4/127.0.0.1/tcp/0", "--api", api,
                              "--stun", f"{host}:{port}", name="boot")
        assert process.stdout.readline().startswith("/ip4/127.0.0.1/tcp/")
        stats = wait_until(lambda: (get_json(api, "/api/stats") or {}).get("stun"), timeout=20)
        assert stats and stats["nat_type"] == "open-internet" and stats["public"].startswith("127.0.0.1:")
    finally:
        swarm.close()

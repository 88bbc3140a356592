"""A small STUN client: our public UDP address, and the RFC 3489 classic NAT classification.

Why our own: pystun3 re-sends forever (~20,000 requests/s) against a single-IP server that
answers CHANGE-REQUEST with an error, and keeps going after the caller gives up. Here every
bound is structural: ``binding`` sends at most ``max_tries`` packets, ``classify_nat`` at most
MAX_CLASSIFY_PACKETS and never runs past its ``timeout``.

Layers:
- pure codec: ``encode_binding_request`` / ``decode_binding_response`` (RFC 5389 framing with
  the magic cookie, plus RFC 3489/5780 CHANGE-REQUEST and CHANGED-/OTHER-ADDRESS). The decoder
  is total: any bytes give a ``BindingResult`` or ``RemoteProtocolError``. A well-formed error
  response is a *result* (``error_code`` set, ``mapped`` None): it is a valid answer, and the
  classifier needs to see it to stop. A success response always has an IPv4 ``mapped``.
- transport over a trio UDP socket: ``binding``;
- ``classify_nat``, which owns (and always closes) its socket.
IPv4 only; IPv6 address attributes are skipped. Unknown attributes are skipped, so old RFC 3489
servers (stund sends SOURCE-ADDRESS 0x0004 and a legacy XOR-MAPPED 0x8020) decode.
"""

from __future__ import annotations

import enum
import ipaddress
import logging
import re
import secrets
import struct
from dataclasses import dataclass
from typing import TypeGuard

import trio

from p2pswarm.errors import (
    ConfigError,
    DialError,
    LocalProtocolError,
    RemoteProtocolError,
)

log = logging.getLogger(__name__)

MAGIC_COOKIE = 0x2112A442  # RFC 5389 §6: tells STUN apart from other UDP, and keys XOR-MAPPED
HEADER = struct.Struct("!HHI12s")  # type, body length, cookie, transaction id: 20 bytes
TRANSACTION_ID_SIZE = 12  # RFC 5389: 96 random bits, also what authenticates an answer
MAX_STUN_PACKET = 1500  # an Ethernet MTU; RFC 5389 §7.1 keeps messages under the path MTU
DEFAULT_STUN_PORT = 3478  # RFC 5389 §18.4

BINDING_REQUEST = 0x0001
BINDING_SUCCESS = 0x0101
BINDING_ERROR = 0x0111

ATTR_MAPPED_ADDRESS = 0x0001
ATTR_CHANGE_REQUEST = 0x0003  # RFC 3489 §11.2.4 / RFC 5780 §7.2
ATTR_CHANGED_ADDRESS = 0x0005  # RFC 3489 name of OTHER-ADDRESS
ATTR_ERROR_CODE = 0x0009
ATTR_XOR_MAPPED_ADDRESS = 0x0020
ATTR_OTHER_ADDRESS = 0x802C  # RFC 5780 §7.4

CHANGE_IP_FLAG = 0x04
CHANGE_PORT_FLAG = 0x02
FAMILY_IPV4 = 0x01
FAMILY_IPV6 = 0x02

MAX_IGNORED_PACKETS = 32  # strays/stale answers one binding() tolerates; a flood ends the wait
CLASSIFY_RTO = 0.25  # first wait per test; doubles: 0.25 + 0.5 + 1.0 = 1.75 s for a silent test,
CLASSIFY_TRIES = 3  # so the two silent tests of a port-restricted NAT fit in the default 5 s
CLASSIFY_TESTS = 4  # test I, test II, test I to the other address, test III: no loops
MAX_CLASSIFY_PACKETS = CLASSIFY_TESTS * CLASSIFY_TRIES  # 12: the hard bound of classify_nat

Address = tuple[str, int]


@dataclass(frozen=True)
class BindingResult:
    mapped: Address | None  # our address as the server saw it; None only in an error response
    other: Address | None  # OTHER-ADDRESS (or CHANGED-ADDRESS), as sent, possibly 0.0.0.0
    error_code: int | None  # ERROR-CODE of an error response, e.g. 420; None on success


class NatType(enum.Enum):
    OPEN_INTERNET = "open-internet"
    FULL_CONE = "full-cone"
    RESTRICTED_CONE = "restricted-cone"
    PORT_RESTRICTED = "port-restricted"
    SYMMETRIC = "symmetric"
    UDP_BLOCKED = "udp-blocked"
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class StunReport:
    public: Address | None
    nat_type: NatType
    packets_sent: int
    elapsed: float


# ---------------------------------------------------------------------------------- codec


def _check_transaction_id(transaction_id: bytes) -> None:
    if not isinstance(transaction_id, bytes) or len(transaction_id) != TRANSACTION_ID_SIZE:
        raise LocalProtocolError(f"a STUN transaction id is {TRANSACTION_ID_SIZE} bytes")


def encode_binding_request(transaction_id: bytes, change_ip: bool = False, change_port: bool = False) -> bytes:
    _check_transaction_id(transaction_id)
    body = b""
    if change_ip or change_port:
        flags = (CHANGE_IP_FLAG if change_ip else 0) | (CHANGE_PORT_FLAG if change_port else 0)
        body = struct.pack("!HHI", ATTR_CHANGE_REQUEST, 4, flags)
    return HEADER.pack(BINDING_REQUEST, len(body), MAGIC_COOKIE, transaction_id) + body


def _address(value: bytes, xor: bool) -> Address | None:
    """An address attribute value; None for IPv6 (skipped: the client is IPv4 only)."""
    if len(value) < 4:
        raise RemoteProtocolError("STUN address attribute too short")
    family, port = value[1], struct.unpack_from("!H", value, 2)[0]
    if family == FAMILY_IPV6 and len(value) == 20:
        return None
    if family != FAMILY_IPV4 or len(value) != 8:
        raise RemoteProtocolError(f"bad STUN address attribute (family {family}, {len(value)} bytes)")
    ip = struct.unpack_from("!I", value, 4)[0]
    if xor:
        port ^= MAGIC_COOKIE >> 16
        ip ^= MAGIC_COOKIE
    return str(ipaddress.IPv4Address(ip)), port


def _error_code(value: bytes) -> int:
    if len(value) < 4:
        raise RemoteProtocolError("STUN ERROR-CODE too short")
    klass, number = value[2] & 0x07, value[3]
    if not 3 <= klass <= 6 or number > 99:  # RFC 5389 §15.6: codes 300..699
        raise RemoteProtocolError(f"bad STUN error code class {klass} number {number}")
    return klass * 100 + number


def decode_binding_response(data: bytes, transaction_id: bytes) -> BindingResult:
    _check_transaction_id(transaction_id)
    data = bytes(data)
    if not HEADER.size <= len(data) <= MAX_STUN_PACKET:
        raise RemoteProtocolError(f"STUN message of {len(data)} bytes")
    kind, length, cookie, tid = HEADER.unpack_from(data)
    if kind not in (BINDING_SUCCESS, BINDING_ERROR):
        raise RemoteProtocolError(f"not a binding response: type {kind:#06x}")
    if length != len(data) - HEADER.size or length % 4:
        raise RemoteProtocolError(f"STUN length {length} does not match {len(data) - HEADER.size} body bytes")
    if cookie != MAGIC_COOKIE:
        raise RemoteProtocolError("STUN magic cookie missing")
    if tid != transaction_id:
        raise RemoteProtocolError("STUN transaction id does not match")
    attrs: dict[int, bytes] = {}
    pos = HEADER.size
    while pos < len(data):
        if pos + 4 > len(data):
            raise RemoteProtocolError("truncated STUN attribute header")
        attr_type, attr_len = struct.unpack_from("!HH", data, pos)
        end = pos + 4 + attr_len
        padded_end = pos + 4 + (attr_len + 3) // 4 * 4
        if padded_end > len(data):
            raise RemoteProtocolError(f"STUN attribute {attr_type:#06x} overruns the message")
        attrs.setdefault(attr_type, data[pos + 4 : end])  # RFC 5389 §15: only the first counts
        pos = padded_end
    if kind == BINDING_ERROR:
        if ATTR_ERROR_CODE not in attrs:
            raise RemoteProtocolError("STUN error response without ERROR-CODE")
        return BindingResult(mapped=None, other=None, error_code=_error_code(attrs[ATTR_ERROR_CODE]))
    mapped = None
    for attr_type, xor in ((ATTR_XOR_MAPPED_ADDRESS, True), (ATTR_MAPPED_ADDRESS, False)):
        if attr_type in attrs:  # XOR first: NAT ALGs rewrite addresses they see in payloads
            mapped = mapped or _address(attrs[attr_type], xor)
    if mapped is None:
        raise RemoteProtocolError("STUN success response without an IPv4 mapped address")
    other = None
    for attr_type in (ATTR_OTHER_ADDRESS, ATTR_CHANGED_ADDRESS):
        if attr_type in attrs:
            other = other or _address(attrs[attr_type], False)
    return BindingResult(mapped=mapped, other=other, error_code=None)


# ------------------------------------------------------------------------------ transport


async def _resolve(server: Address) -> Address:
    host, port = server
    try:
        infos = await trio.socket.getaddrinfo(host, port, trio.socket.AF_INET, trio.socket.SOCK_DGRAM)
    except OSError as exc:
        raise DialError(f"cannot resolve STUN server {host}:{port}: {exc}") from exc
    return infos[0][4][:2]


def _from_expected(source: Address, server: Address, change_ip: bool, change_port: bool) -> bool:
    """Whether a success comes from where the request asked: a server that ignored
    CHANGE-REQUEST answers from its own address, and that must not count as an answer."""
    return (source[0] != server[0]) == change_ip and (source[1] != server[1]) == change_port


async def binding(sock, server: Address, *, change_ip: bool = False, change_port: bool = False,
                  rto: float = 0.5, max_tries: int = 3) -> BindingResult | None:
    """One binding transaction: at most ``max_tries`` packets, waits rto, 2·rto, 4·rto, ….

    Returns the decoded answer, or None when nothing acceptable came back. Packets from other
    sources or other transactions are ignored (at most MAX_IGNORED_PACKETS). Raises
    RemoteProtocolError when the answer to this transaction is malformed, DialError when the
    socket cannot send or receive.
    """
    if max_tries < 1 or not rto > 0:
        raise LocalProtocolError(f"binding needs max_tries >= 1 and rto > 0, got {max_tries}, {rto}")
    server = await _resolve(server)
    transaction_id = secrets.token_bytes(TRANSACTION_ID_SIZE)
    request = encode_binding_request(transaction_id, change_ip, change_port)
    ignored, wait = 0, rto
    for _ in range(max_tries):
        try:
            await sock.sendto(request, server)
        except OSError as exc:
            raise DialError(f"cannot send to STUN server {server[0]}:{server[1]}: {exc}") from exc
        with trio.move_on_after(wait):
            while True:
                try:
                    data, source = await sock.recvfrom(MAX_STUN_PACKET + 1)  # +1: see oversize
                except OSError as exc:
                    raise DialError(f"STUN receive failed: {exc}") from exc
                if data[8:20] == transaction_id:
                    if _from_expected(source[:2], server, change_ip, change_port):
                        return decode_binding_response(data, transaction_id)
                    if source[:2] == server:  # a change request answered from the same address:
                        result = decode_binding_response(data, transaction_id)
                        if result.error_code is not None:  # a refusal is an answer,
                            return result  # a success means CHANGE-REQUEST was ignored: not one
                ignored += 1
                if ignored > MAX_IGNORED_PACKETS:
                    log.warning("STUN: %d stray packets while waiting for %s:%d; no NAT type (reachability still comes "
                                "from AutoNAT)", ignored, *server)
                    return None
        wait *= 2
    return None


class _CountingSocket:
    """Counts what ``classify_nat`` sends and refuses the packet past MAX_CLASSIFY_PACKETS."""

    def __init__(self, sock) -> None:
        self.sock, self.sent = sock, 0

    async def sendto(self, data: bytes, address: Address) -> int:
        if self.sent >= MAX_CLASSIFY_PACKETS:
            raise LocalProtocolError(f"classify_nat tried to send more than {MAX_CLASSIFY_PACKETS} packets")
        self.sent += 1
        return await self.sock.sendto(data, address)

    async def recvfrom(self, size: int):
        return await self.sock.recvfrom(size)


def _usable_other(other: Address | None, server: Address) -> TypeGuard[Address]:
    """RFC 5780 §7.4: the other address differs in IP *and* port; stund alone sends 0.0.0.0."""
    return (other is not None and other[0] != "0.0.0.0" and other[1] != 0
            and other[0] != server[0] and other[1] != server[1])


async def _local_address(sock, server: Address) -> Address:
    """The address the kernel sends from towards ``server`` (a wildcard bind hides it)."""
    ip, port = sock.getsockname()[:2]
    if ip == "0.0.0.0":
        with trio.socket.socket(trio.socket.AF_INET, trio.socket.SOCK_DGRAM) as probe:
            try:
                await probe.connect(server)  # UDP connect only picks a route: no packet is sent
                ip = probe.getsockname()[0]
            except OSError as exc:
                raise DialError(f"no route to STUN server {server[0]}:{server[1]}: {exc}") from exc
    return ip, port


@dataclass
class _Progress:
    public: Address | None = None  # survives a timeout: what test I found is still reported


async def _classify(sock: _CountingSocket, server: Address, progress: _Progress) -> NatType:
    async def test(dest: Address, change_ip: bool = False, change_port: bool = False) -> BindingResult | None:
        return await binding(sock, dest, change_ip=change_ip, change_port=change_port,
                             rto=CLASSIFY_RTO, max_tries=CLASSIFY_TRIES)

    local = await _local_address(sock.sock, server)
    first = await test(server)  # test I
    if first is None:
        return NatType.UDP_BLOCKED
    if first.error_code is not None:
        return NatType.UNKNOWN
    progress.public = first.mapped
    if not _usable_other(first.other, server):
        log.info("STUN server %s:%d has no second address (other=%s): NAT type unknown", *server, first.other)
        return NatType.UNKNOWN
    changed = await test(server, change_ip=True, change_port=True)  # test II
    if changed is not None and changed.error_code is not None:
        return NatType.UNKNOWN  # a server that refuses CHANGE-REQUEST: stop, never retry
    if first.mapped == local:
        if changed is not None:
            return NatType.OPEN_INTERNET
        # RFC 3489's "symmetric UDP firewall": no translation, filtering measured by test III
    elif changed is not None:
        return NatType.FULL_CONE
    else:
        again = await test(first.other)  # test I to the other address
        if again is None or again.error_code is not None:
            return NatType.UNKNOWN
        if again.mapped != first.mapped:
            return NatType.SYMMETRIC
    port_changed = await test(server, change_port=True)  # test III
    if port_changed is None:
        return NatType.PORT_RESTRICTED
    return NatType.UNKNOWN if port_changed.error_code is not None else NatType.RESTRICTED_CONE


async def classify_nat(server: Address, *, source_ip: str = "0.0.0.0", timeout: float = 5.0) -> StunReport:
    """RFC 3489 classification against ``server``: ≤ MAX_CLASSIFY_PACKETS packets, ≤ ``timeout`` s.

    Network trouble (silence, errors, a malformed answer, an unresolvable name, a single-IP
    server) gives a report, never an exception; only an unusable ``source_ip`` raises ConfigError.
    RFC 3489's "symmetric UDP firewall" (no translation, test II unanswered) has no member of its
    own: it is reported by its filtering, from test III (RESTRICTED_CONE or PORT_RESTRICTED).
    """
    start = trio.current_time()
    raw = trio.socket.socket(trio.socket.AF_INET, trio.socket.SOCK_DGRAM)
    sock, progress, nat_type = _CountingSocket(raw), _Progress(), NatType.UNKNOWN
    try:
        try:
            await raw.bind((source_ip, 0))
        except OSError as exc:
            raise ConfigError(f"cannot bind a UDP socket to {source_ip}: {exc}") from exc
        with trio.move_on_after(timeout) as scope:
            try:
                nat_type = await _classify(sock, await _resolve(server), progress)
            except (RemoteProtocolError, DialError) as exc:
                log.warning("STUN classification against %s:%d failed: %s (check --stun; reachability still comes "
                            "from AutoNAT)", *server, exc)
        if scope.cancelled_caught:
            log.warning("STUN classification against %s:%d timed out after %.1f s (check --stun and that UDP "
                        "leaves this network; reachability still comes from AutoNAT)", *server, timeout)
    finally:
        raw.close()
    elapsed = trio.current_time() - start
    return StunReport(public=progress.public, nat_type=nat_type, packets_sent=sock.sent, elapsed=elapsed)


# ----------------------------------------------------------------------------------- config

_HOSTNAME = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)(\.(?!-)[A-Za-z0-9-]{1,63}(?<!-))*\.?")


def parse_stun_server(text: str) -> Address:
    """``HOST[:PORT]`` from ``--stun`` (IPv4 literal or host name; port 3478 when omitted)."""
    text = text.strip()
    host, sep, port_text = text.rpartition(":") if ":" in text else (text, "", "")
    if ":" in host or text.startswith("["):
        raise ConfigError(f"--stun {text!r}: IPv6 is not supported, give an IPv4 address or host name")
    port = DEFAULT_STUN_PORT
    if sep:
        if not (port_text.isascii() and port_text.isdigit() and 1 <= int(port_text) <= 65535):
            raise ConfigError(f"--stun {text!r}: port must be 1..65535")
        port = int(port_text)
    looks_numeric = bool(re.fullmatch(r"[0-9.]+", host))
    if looks_numeric:
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            raise ConfigError(f"--stun {text!r}: not an IPv4 address") from None
    elif len(host) > 253 or not _HOSTNAME.fullmatch(host):
        raise ConfigError(f"--stun {text!r}: expected HOST or HOST:PORT")
    return host, port

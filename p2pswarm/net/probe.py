"""Can we reach that peer, how, and how fast: connect, one control round trip, a timed push.

``p2pswarm ping PEER`` asks a running node (through its API) to probe a peer: ``connect()``
(direct, hole punch or relay), a Ping/Pong over the control stream (time to first byte is
connect plus this round trip), then ``bytes`` pushed over a fresh probe stream and acknowledged.
The answer says which method connected and whether the path is direct or relayed now. The NAT
lab tests and ``bench/nat_matrix.py`` measure connection success, time to first byte and relayed
against direct throughput with it.

Probe stream (``/p2pswarm/probe/1.0.0``): the client sends ``ProbeData`` frames of at most
``PROBE_CHUNK`` payload bytes, the last one flagged, and the server answers one ``ProbeAck``
with the byte count. A server accepts at most ``MAX_PROBE_BYTES`` per stream.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass

import trio

from p2pswarm import wire
from p2pswarm.errors import DialError, P2PSwarmError, RemoteProtocolError, first_error
from p2pswarm.net.connect import Connector, as_peer_id, connections_to, has_direct
from p2pswarm.net.control import ControlService
from p2pswarm.net.streams import ByteStream, open_stream

log = logging.getLogger(__name__)

PROBE_PROTOCOL = "/p2pswarm/probe/1.0.0"
PROBE_CHUNK = 256 * 1024  # bytes per frame: large enough to measure, small enough to interleave
MAX_PROBE_BYTES = 64 * 1024 * 1024  # per probe stream: a measurement, not a way to flood a peer
PROBE_TIMEOUT = 60.0  # a whole probe; a relay's byte limit ends a longer one anyway


@wire.message("probe-data")
class ProbeData(wire.Message):
    """A chunk of probe bytes (the payload); ``last`` asks for the acknowledgement."""

    last: bool

    def check(self, payload_len: int) -> None:
        if payload_len > PROBE_CHUNK:
            raise RemoteProtocolError(f"probe chunk of {payload_len} bytes exceeds {PROBE_CHUNK}")


@wire.message("probe-ack")
class ProbeAck(wire.Message):
    """How many probe bytes arrived."""

    received: int

    def check(self, payload_len: int) -> None:
        if payload_len or self.received < 0:
            raise RemoteProtocolError("probe-ack carries no payload and a non-negative count")


@dataclass(frozen=True)
class ProbeResult:
    peer: str
    method: str  # how connect() got there: connected (already), direct or relay
    connect_ms: float
    rtt_ms: float
    bytes: int
    transfer_ms: float
    push_path: str  # the connection the bytes went over: direct or relayed
    path: str  # what the connection is when the probe ends: direct, relayed or gone
    upgrade_ms: float | None = None  # connected -> a direct connection exists (when waited for)

    def doc(self) -> dict:
        rate = self.bytes / (self.transfer_ms / 1000) / 2**20 if self.bytes and self.transfer_ms else None
        return {"peer": self.peer, "method": self.method, "connect_ms": round(self.connect_ms, 1),
                "rtt_ms": round(self.rtt_ms, 2), "first_byte_ms": round(self.connect_ms + self.rtt_ms, 1),
                "bytes": self.bytes, "transfer_ms": round(self.transfer_ms, 1),
                "mib_per_s": None if rate is None else round(rate, 2), "push_path": self.push_path,
                "path": self.path, "upgrade_ms": None if self.upgrade_ms is None else round(self.upgrade_ms, 1)}


async def answer_ping(peer: str, message: wire.Ping) -> wire.Pong:
    return wire.Pong(nonce=message.nonce)


async def serve_probe_stream(raw_stream) -> None:
    """Count a peer's probe bytes and acknowledge them; a peer that overruns the limit is dropped."""
    stream = ByteStream(raw_stream)
    received = 0
    try:
        with trio.fail_after(PROBE_TIMEOUT):
            while True:
                frame = await wire.read_frame(stream, max_payload=PROBE_CHUNK)
                if frame is None:
                    return
                message, payload = frame
                if not isinstance(message, ProbeData):
                    raise RemoteProtocolError(f"expected probe-data, got {message.TYPE}")
                received += len(payload)
                if received > MAX_PROBE_BYTES:
                    raise RemoteProtocolError(f"probe exceeds {MAX_PROBE_BYTES} bytes")
                if message.last:
                    await wire.write_frame(stream, ProbeAck(received=received))
                    await stream.close()  # a reset here could drop the acknowledgement in flight
                    return
    except (RemoteProtocolError, trio.TooSlowError) as exc:
        log.debug("probe from %s dropped: %s", stream.remote_peer, exc)
    except DialError:
        pass  # the peer went away
    await stream.reset()


def register(host, control: ControlService) -> None:
    control.handle(wire.Ping, answer_ping)
    host.set_stream_handler(PROBE_PROTOCOL, serve_probe_stream)


async def probe(host, connector: Connector, control: ControlService, peer: str,
                addrs: tuple[str, ...] = (), nbytes: int = 0, *, fresh: bool = False, upgrade_wait: float = 0.0,
                rng: random.Random | None = None) -> ProbeResult:
    """Reach ``peer``, time a round trip and push ``nbytes`` (at most MAX_PROBE_BYTES, which the
    other side enforces); a plain DialError (never an exception group) when it cannot be reached
    or does not answer as a p2pswarm peer.

    ``fresh`` closes existing connections to the peer first, so the connection is made anew;
    ``upgrade_wait`` waits up to that many seconds for a relayed connection to become direct.
    """
    try:
        return await _probe(host, connector, control, peer, addrs, nbytes, fresh, upgrade_wait, rng)
    except BaseExceptionGroup as group:  # the upgrade watcher's nursery wraps what the probe raised
        error = first_error(group)
        if isinstance(error, P2PSwarmError):
            raise error from None
        raise
    except trio.TooSlowError:
        raise DialError(f"{peer}: the probe did not finish within {PROBE_TIMEOUT + upgrade_wait:.0f} s") from None


async def _probe(host, connector: Connector, control: ControlService, peer: str, addrs: tuple[str, ...],
                 nbytes: int, fresh: bool, upgrade_wait: float, rng: random.Random | None) -> ProbeResult:
    pid = as_peer_id(peer)
    direct_at: list[float] = []

    async def watch_for_direct() -> None:
        while not has_direct(host, pid):
            await trio.sleep(0.02)
        direct_at.append(time.monotonic())

    with trio.fail_after(PROBE_TIMEOUT + upgrade_wait):
        if fresh:
            await disconnect(host, pid)
        began = time.monotonic()
        method = await connector.connect(peer, addrs)
        connected = time.monotonic()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch_for_direct)
            nonce = (rng or random.Random()).getrandbits(32)
            reply = await control.request(peer, wire.Ping(nonce=nonce))
            if reply != wire.Pong(nonce=nonce):
                raise DialError(f"{peer} answered the ping with {reply}")
            answered = time.monotonic()
            push_path = _path(host, pid)
            if nbytes:
                await _push(host, peer, nbytes)
            done = time.monotonic()
            with trio.move_on_after(upgrade_wait):
                while not direct_at:
                    await trio.sleep(0.02)
            nursery.cancel_scope.cancel()
    upgrade_ms = 1000 * (direct_at[0] - connected) if direct_at else None
    return ProbeResult(peer, method, 1000 * (connected - began), 1000 * (answered - connected),
                       nbytes, 1000 * (done - answered), push_path, _path(host, pid), upgrade_ms)


def _path(host, pid) -> str:
    return "direct" if has_direct(host, pid) else ("relayed" if connections_to(host, pid) else "gone")


async def disconnect(host, pid, timeout: float = 5.0) -> None:
    """Close every connection to ``pid`` and wait until the swarm has let go of them."""
    with trio.move_on_after(timeout):
        await host.disconnect(pid)
        while connections_to(host, pid):
            await trio.sleep(0.02)


async def _push(host, peer: str, nbytes: int) -> None:
    stream = await open_stream(host, as_peer_id(peer), PROBE_PROTOCOL)
    try:
        chunk = bytes(PROBE_CHUNK)
        sent = 0
        while sent < nbytes:
            size = min(PROBE_CHUNK, nbytes - sent)
            sent += size
            await wire.write_frame(stream, ProbeData(last=sent == nbytes), chunk[:size])
        try:
            frame = await wire.read_frame(stream, max_payload=0)
        except RemoteProtocolError as exc:
            raise DialError(f"{peer} answered the probe with an invalid frame: {exc}") from None
        if frame is None or frame[0] != ProbeAck(received=nbytes):
            raise DialError(f"{peer} acknowledged {frame[0] if frame else 'nothing'} for {nbytes} bytes")
    finally:
        await stream.reset()

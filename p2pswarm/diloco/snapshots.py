"""Hot snapshots between replicas, ``/p2pswarm/snapshot/1.0.0``: a joiner loads its stage from a neighbour.

A peer that joins a running swarm, restarts, or was left out of an outer round must not start
from the initial weights: it asks a replica of its stage for that replica's current state (the
engine's weights and optimizer, the DiLoCo start weights, momentum and round; ``checkpoint.py``
encodes it, no pickle) and loads it. The serving side makes a fresh snapshot on demand, at most
once per ``FRESH_S``, and keeps the last ``KEEP_VERSIONS`` so a transfer in progress survives a
newer one, and an older one a transfer asked for within ``IN_USE_S`` (a fetch over a thin line
outlasts many versions; so it is for the agreed backups).

Exchange (request and reply frames on a pooled stream):

- ``snapshot.get`` (no payload): ``model``, ``stage``, ``digest`` (empty: the newest; else the
  sha256 of the version being fetched), ``offset``;
- reply ``snapshot.part`` (payload: bytes ``[offset, offset + len)`` of the snapshot): ``round``,
  ``step``, ``digest``, ``total``, ``offset``; or ``wire.ErrorReply`` (no snapshot of that
  stage, or that version is gone).

A replica also serves, by digest, its stage's last ``KEEP_AGREED`` *agreed backups*
(``add_agreed``; ``heal.backups``: the state every replica holds alike right after an outer
round), and a request for another stage goes to ``others`` (the backups this peer holds for
other stages, ``heal.backup_service``), answered by digest only.

The client checks every reply against the first (same digest, contiguous offsets, ``total``
within ``MAX_SNAPSHOT_BYTES``, the largest catalog stage's snapshot, ~18 GiB: offsets and totals
are plain ints, far past 2^32), then the whole snapshot's sha256 against its digest, then decodes
it with ``checkpoint.decode_state`` (total: a bad snapshot is a ``RemoteProtocolError``).
A snapshot's sha256 (0.5 to 1 s a GB) is computed once per version, in a worker thread, on both
sides (the client's chunk by chunk as they arrive): never on the trio loop, which also answers
the activation protocol's acks. A fetch holds the snapshot once in memory (its own size).
``docs/protocols.md`` ("Snapshots") is the normative description.
"""

from __future__ import annotations

import functools
import hashlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import trio

from p2pswarm import wire
from p2pswarm.dht.records import MAX_MODEL_CHARS, MAX_STAGES, RUN_BYTES, UNNAMED_RUN_BYTES
from p2pswarm.diloco.fetch_pace import MAX_CHUNK_BYTES, ChunkPace
from p2pswarm.errors import DialError, RemoteProtocolError
from p2pswarm.run import plan

log = logging.getLogger(__name__)

PROTOCOL_ID = "/p2pswarm/snapshot/1.0.0"
DIGEST_BYTES = 32  # sha256
CHUNK_BYTES = MAX_CHUNK_BYTES  # the largest reply, 4 MiB: well under the 64 MiB frame limit
MAX_SNAPSHOT_BYTES = plan.MAX_SNAPSHOT_BYTES  # the largest snapshot a client accepts (checkpoint's limit)
FRESH_S = 5.0  # a snapshot made this recently is served as is: many joiners cost one serialisation
KEEP_VERSIONS = 2  # versions kept for transfers in progress while a newer one is made
IN_USE_S = 60.0  # an older version (hot or agreed) a transfer asked for this recently is kept too (one of each)
FETCH_TIMEOUT = 60.0  # a whole fetch of a small snapshot (a bigger one: fetch_pace.ChunkPace.allowed)
CHUNK_TIMEOUT = 20.0  # one reply: a chunk is sized to take about 1 s (fetch_pace.py)
MAX_PARTIALS = 2  # cut fetches kept to resume (PartialFetches): each holds at most one snapshot's bytes
KEEP_AGREED = 2  # agreed backups served by digest: the newest, and the one before while a holder fetches it


@wire.message("snapshot.get", version=2)
class Get(wire.Message):
    """Ask for ``length`` bytes (0: CHUNK_BYTES) of a snapshot of ``stage`` of ``model`` from ``offset``."""

    model: str
    stage: int
    digest: bytes  # b"": the newest version; else the version being fetched
    offset: int
    run: bytes = UNNAMED_RUN_BYTES  # the asker's run identity: a replica of another run serves it nothing
    length: int = 0  # the most bytes to send back (the client's pace, fetch_pace.py); 0: CHUNK_BYTES

    def check(self, payload_len: int) -> None:
        if payload_len:
            raise RemoteProtocolError(f"{self.TYPE} carries no payload, got {payload_len} bytes")
        if len(self.run) != RUN_BYTES:
            raise RemoteProtocolError(f"{self.TYPE}: run identity of {len(self.run)} bytes, not {RUN_BYTES}")
        _check_common(self.TYPE, self.model, self.stage)
        if len(self.digest) not in (0, DIGEST_BYTES):
            raise RemoteProtocolError(f"{self.TYPE}: a digest of {len(self.digest)} bytes")
        if not 0 <= self.offset < MAX_SNAPSHOT_BYTES:
            raise RemoteProtocolError(f"{self.TYPE}: offset {self.offset} out of range")
        if not 0 <= self.length <= CHUNK_BYTES:
            raise RemoteProtocolError(f"{self.TYPE}: length {self.length} out of range")


@wire.message("snapshot.part")
class Part(wire.Message):
    """Bytes ``[offset, offset + payload)`` of the snapshot ``digest`` (``total`` bytes in all)."""

    model: str
    stage: int
    round: int  # the outer rounds the snapshot's replica had completed
    step: int  # its inner steps
    digest: bytes
    total: int
    offset: int

    def check(self, payload_len: int) -> None:
        _check_common(self.TYPE, self.model, self.stage)
        if len(self.digest) != DIGEST_BYTES:
            raise RemoteProtocolError(f"{self.TYPE}: a digest of {len(self.digest)} bytes")
        if not 0 <= self.round <= wire.INT_MAX or not 0 <= self.step <= wire.INT_MAX:
            raise RemoteProtocolError(f"{self.TYPE}: round {self.round} or step {self.step} out of range")
        if not 0 < self.total <= MAX_SNAPSHOT_BYTES or not 0 <= self.offset < self.total:
            raise RemoteProtocolError(f"{self.TYPE}: offset {self.offset} of {self.total} bytes")
        if payload_len > min(CHUNK_BYTES, self.total - self.offset) or payload_len == 0:
            raise RemoteProtocolError(f"{self.TYPE}: {payload_len} bytes at {self.offset} of {self.total}")


def _check_common(kind: str, model: str, stage: int) -> None:
    if not 0 < len(model) <= MAX_MODEL_CHARS:
        raise RemoteProtocolError(f"{kind}: model name of {len(model)} chars")
    if not 0 <= stage < MAX_STAGES:
        raise RemoteProtocolError(f"{kind}: stage {stage} out of range")


@dataclass(frozen=True)
class Snapshot:
    """One encoded version of a replica's state."""

    data: bytes
    round: int
    step: int
    made_at: float

    @functools.cached_property
    def digest(self) -> bytes:
        """The sha256 of ``data``: computed on first use (``SnapshotServer`` does it in a worker thread), then kept."""
        return hashlib.sha256(self.data).digest()


class SnapshotServer:
    """Serves our stage's state; ``make`` encodes a fresh snapshot (it runs the engine's thread)."""

    def __init__(self, model: str, stage: int, make: Callable[[], Awaitable[Snapshot]],
                 run: bytes = UNNAMED_RUN_BYTES, others: Callable[[int, bytes], Snapshot | None] | None = None) -> None:
        self.model, self.stage, self._make, self.run, self._others = model, stage, make, run, others
        self._versions: list[Snapshot] = []
        self._in_use: dict[bytes, float] = {}  # a version's digest (hot or agreed) -> when a transfer last asked
        self._agreed: list[Snapshot] = []  # our stage's agreed backups, newest last (digests already computed)
        self._lock = trio.Lock()
        self.served = 0  # bytes sent
        self.requests = 0

    async def newest(self) -> Snapshot:
        async with self._lock:  # one serialisation at a time; the others get its result
            now = trio.current_time()
            if not self._versions or now - self._versions[-1].made_at > FRESH_S:
                snapshot = await self._make()
                await trio.to_thread.run_sync(lambda: snapshot.digest)  # hashed once, off the loop
                self._versions = self._kept([*self._versions, snapshot], KEEP_VERSIONS)
            return self._versions[-1]

    def _kept(self, versions: list[Snapshot], keep: int) -> list[Snapshot]:
        """The newest ``keep`` of ``versions``, and the older one a transfer asked for within IN_USE_S:
        on a thin line one fetch outlasts many new versions (the disk loop makes one every period, and
        an outer round a new agreed backup)."""
        now = trio.current_time()
        self._in_use = {digest: at for digest, at in self._in_use.items() if at > now - IN_USE_S}
        in_use = [v for v in versions[:-keep] if v.digest in self._in_use]
        return in_use[-1:] + versions[-keep:]

    def add_agreed(self, snapshot: Snapshot) -> None:
        """Serve ``snapshot`` (our stage's agreed backup, its digest computed) by digest from now on."""
        if all(kept.digest != snapshot.digest for kept in self._agreed):
            self._agreed = self._kept([*self._agreed, snapshot], KEEP_AGREED)

    async def on_frame(self, peer: str, message, payload: bytes):
        if not isinstance(message, Get):
            raise RemoteProtocolError(f"{message.TYPE} is not a snapshot request")
        if message.run != self.run:
            return wire.ErrorReply("other-run", f"this peer trains run {self.run.hex()}, not {message.run.hex()}")
        snapshot: Snapshot | None
        if (message.model, message.stage) != (self.model, self.stage):
            held = self._others(message.stage, message.digest) if self._others and message.digest else None
            if held is None or message.model != self.model:
                return wire.ErrorReply("wrong-stage", f"this peer serves stage {self.stage} of {self.model}")
            snapshot = held
        elif message.digest:
            kept = self._versions + self._agreed
            snapshot = next((v for v in kept if v.digest == message.digest), None)
            if snapshot is None:
                return wire.ErrorReply("gone", "that snapshot version is no longer kept; ask for the newest")
            self._in_use[snapshot.digest] = trio.current_time()
        else:
            snapshot = await self.newest()
        reply = part_reply(self.model, message, snapshot)
        if not isinstance(reply, wire.ErrorReply):
            self.requests += 1
            self.served += len(reply[1])
        return reply


def part_reply(model: str, message: Get, snapshot: Snapshot):
    """The reply to ``message`` from ``snapshot`` (stage ``message.stage`` of ``model``): a part, or bad-offset."""
    if message.offset >= len(snapshot.data):
        return wire.ErrorReply("bad-offset", f"offset {message.offset} beyond {len(snapshot.data)} bytes")
    chunk = snapshot.data[message.offset:message.offset + (message.length or CHUNK_BYTES)]
    reply = Part(model, message.stage, snapshot.round, snapshot.step, snapshot.digest, len(snapshot.data),
                 message.offset)
    return reply, chunk


@dataclass(frozen=True)
class Fetched:
    data: bytearray  # the snapshot (checked against its digest): ``checkpoint.decode_state`` takes it as is
    round: int
    step: int
    peer: str
    seconds: float
    resumed_at: int = 0  # the bytes an earlier, cut attempt had fetched (PartialFetches)


@dataclass
class Partial:
    """A fetch in progress: the first reply (digest, total, round, step), the bytes so far, their hash."""

    model: str
    stage: int
    run: bytes
    first: Part | None = None
    data: bytearray = field(default_factory=bytearray)
    hasher: Any = None  # hashlib's sha256 of ``data``, None before the first byte


class PartialFetches:
    """Fetches cut short (a dropped stream, a stall), kept so the next attempt at the same version resumes
    at the byte it reached instead of byte 0; at most ``MAX_PARTIALS``, the oldest forgotten first. The
    bytes are checked against the digest only once whole, whoever sent them: a peer that sent bad ones
    fails that check and the partial is dropped."""

    def __init__(self) -> None:
        self._kept: list[Partial] = []

    def take(self, model: str, stage: int, run: bytes, digest: bytes) -> Partial | None:
        """The kept fetch of that version (``digest`` empty: of any version of that stage), removed; or None."""
        for partial in reversed(self._kept):
            assert partial.first is not None  # only fetches that got a reply are kept
            if (partial.model, partial.stage, partial.run) == (model, stage, run) and \
                    (not digest or partial.first.digest == digest):
                self._kept.remove(partial)
                return partial
        return None

    def keep(self, partial: Partial) -> None:
        if partial.first is not None and partial.data:
            self._kept = [*self._kept, partial][-MAX_PARTIALS:]

    def __len__(self) -> int:
        return len(self._kept)


class _VersionGone(DialError):
    """The server no longer keeps the version a resumed fetch was at."""


async def fetch_snapshot(pool, peer: str, model: str, stage: int, *, timeout: float = FETCH_TIMEOUT,
                         run: bytes = UNNAMED_RUN_BYTES, max_bytes: int = MAX_SNAPSHOT_BYTES,
                         digest: bytes = b"", partials: PartialFetches | None = None, share: float = 1.0) -> Fetched:
    """The newest snapshot of ``stage`` from ``peer`` (``digest``: that version, e.g. an agreed backup), checked
    whole; DialError or RemoteProtocolError (also when the peer answers with another version than ``digest``).

    ``max_bytes``: the most the asker's stage can take (``plan.snapshot_plan``); a bigger claim is
    refused at its first reply, so no peer makes a small stage's joiner buffer the largest tier's.

    Chunk sizes, pauses (``share`` of the line's time) and the whole fetch's deadline (``timeout`` for a
    small snapshot) follow ``fetch_pace``. With ``partials``, a fetch cut by a DialError (a stall, a
    dropped stream) is kept there, and a later fetch of the same version (of any, without ``digest``:
    back to the newest if the server no longer keeps it) goes on from where it stopped. The chunks go
    into one buffer that grows as they arrive (never a buffer sized by the peer's claim before its
    bytes came) and are hashed as they come, each update in a worker thread: a snapshot takes its own
    size in memory once, not twice.
    """
    resumed = partials.take(model, stage, run, digest) if partials is not None else None
    progress = resumed or Partial(model, stage, run)
    try:
        try:
            return await _transfer(pool, peer, progress, digest, max_bytes, ChunkPace(share), timeout)
        except _VersionGone:
            if resumed is None or digest:
                raise
            progress = Partial(model, stage, run)  # that version is gone: the newest, from byte 0
            return await _transfer(pool, peer, progress, digest, max_bytes, ChunkPace(share), timeout)
    except DialError:
        if partials is not None:
            partials.keep(progress)
        raise


async def _transfer(pool, peer: str, progress: Partial, digest: bytes, max_bytes: int, pace: ChunkPace,
                    timeout: float) -> Fetched:
    model, stage, run = progress.model, progress.stage, progress.run
    started, resumed_at = trio.current_time(), len(progress.data)
    with trio.move_on_after(timeout) as scope:
        async with pool.lease(peer, PROTOCOL_ID) as stream:
            while progress.first is None or len(progress.data) < progress.first.total:
                first, length, asked = progress.first, pace.next_length(), trio.current_time()
                await stream.write_frame(Get(model, stage, first.digest if first else digest, len(progress.data),
                                             run, length))
                reply, payload = await stream.read_frame(max_payload=length, timeout=CHUNK_TIMEOUT)
                if isinstance(reply, wire.ErrorReply) and reply.code == "gone" and first is not None:
                    raise _VersionGone(f"snapshot {first.digest.hex()[:12]} from {peer}: {reply.detail}")
                first = progress.first = _check_part(reply, first, len(progress.data), model, stage)
                if digest and first.digest != digest:
                    raise RemoteProtocolError(f"snapshot from {peer}: asked for version {digest.hex()[:12]}, "
                                              f"got {first.digest.hex()[:12]}")
                if first.total > max_bytes:
                    raise RemoteProtocolError(f"snapshot from {peer} claims {first.total} bytes; a snapshot of "
                                              f"{model} stage {stage} takes at most {max_bytes}")
                scope.deadline = started + pace.allowed(timeout, first.total - resumed_at)
                progress.data += payload
                progress.hasher = await trio.to_thread.run_sync(_hashed, progress.hasher, payload)  # off the loop
                await trio.sleep(pace.observe(len(payload), trio.current_time() - asked))
    if scope.cancelled_caught:
        raise DialError(f"snapshot of stage {stage} from {peer}: not complete within "
                        f"{scope.deadline - started:.0f} s ({len(progress.data)} bytes)")
    first = progress.first
    assert progress.hasher is not None and first is not None  # the loop read at least one part
    if progress.hasher.digest() != first.digest:
        if resumed_at:  # its first bytes came in an earlier try, maybe from another peer: start over, blame none
            progress.first, progress.data, progress.hasher = None, bytearray(), None  # (nothing left to keep)
            raise DialError(f"snapshot from {peer}, resumed at byte {resumed_at}, does not match its digest")
        raise RemoteProtocolError(f"snapshot from {peer} does not match its digest")
    return Fetched(progress.data, first.round, first.step, peer, trio.current_time() - started, resumed_at)


def _hashed(hasher, chunk: bytes):
    """``hasher`` (a new sha256 if None) updated with ``chunk``: the client's hashing, in a worker thread."""
    hasher = hasher or hashlib.sha256()
    hasher.update(chunk)
    return hasher


def _check_part(reply, first: Part | None, offset: int, model: str, stage: int) -> Part:
    if isinstance(reply, wire.ErrorReply):
        raise DialError(f"no snapshot: {reply.code}: {reply.detail}")
    if not isinstance(reply, Part):
        raise RemoteProtocolError(f"a {reply.TYPE} in answer to snapshot.get")
    if (reply.model, reply.stage, reply.offset) != (model, stage, offset):
        raise RemoteProtocolError(f"snapshot part for {reply.model}/{reply.stage} at {reply.offset}, asked "
                                  f"{model}/{stage} at {offset}")
    if first is not None and (reply.digest, reply.total, reply.round, reply.step) != \
            (first.digest, first.total, first.round, first.step):
        raise RemoteProtocolError("snapshot changed during the transfer")
    return first or reply

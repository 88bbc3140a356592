"""The messages of the DiLoCo protocol, ``/p2pswarm/diloco/1.0.0``: how replicas meet for an outer round.

The replicas of a stage train alone for H inner steps, then meet for an outer round with no
coordinator (``round.py`` is the state machine). Every frame is a request that gets exactly
one reply frame on the same pooled stream:

- ``Hello`` (no payload) is a replica's status for an outer round: ready to meet, closed
  (stopped gathering: ``members`` is then its proposal of the group), or neither (still
  training). It is answered with the receiver's own ``Hello``, which the asker processes like
  a request; so every exchange tells both sides where the other is.
- ``Part`` (payload: one encoded shard of a pseudo-gradient) is a member's contribution to the
  shard that the receiver owns; ``Result`` (payload: the aggregated shard) is the owner's
  aggregate, for every member. Both name the group by its digest (``group_digest``), so data
  computed for one group can never be mixed into another. Each is answered with a ``Reply``.

Shards are contiguous slices of the flat pseudo-gradient (``shard_bounds``); member i of the
sorted group owns shard i. A shard too big for one frame is cut into ``pieces`` equal pieces
(``shard_plan``: each within ``MAX_NUMEL`` elements and ``wire.MAX_PAYLOAD_BYTES`` encoded), and
each piece travels as its own Part and Result (``piece``); a small stage has one piece a shard,
exactly the shards of before. A piece travels encoded by a codec (``CODECS``); ``expected_bytes``
is the encoded size, the same formula as ``p2pswarm.diloco.codec`` (a sparse Result's also follows
its ``contributors``: room for each one's entries), so that a header whose payload does not match is
refused before any decoding.

This module only defines and validates the messages: it imports neither trio nor torch. Every
field is bounded, and any invalid header is a ``RemoteProtocolError``.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterable
from typing import TYPE_CHECKING

from p2pswarm import wire
from p2pswarm.dht.records import MAX_PEER_ID_CHARS, MAX_STAGES, RUN_BYTES, UNNAMED_RUN_BYTES
from p2pswarm.errors import RemoteProtocolError

PROTOCOL_ID = "/p2pswarm/diloco/1.0.0"  # the libp2p protocol these frames travel on
MAX_ROUND = wire.INT_MAX  # outer rounds count up for a whole run: any u63 is fine
MAX_MEMBERS = 64  # members of one group: the butterfly sends each member |G|-1 parts and results
MAX_NUMEL = 2**26  # elements of one piece (64M): what one decoder may allocate (256 MiB of float32)
MAX_STAGE_NUMEL = 2**36  # elements of one stage's flat pseudo-gradient: 14x the xl tier's ~5e9 stage
MAX_PIECES = 4096  # pieces of one shard: a MAX_STAGE_NUMEL stage in 2 shards of 2**24-element fp32 pieces
CODECS = ("float32", "float16", "bfloat16", "int8", "sparse")  # must equal p2pswarm.diloco.codec.CODECS
INT8_CHUNK = 1024  # int8 elements per float32 scale; must equal p2pswarm.diloco.compression.INT8_CHUNK
SPARSE_CHUNK, SPARSE_TOP = 4096, 64  # a sparse chunk and the entries a part keeps of it: sparse.py's
SPARSE_SCALE_BYTES = 8  # a sparse chunk's two float32 scales
DIGEST_BYTES = 32  # a group digest is a SHA-256
MAX_REASON_CHARS = 200  # a Reply's reason is a short phrase for logs, not a document
GROUP_DOMAIN = b"p2pswarm/diloco-group/v1\n"  # a group digest can't pass for any other hash

_ELEMENT_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}  # bytes per element of the plain codecs
_INT8_SCALE_BYTES = 4  # one float32 scale per INT8_CHUNK elements


def expected_bytes(codec: str, numel: int, width: int = 1) -> int:
    """The encoded size of ``numel`` elements under ``codec``, the same formula as ``diloco.codec``'s:
    ``width`` is the members whose entries a sparse piece holds (a Part 1, a Result its contributors).
    ValueError for an unknown codec or a bad size or width."""
    if type(numel) is not int or numel < 0:
        raise ValueError(f"numel must be a non-negative int, not {numel!r}")
    if codec == "int8":
        return _INT8_SCALE_BYTES * -(-numel // INT8_CHUNK) + numel
    if codec == "sparse":
        if type(width) is not int or not 1 <= width <= MAX_MEMBERS:
            raise ValueError(f"width must be an int in [1, {MAX_MEMBERS}], not {width!r}")
        top = min(SPARSE_CHUNK, SPARSE_TOP * width)
        full, rest = divmod(numel, SPARSE_CHUNK)
        entries = full * top + min(rest, top)  # 12-bit indices two in 3 bytes, 2-bit codes four a byte
        return SPARSE_SCALE_BYTES * -(-numel // SPARSE_CHUNK) + 3 * -(-entries // 2) + -(-entries // 4)
    if codec not in _ELEMENT_BYTES:
        raise ValueError(f"unknown codec {codec!r}; expected one of {CODECS}")
    return _ELEMENT_BYTES[codec] * numel


def is_peer_id(value: object) -> bool:
    """A peer id on this protocol: 1 to MAX_PEER_ID_CHARS printable ASCII chars (base58 text)."""
    return (type(value) is str and 0 < len(value) <= MAX_PEER_ID_CHARS
            and value.isascii() and value.isprintable())


def shard_bounds(numel: int, n: int) -> list[tuple[int, int]]:
    """``n`` contiguous ``(start, stop)`` slices covering [0, numel); sizes differ by at most 1, first larger."""
    if type(numel) is not int or type(n) is not int or numel < 0 or n < 1:
        raise ValueError(f"cannot split {numel!r} elements into {n!r} shards")
    base, extra = divmod(numel, n)
    bounds, start = [], 0
    for i in range(n):
        stop = start + base + (i < extra)
        bounds.append((start, stop))
        start = stop
    return bounds


@dataclasses.dataclass(frozen=True)
class ShardPlan:
    """How a round cuts ``numel`` elements: ``shards`` owners' shards of ``pieces`` pieces each.

    ``bounds[shard * pieces + piece]`` is the (start, stop) of that piece in the flat vector;
    with one piece a shard, ``bounds`` is ``shard_bounds(numel, shards)``."""

    numel: int
    shards: int
    pieces: int
    bounds: tuple[tuple[int, int], ...]

    def owner(self, index: int) -> int:
        """The shard (owner's index in the sorted group) of ``bounds[index]``."""
        return index // self.pieces

    def index(self, shard: int, piece: int) -> int:
        """The position in ``bounds`` of ``piece`` of ``shard``."""
        return shard * self.pieces + piece


def piece_elements(codec: str, *, max_elements: int = MAX_NUMEL, max_bytes: int = wire.MAX_PAYLOAD_BYTES,
                   size=None, width: int = 1) -> int:
    """The most elements one piece may hold: within ``max_elements`` and, encoded under ``codec`` at
    ``width`` (``size``: ``expected_bytes`` unless given), within ``max_bytes``. ValueError if not even one fits."""
    size = size or expected_bytes
    low, high = 0, max_elements  # the largest n with size(codec, n) <= max_bytes, by bisection (sizes grow with n)
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if size(codec, mid, width) <= max_bytes else (low, mid - 1)
    if low < 1:
        raise ValueError(f"not one {codec} element fits in {max_bytes} bytes")
    return low


def shard_plan(numel: int, shards: int, codec: str, *, max_elements: int = MAX_NUMEL,
               max_bytes: int = wire.MAX_PAYLOAD_BYTES, size=None) -> ShardPlan:
    """``shard_bounds(numel, shards)``, each shard cut into the same number of pieces, as few as
    keep every piece within ``piece_elements`` (a Result of every member's entries too: width ``shards``);
    ValueError past MAX_STAGE_NUMEL or MAX_PIECES."""
    if type(numel) is not int or not 0 <= numel <= MAX_STAGE_NUMEL:
        raise ValueError(f"a stage of {numel!r} elements is outside [0, {MAX_STAGE_NUMEL}]")
    owners = shard_bounds(numel, shards)
    largest = max(stop - start for start, stop in owners)
    fits = piece_elements(codec, max_elements=max_elements, max_bytes=max_bytes, size=size, width=shards)
    pieces = max(1, -(-largest // fits))
    if pieces > MAX_PIECES:
        raise ValueError(f"{numel} elements in {shards} shards need {pieces} pieces a shard, more than {MAX_PIECES}")
    bounds = tuple((start + a, start + b) for start, stop in owners for a, b in shard_bounds(stop - start, pieces))
    return ShardPlan(numel, shards, pieces, bounds)


def bytes_sent(numel: int, members: int, codec: str) -> int:
    """What one member sends in a round of ``members`` (at least 2) over ``numel`` elements, at most: a
    Part of every piece it does not own, and the Result of each piece of the largest shard to every
    other member (room for all members' entries: a sparse Result's largest). Arithmetic only."""
    plan = shard_plan(numel, members, codec)
    parts = sum(expected_bytes(codec, b - a) for a, b in plan.bounds[plan.pieces:])  # the largest shard is ours
    results = sum(expected_bytes(codec, b - a, members) for a, b in plan.bounds[:plan.pieces])
    return parts + (members - 1) * results


def group_digest(stage: int, round: int, members: Iterable[str]) -> bytes:
    """SHA-256 naming a group: stage, round and the sorted member ids, length-prefixed, big-endian."""
    ids = sorted(members)
    if len(set(ids)) != len(ids) or not all(is_peer_id(m) for m in ids) or not 0 < len(ids) <= MAX_MEMBERS:
        raise ValueError(f"a group is 1 to {MAX_MEMBERS} distinct peer ids, not {ids!r:.200}")
    if not (0 <= stage < MAX_STAGES and 0 <= round <= MAX_ROUND):
        raise ValueError(f"stage {stage} or round {round} out of range")
    h = hashlib.sha256(GROUP_DOMAIN)
    h.update(stage.to_bytes(8, "big") + round.to_bytes(8, "big") + len(ids).to_bytes(2, "big"))
    for member in ids:
        raw = member.encode("ascii")
        h.update(len(raw).to_bytes(2, "big") + raw)
    return h.digest()


def _check_int(kind: str, name: str, value: int, low: int, high: int) -> None:
    if not low <= value <= high:
        raise RemoteProtocolError(f"{kind}: {name} {value} is not within [{low}, {high}]")


def _check_no_payload(kind: str, payload_len: int) -> None:
    if payload_len:
        raise RemoteProtocolError(f"{kind} carries no payload, got {payload_len} bytes")


def _check_codec(kind: str, codec: str) -> None:
    if codec not in CODECS:
        raise RemoteProtocolError(f"{kind}: codec {codec!r:.40} is not one of {CODECS}")


@wire.message("diloco.hello")
class Hello(wire.Message):
    """A replica's status for ``round`` (see the module docstring and ``round.py``).

    ``ready`` and not ``closed``: gathering, ``members`` = the ready peers it knows (itself
    included). ``ready`` and ``closed``: its proposal of the group (sorted, itself included).
    Neither: still training, ``members`` = the ready peers it knows. ``closed`` and not
    ``ready``: it withdrew from this round (left out, or behind); ``members`` is informative only.
    """

    stage: int  # 0 <= stage < MAX_STAGES
    round: int  # outer rounds the sender has completed, 0 <= round <= MAX_ROUND
    numel: int  # elements of the stage's flat pseudo-gradient, 1 <= numel <= MAX_STAGE_NUMEL
    codec: str  # one of CODECS: the encoding of every Part and Result of the round
    ready: bool
    closed: bool
    members: tuple[str, ...]  # strictly increasing peer ids, at most MAX_MEMBERS
    run: bytes = UNNAMED_RUN_BYTES  # the sender's run identity: replicas of another run never meet

    def check(self, payload_len: int) -> None:
        kind = self.TYPE
        _check_no_payload(kind, payload_len)
        if len(self.run) != RUN_BYTES:
            raise RemoteProtocolError(f"{kind}: run identity of {len(self.run)} bytes, not {RUN_BYTES}")
        _check_int(kind, "stage", self.stage, 0, MAX_STAGES - 1)
        _check_int(kind, "round", self.round, 0, MAX_ROUND)
        _check_int(kind, "numel", self.numel, 1, MAX_STAGE_NUMEL)
        _check_codec(kind, self.codec)
        if len(self.members) > MAX_MEMBERS:
            raise RemoteProtocolError(f"{kind}: {len(self.members)} members exceeds {MAX_MEMBERS}")
        if not all(is_peer_id(m) for m in self.members):
            raise RemoteProtocolError(f"{kind}: a member is not a peer id of 1 to {MAX_PEER_ID_CHARS} ASCII chars")
        if any(a >= b for a, b in zip(self.members, self.members[1:])):
            raise RemoteProtocolError(f"{kind}: members are not sorted and distinct")


@dataclasses.dataclass(frozen=True)
class _ShardMessage(wire.Message):
    """Fields and checks shared by Part and Result; the payload is one shard, encoded by ``codec``."""

    stage: int  # 0 <= stage < MAX_STAGES
    round: int  # 0 <= round <= MAX_ROUND
    group: bytes  # group_digest of the group this shard belongs to, DIGEST_BYTES long
    shard: int  # 0 <= shard < shards: the index of the owner in the sorted group
    shards: int  # 2 <= shards <= MAX_MEMBERS: the group's size (a group of one exchanges nothing)
    codec: str  # one of CODECS
    numel: int  # elements in this piece, 0 <= numel <= MAX_NUMEL; the payload is their encoding

    if TYPE_CHECKING:  # each subclass declares it last, with a default: not a field of this base
        @property
        def piece(self) -> int: ...

    def width(self) -> int:
        """The members whose entries the payload holds (``expected_bytes``): a Part's one member."""
        return 1

    def check(self, payload_len: int) -> None:
        kind = self.TYPE
        _check_int(kind, "piece", self.piece, 0, MAX_PIECES - 1)
        _check_int(kind, "stage", self.stage, 0, MAX_STAGES - 1)
        _check_int(kind, "round", self.round, 0, MAX_ROUND)
        if len(self.group) != DIGEST_BYTES:
            raise RemoteProtocolError(f"{kind}: group digest of {len(self.group)} bytes, not {DIGEST_BYTES}")
        _check_int(kind, "shards", self.shards, 2, MAX_MEMBERS)
        _check_int(kind, "shard", self.shard, 0, self.shards - 1)
        _check_codec(kind, self.codec)
        _check_int(kind, "numel", self.numel, 0, MAX_NUMEL)
        size = expected_bytes(self.codec, self.numel, self.width())
        if payload_len != size:
            raise RemoteProtocolError(
                f"{kind}: {self.numel} {self.codec} elements are {size} bytes, the payload is {payload_len}")


@wire.message("diloco.part")
class Part(_ShardMessage):
    """A member's contribution to piece ``piece`` of shard ``shard``, sent to that shard's owner."""

    piece: int = 0  # 0 <= piece < MAX_PIECES: which piece of the shard (``shard_plan``)


@wire.message("diloco.result")
class Result(_ShardMessage):
    """The owner's aggregate of one piece of its shard, sent to every member; ``contributors`` parts were combined."""

    contributors: int  # 1 <= contributors <= shards
    piece: int = 0  # 0 <= piece < MAX_PIECES: which piece of the shard (``shard_plan``)

    def width(self) -> int:
        """Its contributors: an aggregate of sparse parts holds room for each one's entries."""
        return self.contributors

    def check(self, payload_len: int) -> None:
        _check_int(self.TYPE, "shards", self.shards, 2, MAX_MEMBERS)  # (before the size, which needs a width)
        _check_int(self.TYPE, "contributors", self.contributors, 1, self.shards)
        super().check(payload_len)


@wire.message("diloco.reply")
class Reply(wire.Message):
    """The answer to a Part or Result: whether the receiver will use it, and if not why."""

    round: int  # the round of the Part or Result answered
    shard: int  # its shard index, 0 <= shard < MAX_MEMBERS
    accepted: bool
    reason: str  # empty, or a short phrase of at most MAX_REASON_CHARS

    def check(self, payload_len: int) -> None:
        kind = self.TYPE
        _check_no_payload(kind, payload_len)
        _check_int(kind, "round", self.round, 0, MAX_ROUND)
        _check_int(kind, "shard", self.shard, 0, MAX_MEMBERS - 1)
        if len(self.reason) > MAX_REASON_CHARS:
            raise RemoteProtocolError(f"{kind}: reason of {len(self.reason)} chars exceeds {MAX_REASON_CHARS}")

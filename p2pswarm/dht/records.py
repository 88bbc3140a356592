"""Signed stage records: which peer serves which stage of which model, with what capacity.

A model's layers are cut into stages (``model.catalog``); a peer serves one stage and announces
it under the stage's DHT key. Stage records are kept by DHT peers nobody vouches for, so a record must prove itself: it
carries an Ed25519 signature by the peer it names, checkable from the peer id alone (an
Ed25519 peer id inlines its public key). This module is the one place where record bytes are
made (``sign_record`` refuses to make a bad one) and judged (``verify_record`` turns any
byte string into a valid record or a ``RemoteProtocolError``, nothing else).

Wire format, canonical CBOR (RFC 8949 4.2.3 length-first key order; for these short text
keys it coincides with the core deterministic order of 4.2.1)::

    {"v": 3, "r": body, "s": signature}
    body = {"peer": str, "addrs": [str, ...], "run": str, "model": str, "stage": int, "start": int, "end": int,
            "cap": {"mem": int, "queue": int, "flags": int, ?"tput": float, ?"round": int},
            "ts": float, "ttl": float, ?"agreed": [int, bytes], ?"backups": [int, int, bytes, ...]}
    signature = Ed25519(SIGNATURE_DOMAIN + canonical CBOR of body), by the key in body["peer"]

The format can gain fields without breaking older peers: a reader ignores body and capacity
keys it does not know (up to MAX_BODY_KEYS / MAX_CAPACITY_KEYS, plain CBOR within the depth
limit), and a store serves the signed bytes as received, unknown fields included. A change an
older reader must not ignore bumps ``v``.

Rules ``verify_record`` enforces beyond the field limits below:

* The message must be exactly the canonical encoding of the plain value it decodes to, so
  tags, indefinite lengths, duplicate keys, trailing bytes and oversized number encodings
  are refused, and the signed body bytes are exactly the body bytes inside the message.
* ``ts`` and ``ttl`` may be CBOR floats or ints (encoders that shorten integral floats to
  ints stay compatible) but never booleans; they are returned as Python floats.
  ``sign_record`` always writes floats.
* ``run`` is the identity of the run the peer trains (``p2pswarm.run.spec``): 16 lowercase hex
  characters. It is part of the record's DHT key (``stage_key``), so peers of different runs never
  find each other's records, and a reader drops a record whose run is not the one it asked for.
* ``agreed`` (optional) is ``[round, digest]``: the sha256 of our stage's agreed backup bytes
  (``heal.backups``) at that outer round. ``backups`` (optional) is a FLAT list of
  ``stage, round, digest`` triples, at most MAX_BACKUP_CLAIMS: the other stages' backups we hold.
  A claim's stage is never the record's own stage and no stage is claimed twice. Both are left
  out when empty, so older readers see the record they always saw.
* ``peer`` must be the canonical base58 text of an identity-multihash Ed25519 peer id:
  re-deriving the id from the embedded key must give the same bytes, so one key cannot
  sign under several spellings of its id.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

import cbor2

from p2pswarm.errors import LocalProtocolError, RemoteProtocolError

RECORD_VERSION = 3  # bumped on any change an older reader must not ignore (v2: stage-keyed, v3: run-keyed)
SIGNATURE_DOMAIN = b"p2pswarm/stage-record/v3\n"  # a record signature can't pass as another kind
STAGE_KEY_DOMAIN = b"p2pswarm/stage/"  # so stage keys can't collide with other DHT key kinds

MAX_RECORD_BYTES = 4096  # a record is a few hundred bytes; bound the work done on hostile input
MAX_CBOR_DEPTH = 3  # message map > body map > capacity map or addrs list; nothing deeper is legal
MAX_ADDRS = 16  # enough for every transport and interface a peer can listen on
MAX_ADDR_CHARS = 256  # the longest sane multiaddr (dns name, relay path) fits well within this
MAX_MODEL_CHARS = 64  # model names are short identifiers, shown in logs
MAX_PEER_ID_CHARS = 64  # an Ed25519 peer id is 52 base58 chars; cap before the quadratic decode
MAX_LAYERS = 4096  # layer indices are below this; no trained model is that deep
MAX_STAGES = MAX_LAYERS  # a stage holds at least one layer
RUN_CHARS = 16  # a run identity: 64 bits of sha256 as lowercase hex (p2pswarm.run.spec)
UNNAMED_RUN = "0" * RUN_CHARS  # records and keys made without a run (tests, tools); no run file hashes to it
RUN_BYTES = RUN_CHARS // 2  # the identity as activation, DiLoCo and snapshot requests carry it
UNNAMED_RUN_BYTES = bytes.fromhex(UNNAMED_RUN)  # ... and the unnamed run so
MAX_BODY_KEYS = 24  # the 12 known body keys plus room for fields added later; bounds the work
MAX_CAPACITY_KEYS = 12  # the 5 known capacity keys plus room for fields added later
MAX_EXTRA_KEY_CHARS = 32  # names of fields this version does not know
MAX_OUTER_ROUND = 2**63 - 1  # outer rounds count up for a whole run: any u63 is fine
MAX_THROUGHPUT = 1e12  # tokens/s; far beyond any peer, keeps the value a sane finite float
MAX_FREE_MEMORY_MB = 2**32 - 1  # fits a uint32 in any implementation; 4 PB is beyond any peer
MAX_QUEUE_DEPTH = 2**32 - 1  # fits a uint32 in any implementation
PLAUSIBLE_FREE_MEMORY_MB = 2 * 1024 * 1024  # 2 TiB: the largest single hosts; ranking counts no more
PLAUSIBLE_THROUGHPUT = 1e7  # tokens/s through one stage of one peer; ranking counts no more
PLAUSIBLE_QUEUE_DEPTH = 10_000  # requests waiting; far beyond any peer's bounded buffer
FLAGS_LIMIT = 2**32  # capacity flags are a 32-bit field; unknown bits are kept, not refused
MIN_TTL = 1.0  # a shorter-lived record expires before it can be stored and read
MAX_TTL = 60.0  # a few re-announce periods (5 s): a record outlives its author by a minute at most,
#                and no one can park a record for an hour and outlast honest 15 s records
MAX_TIMESTAMP = 2.0**40  # ~year 36800: beyond it a clock is broken; ints below it are exact floats
ED25519_SIGNATURE_BYTES = 64  # fixed size of an Ed25519 signature
MAX_SHOWN_CHARS = 80  # error messages quote at most this much of a peer-chosen value

FLAG_RELAYED = 1  # reachable only through a circuit relay: slower, prefer others
FLAG_TRAINING = 2  # accepts backward passes, not only forward (inference) requests
FLAG_DRAINING = 4  # shutting down: finish current work, send no new work
FLAG_GPU = 8  # serves its layers from an accelerator rather than the CPU
FLAG_SNAPSHOT = 16  # serves hot snapshots of its stage (/p2pswarm/snapshot/1.0.0): a joiner loads from it
FLAG_PINNED = 32  # never moves to another stage (rebalancing leaves it where its operator put it)
MAX_BACKUP_CLAIMS = 8  # backups one record announces; a peer holds a couple (BACKUP_COPIES per stage)
DIGEST_BYTES = 32  # a backup digest is a sha256

_MESSAGE_KEYS = frozenset({"v", "r", "s"})
_BODY_KEYS = frozenset({"peer", "addrs", "run", "model", "stage", "start", "end", "cap", "ts", "ttl"})
_CAPACITY_KEYS = frozenset({"mem", "queue", "flags"})  # required; "tput" and "round" are optional


@dataclass(frozen=True)
class Capacity:
    """How much more work a peer can take right now."""

    free_memory_mb: int  # >= 0
    queue_depth: int  # >= 0, requests waiting
    flags: int = 0  # FLAG_* bitfield, 0 <= flags < FLAGS_LIMIT
    throughput: float = 0.0  # tokens/s recently processed, 0 when unknown (optional on the wire)
    outer_round: int = 0  # DiLoCo outer rounds completed by this replica (optional on the wire, "round")


@dataclass(frozen=True)
class BackupClaim:
    """A record's claim to hold stage ``stage``'s agreed backup of outer round ``round``, whose bytes hash to ``digest``."""

    stage: int  # 0 <= stage < MAX_STAGES, never the claiming record's own stage
    round: int  # 0 <= round <= MAX_OUTER_ROUND
    digest: bytes  # sha256 of the backup bytes, DIGEST_BYTES long


@dataclass(frozen=True)
class StageRecord:
    """One peer's claim to serve stage ``stage`` (layers [start, end)) of a model, for ttl seconds."""

    peer_id: str  # base58 peer id text
    addrs: tuple[str, ...]  # multiaddr strings the peer can be dialled at
    model: str
    stage: int  # 0 <= stage < MAX_STAGES; the DHT key is stage_key(model, stage)
    start: int  # first layer served
    end: int  # one past the last layer served; 0 <= start < end <= MAX_LAYERS
    capacity: Capacity
    timestamp: float  # unix seconds when made
    ttl: float  # seconds the record stays valid after timestamp
    run: str = UNNAMED_RUN  # the identity of the run trained; the DHT key is stage_key(model, stage, run)
    agreed: tuple[int, bytes] | None = None  # (outer round, sha256) of our stage's agreed backup; None: none yet
    backups: tuple[BackupClaim, ...] = ()  # other stages' agreed backups we hold

    @property
    def expires_at(self) -> float:
        return self.timestamp + self.ttl

    def serves(self, layer: int) -> bool:
        return self.start <= layer < self.end

    def is_fresh(self, now: float) -> bool:
        """Not yet expired; whether the timestamp is too far ahead is the store's business."""
        return now < self.expires_at


def stage_key(model: str, stage: int, run: str = UNNAMED_RUN) -> bytes:
    """The DHT key under which the records of peers serving ``stage`` of ``model`` in run ``run`` live:
    another run's peers store and look up under other keys."""
    if not _is_model(model) or not _is_int(stage, 0, MAX_STAGES - 1) or not is_run(run):
        raise LocalProtocolError(f"no stage key for run {_show(run)} model {_show(model)} stage {_show(stage)}")
    return hashlib.sha256(STAGE_KEY_DOMAIN + run.encode() + b"/" + model.encode() + b"/" + str(stage).encode()).digest()


def is_run(run: object) -> bool:
    """A run identity: RUN_CHARS lowercase hex characters."""
    return type(run) is str and len(run) == RUN_CHARS and all(c in "0123456789abcdef" for c in run)


def routing_rank(record: StageRecord) -> tuple:
    """Sort key of ``best_first``: a total order, so ranking never depends on input order.

    Claims count up to the PLAUSIBLE_* bounds only: a record claiming 4 PB free ranks like one
    claiming 2 TiB (the wire accepts more, so that the decoder's limits never need to change)."""
    cap = record.capacity
    relayed = bool(cap.flags & FLAG_RELAYED)  # reachable only through a relay: last (docs/nat.md)
    return (relayed, min(cap.queue_depth, PLAUSIBLE_QUEUE_DEPTH), -min(cap.free_memory_mb, PLAUSIBLE_FREE_MEMORY_MB),
            -min(cap.throughput, PLAUSIBLE_THROUGHPUT), -record.timestamp, record.peer_id, record.run, record.model,
            record.stage, record.start, record.end, record.addrs, record.ttl, cap.flags, cap.queue_depth,
            cap.free_memory_mb, cap.throughput, cap.outer_round, record.agreed or (),
            tuple((c.stage, c.round, c.digest) for c in record.backups))


def best_first(records: Iterable[StageRecord]) -> list[StageRecord]:
    """Directly reachable peers before relayed ones, then shortest queue, most free memory, highest
    throughput, newest, and by peer id; every claim bounded to its PLAUSIBLE_* value. Standing and
    diversity come on top of this (``dht.ranking``)."""
    return sorted(records, key=routing_rank)


def sign_record(record: StageRecord, identity) -> bytes:
    """The signed wire bytes of ``record``; LocalProtocolError if it is not ours or invalid."""
    problem = _record_problem(record)
    if problem is not None:
        raise LocalProtocolError(f"refusing to sign an invalid stage record: {problem}")
    if record.peer_id != identity.peer_id_text:
        raise LocalProtocolError(
            f"refusing to sign a stage record for peer {record.peer_id}: "
            f"we are {identity.peer_id_text}"
        )
    body = _body(record)
    message = {"v": RECORD_VERSION, "r": body, "s": identity.sign(_signed_bytes(body))}
    data = cbor2.dumps(message, canonical=True)
    if len(data) > MAX_RECORD_BYTES:
        raise LocalProtocolError(f"stage record is {len(data)} bytes, over {MAX_RECORD_BYTES}")
    return data


def verify_record(data: bytes) -> StageRecord:
    """The record ``data`` encodes, signed by the peer it names; else RemoteProtocolError."""
    message = _decode(data)
    if type(message) is not dict or message.keys() != _MESSAGE_KEYS:
        raise RemoteProtocolError("stage record must be a map with keys v, r, s")
    version = message["v"]
    if type(version) is not int or version != RECORD_VERSION:
        raise RemoteProtocolError(f"unsupported stage record version {_show(version)}")
    body, signature = message["r"], message["s"]
    record = _record_from_body(body)
    key = _public_key(record.peer_id)
    if key is None:
        raise RemoteProtocolError(f"peer id {record.peer_id} does not inline an Ed25519 key")
    if type(signature) is not bytes or len(signature) != ED25519_SIGNATURE_BYTES:
        raise RemoteProtocolError("stage record signature is not 64 bytes")
    if not _signature_ok(key, _signed_bytes(body), signature):
        raise RemoteProtocolError(f"stage record is not signed by {record.peer_id}")
    return record


def _decode(data: bytes) -> object:
    """Decode the plain CBOR value ``data`` is the canonical encoding of, refusing anything else."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise RemoteProtocolError(f"stage record must be bytes, not {type(data).__name__}")
    data = bytes(data)
    if len(data) > MAX_RECORD_BYTES:
        raise RemoteProtocolError(f"stage record is {len(data)} bytes, over {MAX_RECORD_BYTES}")
    try:
        value = cbor2.loads(
            data,
            semantic_decoders=_NO_TAGS,
            tag_hook=_refuse_tag,
            max_depth=MAX_CBOR_DEPTH,
            allow_indefinite=False,
            allow_duplicate_keys=False,
            strict_hashable_types=True,
        )
        canonical = cbor2.dumps(value, canonical=True)
    except Exception as exc:  # cbor2 raises CBORError, ValueError, RecursionError, ...
        raise RemoteProtocolError(f"stage record is not valid CBOR: {exc}") from None
    if canonical != data:
        raise RemoteProtocolError("stage record is not canonically encoded CBOR")
    return value


class _RefuseEveryTag(Mapping):
    """A semantic-decoder table answering every tag number with a decoder that refuses it.

    cbor2 decodes the tags it knows (datetimes, bignums, shared values, ...) itself and
    consults ``tag_hook`` only for the others; this table overrides all of them.
    """

    def __getitem__(self, tag: int):
        return _refuse_tag

    def __iter__(self):
        return iter(())

    def __len__(self) -> int:
        return 0


def _refuse_tag(*args) -> None:
    raise ValueError("CBOR tags are not allowed in a stage record")


_NO_TAGS = _RefuseEveryTag()
_ABSENT = object()  # an optional body key left out (an explicit null is not the same, and is refused)


def _record_from_body(body: object) -> StageRecord:
    """The record a decoded body map describes; RemoteProtocolError if any field is invalid.

    Keys this version does not know are ignored (the format can grow), within bounds.
    """
    _check_keys(body, _BODY_KEYS, MAX_BODY_KEYS, "body")
    cap, addrs = body["cap"], body["addrs"]
    _check_keys(cap, _CAPACITY_KEYS, MAX_CAPACITY_KEYS, "capacity")
    if type(addrs) is not list:
        raise RemoteProtocolError("stage record addrs must be an array")
    throughput = cap.get("tput", 0.0)
    capacity = Capacity(cap["mem"], cap["queue"], cap["flags"], throughput, cap.get("round", 0))
    agreed, backups = _agreed_from_body(body.get("agreed", _ABSENT)), _claims_from_body(body.get("backups", []))
    record = StageRecord(body["peer"], tuple(addrs), body["model"], body["stage"], body["start"], body["end"],
                         capacity, body["ts"], body["ttl"], body["run"], agreed, backups)
    problem = _record_problem(record)
    if problem is not None:
        raise RemoteProtocolError(f"invalid stage record: {problem}")
    return replace(record, timestamp=float(record.timestamp), ttl=float(record.ttl),
                   capacity=replace(capacity, throughput=float(throughput)))


def _agreed_from_body(value: object) -> tuple[int, bytes] | None:
    """The ``agreed`` pair as the record holds it; its bounds are checked with the other fields."""
    if value is _ABSENT:
        return None
    if type(value) is not list or len(value) != 2:
        raise RemoteProtocolError("stage record agreed must be an array [round, digest]")
    return (value[0], value[1])


def _claims_from_body(value: object) -> tuple[BackupClaim, ...]:
    """The ``backups`` flat list as claims; their bounds are checked with the other fields."""
    if type(value) is not list or len(value) % 3 or len(value) > 3 * MAX_BACKUP_CLAIMS:
        raise RemoteProtocolError(f"stage record backups must be a flat array of at most {MAX_BACKUP_CLAIMS} "
                                  "stage, round, digest triples")
    return tuple(BackupClaim(*value[i:i + 3]) for i in range(0, len(value), 3))


def _check_keys(value: object, required: frozenset, limit: int, what: str) -> None:
    """A map holding every ``required`` key, at most ``limit`` keys, unknown ones short text."""
    if type(value) is not dict or not required <= value.keys():
        raise RemoteProtocolError(f"stage record {what} must be a map with keys {sorted(required)}")
    if len(value) > limit:
        raise RemoteProtocolError(f"stage record {what} has {len(value)} keys, over {limit}")
    if not all(type(k) is str and 0 < len(k) <= MAX_EXTRA_KEY_CHARS for k in value):
        raise RemoteProtocolError(f"stage record {what} keys must be text of 1 to {MAX_EXTRA_KEY_CHARS} chars")


def _record_problem(record: StageRecord) -> str | None:
    """What is wrong with the record's fields, or None; the peer id's key is checked elsewhere."""
    peer_id, addrs, capacity = record.peer_id, record.addrs, record.capacity
    if type(peer_id) is not str or not 0 < len(peer_id) <= MAX_PEER_ID_CHARS:
        return f"peer id {_show(peer_id)} is not a string of 1 to {MAX_PEER_ID_CHARS} chars"
    if type(addrs) is not tuple or len(addrs) > MAX_ADDRS:
        return f"addrs must be a tuple of at most {MAX_ADDRS} multiaddrs"
    if not all(_is_addr(addr) for addr in addrs):
        return f"addrs hold a value that is not a multiaddr of 1 to {MAX_ADDR_CHARS} ASCII chars"
    if not is_run(record.run):
        return f"run {_show(record.run)} is not {RUN_CHARS} lowercase hex chars"
    if not _is_model(record.model):
        return f"model {_show(record.model)} is not 1 to {MAX_MODEL_CHARS} printable chars"
    if not _is_int(record.stage, 0, MAX_STAGES - 1):
        return f"stage {_show(record.stage)} is not an integer within [0, {MAX_STAGES})"
    if not (_is_int(record.start, 0, MAX_LAYERS - 1) and _is_int(record.end, 1, MAX_LAYERS)):
        layers = f"[{_show(record.start)}, {_show(record.end)})"
        return f"layers {layers} are not integers within [0, {MAX_LAYERS}]"
    if record.start >= record.end:
        return f"layers [{record.start}, {record.end}) are empty"
    if type(capacity) is not Capacity:
        return "capacity is not a Capacity"
    if not (
        _is_int(capacity.free_memory_mb, 0, MAX_FREE_MEMORY_MB)
        and _is_int(capacity.queue_depth, 0, MAX_QUEUE_DEPTH)
        and _is_int(capacity.flags, 0, FLAGS_LIMIT - 1)
        and _is_number(capacity.throughput, 0, MAX_THROUGHPUT)
        and _is_int(capacity.outer_round, 0, MAX_OUTER_ROUND)
    ):
        return f"capacity {_show(capacity)} is out of bounds"
    if not _is_number(record.timestamp, 0, MAX_TIMESTAMP):
        return f"timestamp {_show(record.timestamp)} is not a number within [0, {MAX_TIMESTAMP}]"
    if not _is_number(record.ttl, MIN_TTL, MAX_TTL):
        return f"ttl {_show(record.ttl)} is not a number within [{MIN_TTL}, {MAX_TTL}]"
    return _backup_problem(record)


def _backup_problem(record: StageRecord) -> str | None:
    """What is wrong with the record's ``agreed`` and ``backups`` fields, or None."""
    agreed, claims = record.agreed, record.backups
    if agreed is not None and not (type(agreed) is tuple and len(agreed) == 2
                                   and _is_int(agreed[0], 0, MAX_OUTER_ROUND) and _is_digest(agreed[1])):
        return f"agreed {_show(agreed)} is not (round, {DIGEST_BYTES}-byte digest)"
    if type(claims) is not tuple or len(claims) > MAX_BACKUP_CLAIMS:
        return f"backups must be a tuple of at most {MAX_BACKUP_CLAIMS} claims"
    for claim in claims:
        if not (type(claim) is BackupClaim and _is_int(claim.stage, 0, MAX_STAGES - 1)
                and _is_int(claim.round, 0, MAX_OUTER_ROUND) and _is_digest(claim.digest)):
            return f"backup claim {_show(claim)} is out of bounds"
        if claim.stage == record.stage:
            return f"backup claim for the record's own stage {record.stage}"
    if len({claim.stage for claim in claims}) != len(claims):
        return "backup claims name a stage twice"
    return None


def _is_digest(value: object) -> bool:
    return type(value) is bytes and len(value) == DIGEST_BYTES


def _show(value: object) -> str:
    """``repr(value)``, cut short: error messages quote values a hostile peer chose."""
    text = repr(value)
    return text if len(text) <= MAX_SHOWN_CHARS else text[:MAX_SHOWN_CHARS] + "..."


def _is_int(value: object, low: int, high: int) -> bool:
    return type(value) is int and low <= value <= high  # type() so a bool is not an int


def _is_number(value: object, low: float, high: float) -> bool:
    return type(value) in (int, float) and low <= value <= high  # NaN fails every comparison


def _is_addr(addr: object) -> bool:
    """A plausible multiaddr; parsing it fully is the dialler's job, not the verifier's."""
    return (type(addr) is str and 0 < len(addr) <= MAX_ADDR_CHARS and addr.startswith("/")
            and addr.isascii() and addr.isprintable() and " " not in addr)


def _is_model(model: object) -> bool:
    return type(model) is str and 0 < len(model) <= MAX_MODEL_CHARS and model.isprintable()


def _body(record: StageRecord) -> dict:
    cap = record.capacity
    return {"peer": record.peer_id, "addrs": list(record.addrs), "run": record.run, "model": record.model,
            "stage": record.stage, "start": record.start, "end": record.end,
            "cap": {"mem": cap.free_memory_mb, "queue": cap.queue_depth, "flags": cap.flags,
                    "tput": float(cap.throughput), **({"round": cap.outer_round} if cap.outer_round else {})},
            "ts": float(record.timestamp), "ttl": float(record.ttl),
            **({"agreed": list(record.agreed)} if record.agreed is not None else {}),
            **({"backups": _flat_claims(record.backups)} if record.backups else {})}


def _flat_claims(claims: tuple[BackupClaim, ...]) -> list:
    """The ``backups`` body value: stage, round, digest of each claim, one flat list (the depth limit stays 3)."""
    return [value for claim in claims for value in (claim.stage, claim.round, claim.digest)]


def _signed_bytes(body: dict) -> bytes:
    return SIGNATURE_DOMAIN + cbor2.dumps(body, canonical=True)


def _public_key(peer_id: str):
    """The Ed25519 key a canonical identity-multihash peer id inlines, or None."""
    from libp2p.crypto.ed25519 import Ed25519PublicKey
    from libp2p.peer.id import ID

    try:
        peer = ID.from_base58(peer_id)
        key = peer.extract_public_key()  # None for hashed (non-inlined) ids and bad protobufs
        if not isinstance(key, Ed25519PublicKey):
            return None
        canonical = peer.to_base58() == peer_id and ID.from_pubkey(key) == peer
    except Exception:  # base58 raises ValueError on bad chars; be total whatever else it does
        return None
    return key if canonical else None


def _signature_ok(key, data: bytes, signature: bytes) -> bool:
    try:
        return bool(key.verify(data, signature))
    except Exception:  # PyNaCl raises rather than returning False on some malformed input
        return False

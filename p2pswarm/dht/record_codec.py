"""Signed stage record bytes: made by ``sign_record``, judged by ``verify_record``.

Stage records are kept by DHT peers nobody vouches for, so a record must prove itself: it
carries an Ed25519 signature by the peer it names, checkable from the peer id alone (an
Ed25519 peer id inlines its public key). This module is the one place where record bytes are
made (``sign_record`` refuses to make a bad one) and judged (``verify_record`` turns any
byte string into a valid record or a ``RemoteProtocolError``, nothing else). The record
dataclasses and their field limits live in ``dht.records``.

Wire format, canonical CBOR (RFC 8949 4.2.3 length-first key order; for these short text
keys it coincides with the core deterministic order of 4.2.1)::

    {"v": 3, "r": body, "s": signature}
    body = {"peer": str, "addrs": [str, ...], "run": str, "model": str, "stage": int, "start": int, "end": int,
            "cap": {"mem": int, "queue": int, "flags": int, ?"tput": float, ?"round": int, ?"loss": float,
                    ?"held": float},
            "ts": float, "ttl": float, ?"agreed": [int, bytes], ?"backups": [int, int, bytes, ...],
            ?"worked": [str, int, ...]}
    signature = Ed25519(SIGNATURE_DOMAIN + canonical CBOR of body), by the key in body["peer"]

The format can gain fields without breaking older peers: a reader ignores body and capacity
keys it does not know (up to MAX_BODY_KEYS / MAX_CAPACITY_KEYS, plain CBOR within the depth
limit), and a store serves the signed bytes as received, unknown fields included. A change an
older reader must not ignore bumps ``v``.

Rules ``verify_record`` enforces beyond the field checks of ``records.record_problem``:

* The message must be exactly the canonical encoding of the plain value it decodes to, so
  tags, indefinite lengths, duplicate keys, trailing bytes and oversized number encodings
  are refused, and the signed body bytes are exactly the body bytes inside the message.
* ``ts`` and ``ttl`` may be CBOR floats or ints (encoders that shorten integral floats to
  ints stay compatible) but never booleans; they are returned as Python floats.
  ``sign_record`` always writes floats.
* ``agreed`` is ``[round, digest]``; ``backups`` is a FLAT list of ``stage, round, digest``
  triples; ``worked`` a FLAT list of ``peer, stage`` pairs. Each is left out when empty, so older
  readers see the record they always saw.
* ``peer`` must be the canonical base58 text of an identity-multihash Ed25519 peer id:
  re-deriving the id from the embedded key must give the same bytes, so one key cannot
  sign under several spellings of its id.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import cbor2

from p2pswarm.dht.records import (
    MAX_BACKUP_CLAIMS,
    MAX_WORK_CLAIMS,
    BackupClaim,
    Capacity,
    StageRecord,
    record_problem,
    shown,
)
from p2pswarm.errors import LocalProtocolError, RemoteProtocolError

RECORD_VERSION = 3  # bumped on any change an older reader must not ignore (v2: stage-keyed, v3: run-keyed)
SIGNATURE_DOMAIN = b"p2pswarm/stage-record/v3\n"  # a record signature can't pass as another kind
MAX_RECORD_BYTES = 4096  # a record is a few hundred bytes; bound the work done on hostile input
MAX_CBOR_DEPTH = 3  # message map > body map > capacity map or addrs list; nothing deeper is legal
MAX_BODY_KEYS = 24  # the 13 known body keys plus room for fields added later; bounds the work
MAX_CAPACITY_KEYS = 12  # the 5 known capacity keys plus room for fields added later
MAX_EXTRA_KEY_CHARS = 32  # names of fields this version does not know
ED25519_SIGNATURE_BYTES = 64  # fixed size of an Ed25519 signature

_MESSAGE_KEYS = frozenset({"v", "r", "s"})
_BODY_KEYS = frozenset({"peer", "addrs", "run", "model", "stage", "start", "end", "cap", "ts", "ttl"})
_CAPACITY_KEYS = frozenset({"mem", "queue", "flags"})  # required; "tput", "round", "loss", "held" optional


def sign_record(record: StageRecord, identity) -> bytes:
    """The signed wire bytes of ``record``; LocalProtocolError if it is not ours or invalid."""
    problem = record_problem(record)
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
        raise RemoteProtocolError(f"unsupported stage record version {shown(version)}")
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


def _record_from_body(body: Any) -> StageRecord:
    """The record a decoded body map describes; RemoteProtocolError if any field is invalid.

    Keys this version does not know are ignored (the format can grow), within bounds.
    """
    _check_keys(body, _BODY_KEYS, MAX_BODY_KEYS, "body")
    cap, addrs = body["cap"], body["addrs"]
    _check_keys(cap, _CAPACITY_KEYS, MAX_CAPACITY_KEYS, "capacity")
    if type(addrs) is not list:
        raise RemoteProtocolError("stage record addrs must be an array")
    throughput, loss, held = cap.get("tput", 0.0), cap.get("loss", 0.0), cap.get("held", 0.0)
    capacity = Capacity(cap["mem"], cap["queue"], cap["flags"], throughput, cap.get("round", 0), loss, held)
    agreed, backups = _agreed_from_body(body.get("agreed", _ABSENT)), _claims_from_body(body.get("backups", []))
    record = StageRecord(body["peer"], tuple(addrs), body["model"], body["stage"], body["start"], body["end"],
                         capacity, body["ts"], body["ttl"], body["run"], agreed, backups,
                         _worked_from_body(body.get("worked", [])))
    problem = record_problem(record)
    if problem is not None:
        raise RemoteProtocolError(f"invalid stage record: {problem}")
    return replace(record, timestamp=float(record.timestamp), ttl=float(record.ttl),
                   capacity=replace(capacity, throughput=float(throughput), train_loss_bpb=float(loss),
                                    heldout_bpb=float(held)))


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


def _worked_from_body(value: object) -> tuple[tuple[str, int], ...]:
    """The ``worked`` flat list as pairs; their bounds are checked with the other fields."""
    if type(value) is not list or len(value) % 2 or len(value) > 2 * MAX_WORK_CLAIMS:
        raise RemoteProtocolError(f"stage record worked must be a flat array of at most {MAX_WORK_CLAIMS} "
                                  "peer, stage pairs")
    return tuple((value[i], value[i + 1]) for i in range(0, len(value), 2))


def _check_keys(value: object, required: frozenset, limit: int, what: str) -> None:
    """A map holding every ``required`` key, at most ``limit`` keys, unknown ones short text."""
    if type(value) is not dict or not required <= value.keys():
        raise RemoteProtocolError(f"stage record {what} must be a map with keys {sorted(required)}")
    if len(value) > limit:
        raise RemoteProtocolError(f"stage record {what} has {len(value)} keys, over {limit}")
    if not all(type(k) is str and 0 < len(k) <= MAX_EXTRA_KEY_CHARS for k in value):
        raise RemoteProtocolError(f"stage record {what} keys must be text of 1 to {MAX_EXTRA_KEY_CHARS} chars")


def _body(record: StageRecord) -> dict:
    cap = record.capacity
    return {"peer": record.peer_id, "addrs": list(record.addrs), "run": record.run, "model": record.model,
            "stage": record.stage, "start": record.start, "end": record.end,
            "cap": {"mem": cap.free_memory_mb, "queue": cap.queue_depth, "flags": cap.flags,
                    "tput": float(cap.throughput), **({"round": cap.outer_round} if cap.outer_round else {}),
                    **({"loss": float(cap.train_loss_bpb)} if cap.train_loss_bpb else {}),
                    **({"held": float(cap.heldout_bpb)} if cap.heldout_bpb else {})},
            "ts": float(record.timestamp), "ttl": float(record.ttl),
            **({"agreed": list(record.agreed)} if record.agreed is not None else {}),
            **({"backups": _flat_claims(record.backups)} if record.backups else {}),
            **({"worked": [v for pair in record.worked for v in pair]} if record.worked else {})}


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

"""Stage records: which peer serves which stage of which model, with what capacity.

A model's layers are cut into stages (``model.catalog``); a peer serves one stage and announces
it under the stage's DHT key. This module holds the record dataclasses, their field limits and
flags, the DHT key (``stage_key``), the routing order (``best_first``) and the one check of a
record's fields (``record_problem``). The signed wire bytes are made and judged in
``dht.record_codec``.

Field rules ``record_problem`` enforces beyond the limits below:

* ``run`` is the identity of the run the peer trains (``p2pswarm.run.spec``): 16 lowercase hex
  characters. It is part of the record's DHT key (``stage_key``), so peers of different runs never
  find each other's records, and a reader drops a record whose run is not the one it asked for.
* ``agreed`` (optional) is ``(round, digest)``: the sha256 of our stage's agreed backup bytes
  (``heal.backups``) at that outer round. ``backups`` (optional) holds at most MAX_BACKUP_CLAIMS
  claims to the other stages' backups we hold. A claim's stage is never the record's own stage
  and no stage is claimed twice.
* ``worked`` (optional) holds at most MAX_WORK_CLAIMS ``(peer id, stage)`` pairs: peers the record's
  author saw do work for that stage first-hand (``dht.work``), none twice, never the author itself.
* ``timestamp`` and ``ttl`` are numbers (never booleans) within their bounds.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass

from p2pswarm.errors import LocalProtocolError

STAGE_KEY_DOMAIN = b"p2pswarm/stage/"  # so stage keys can't collide with other DHT key kinds

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
MAX_OUTER_ROUND = 2**63 - 1  # outer rounds count up for a whole run: any u63 is fine
MAX_THROUGHPUT = 1e12  # tokens/s; far beyond any peer, keeps the value a sane finite float
MAX_LOSS_BPB = 1000.0  # bits per byte; a byte model at chance scores 8, a diverged one far more (shown only)
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
MAX_SHOWN_CHARS = 80  # error messages quote at most this much of a peer-chosen value

FLAG_RELAYED = 1  # reachable only through a circuit relay: slower, prefer others
FLAG_TRAINING = 2  # accepts backward passes, not only forward (inference) requests
FLAG_DRAINING = 4  # shutting down: finish current work, send no new work
FLAG_GPU = 8  # serves its layers from an accelerator rather than the CPU
FLAG_SNAPSHOT = 16  # serves hot snapshots of its stage (/p2pswarm/snapshot/1.0.0): a joiner loads from it
FLAG_PINNED = 32  # never moves to another stage (rebalancing leaves it where its operator put it)
MAX_BACKUP_CLAIMS = 8  # backups one record announces; a peer holds a couple (BACKUP_COPIES per stage)
DIGEST_BYTES = 32  # a backup digest is a sha256
MAX_WORK_CLAIMS = 8  # peers one record attests it saw work (``dht.work.MAX_ATTESTED``)



@dataclass(frozen=True)
class Capacity:
    """How much more work a peer can take right now."""

    free_memory_mb: int  # >= 0
    queue_depth: int  # >= 0, requests waiting
    flags: int = 0  # FLAG_* bitfield, 0 <= flags < FLAGS_LIMIT
    throughput: float = 0.0  # tokens/s recently processed, 0 when unknown (optional on the wire)
    outer_round: int = 0  # DiLoCo outer rounds completed by this replica (optional on the wire, "round")
    train_loss_bpb: float = 0.0  # a last stage's training loss, bits per byte; 0: none (optional, "loss")
    heldout_bpb: float = 0.0  # a last stage's latest held-out loss, bits per byte; 0: none (optional, "held")


@dataclass(frozen=True)
class BackupClaim:
    """A record's claim to hold stage ``stage``'s agreed backup of outer round ``round``, whose bytes
    hash to ``digest``."""

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
    worked: tuple[tuple[str, int], ...] = ()  # (peer id, stage) of peers we saw work first-hand (dht.work)

    @property
    def expires_at(self) -> float:
        return self.timestamp + self.ttl

    def serves(self, layer: int) -> bool:
        return self.start <= layer < self.end

    def is_fresh(self, now: float) -> bool:
        """Not yet expired; a timestamp too far ahead is refused by stores and readers (``MAX_CLOCK_SKEW``)."""
        return now < self.expires_at


def stage_key(model: str, stage: int, run: str = UNNAMED_RUN) -> bytes:
    """The DHT key under which the records of peers serving ``stage`` of ``model`` in run ``run`` live:
    another run's peers store and look up under other keys."""
    if not _is_model(model) or not _is_int(stage, 0, MAX_STAGES - 1) or not is_run(run):
        raise LocalProtocolError(f"no stage key for run {shown(run)} model {shown(model)} stage {shown(stage)}")
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
            tuple((c.stage, c.round, c.digest) for c in record.backups), record.worked)


def best_first(records: Iterable[StageRecord]) -> list[StageRecord]:
    """Directly reachable peers before relayed ones, then shortest queue, most free memory, highest
    throughput, newest, and by peer id; every claim bounded to its PLAUSIBLE_* value. Standing and
    diversity come on top of this (``dht.ranking``)."""
    return sorted(records, key=routing_rank)


def newest_per_peer(records: Iterable[StageRecord]) -> dict[str, StageRecord]:
    """Each peer's newest record among ``records`` (a peer that moved is fresh in two stages for a while)."""
    newest: dict[str, StageRecord] = {}
    for record in records:
        held = newest.get(record.peer_id)
        if held is None or record.timestamp > held.timestamp:
            newest[record.peer_id] = record
    return newest


def record_problem(record: StageRecord) -> str | None:
    """What is wrong with the record's fields, or None; the peer id's key is checked elsewhere."""
    peer_id, addrs, capacity = record.peer_id, record.addrs, record.capacity
    if type(peer_id) is not str or not 0 < len(peer_id) <= MAX_PEER_ID_CHARS:
        return f"peer id {shown(peer_id)} is not a string of 1 to {MAX_PEER_ID_CHARS} chars"
    if type(addrs) is not tuple or len(addrs) > MAX_ADDRS:
        return f"addrs must be a tuple of at most {MAX_ADDRS} multiaddrs"
    if not all(_is_addr(addr) for addr in addrs):
        return f"addrs hold a value that is not a multiaddr of 1 to {MAX_ADDR_CHARS} ASCII chars"
    if not is_run(record.run):
        return f"run {shown(record.run)} is not {RUN_CHARS} lowercase hex chars"
    if not _is_model(record.model):
        return f"model {shown(record.model)} is not 1 to {MAX_MODEL_CHARS} printable chars"
    if not _is_int(record.stage, 0, MAX_STAGES - 1):
        return f"stage {shown(record.stage)} is not an integer within [0, {MAX_STAGES})"
    if not (_is_int(record.start, 0, MAX_LAYERS - 1) and _is_int(record.end, 1, MAX_LAYERS)):
        layers = f"[{shown(record.start)}, {shown(record.end)})"
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
        and _is_number(capacity.train_loss_bpb, 0, MAX_LOSS_BPB)
        and _is_number(capacity.heldout_bpb, 0, MAX_LOSS_BPB)
    ):
        return f"capacity {shown(capacity)} is out of bounds"
    if not _is_number(record.timestamp, 0, MAX_TIMESTAMP):
        return f"timestamp {shown(record.timestamp)} is not a number within [0, {MAX_TIMESTAMP}]"
    if not _is_number(record.ttl, MIN_TTL, MAX_TTL):
        return f"ttl {shown(record.ttl)} is not a number within [{MIN_TTL}, {MAX_TTL}]"
    return _backup_problem(record)


def _backup_problem(record: StageRecord) -> str | None:
    """What is wrong with the record's ``agreed`` and ``backups`` fields, or None."""
    agreed, claims = record.agreed, record.backups
    if agreed is not None and not (type(agreed) is tuple and len(agreed) == 2
                                   and _is_int(agreed[0], 0, MAX_OUTER_ROUND) and _is_digest(agreed[1])):
        return f"agreed {shown(agreed)} is not (round, {DIGEST_BYTES}-byte digest)"
    if type(claims) is not tuple or len(claims) > MAX_BACKUP_CLAIMS:
        return f"backups must be a tuple of at most {MAX_BACKUP_CLAIMS} claims"
    for claim in claims:
        if not (type(claim) is BackupClaim and _is_int(claim.stage, 0, MAX_STAGES - 1)
                and _is_int(claim.round, 0, MAX_OUTER_ROUND) and _is_digest(claim.digest)):
            return f"backup claim {shown(claim)} is out of bounds"
        if claim.stage == record.stage:
            return f"backup claim for the record's own stage {record.stage}"
    if len({claim.stage for claim in claims}) != len(claims):
        return "backup claims name a stage twice"
    return _work_problem(record)


def _work_problem(record: StageRecord) -> str | None:
    """What is wrong with the record's ``worked`` attestations, or None."""
    worked = record.worked
    if type(worked) is not tuple or len(worked) > MAX_WORK_CLAIMS:
        return f"worked must be a tuple of at most {MAX_WORK_CLAIMS} (peer, stage) pairs"
    for pair in worked:
        if not (type(pair) is tuple and len(pair) == 2 and type(pair[0]) is str
                and 0 < len(pair[0]) <= MAX_PEER_ID_CHARS and _is_int(pair[1], 0, MAX_STAGES - 1)):
            return f"worked pair {shown(pair)} is not (peer id, stage)"
    if len({peer for peer, _ in worked}) != len(worked) or any(peer == record.peer_id for peer, _ in worked):
        return "worked names a peer twice, or the record's own peer"
    return None


def _is_digest(value: object) -> bool:
    return type(value) is bytes and len(value) == DIGEST_BYTES


def shown(value: object) -> str:
    """``repr(value)``, cut short: error messages quote values a hostile peer chose."""
    text = repr(value)
    return text if len(text) <= MAX_SHOWN_CHARS else text[:MAX_SHOWN_CHARS] + "..."


def _is_int(value: object, low: int, high: int) -> bool:
    return type(value) is int and low <= value <= high  # type() so a bool is not an int


def _is_number(value: object, low: float, high: float) -> bool:
    return (type(value) is int or type(value) is float) and low <= value <= high  # NaN fails every comparison


def _is_addr(addr: object) -> bool:
    """A plausible multiaddr; parsing it fully is the dialler's job, not the verifier's."""
    return (type(addr) is str and 0 < len(addr) <= MAX_ADDR_CHARS and addr.startswith("/")
            and addr.isascii() and addr.isprintable() and " " not in addr)


def _is_model(model: object) -> bool:
    return type(model) is str and 0 < len(model) <= MAX_MODEL_CHARS and model.isprintable()

"""The stage-record protocol: store a signed record on a peer, fetch the records it holds.

py-libp2p's Kademlia gives us closest-peer lookups but cannot hold "which peers serve stage s"
(write-once plain keys, 20 sticky providers, no expiry; see docs/architecture.md). So each
stage key maps to a dictionary of signed entries, one per serving peer, kept by the peers
closest to the key. These two messages travel over the control channel.

A peer stores only its own record: the store request must come over a connection
authenticated (Noise) as the peer the record names. So one connection cannot fill a key with
records of identities it made up, and every entry's author has at least talked to its keeper.

The handlers are plain functions of (store, message, now, sender): the driver supplies the
clock and the authenticated sender.
"""

from __future__ import annotations

from p2pswarm import wire
from p2pswarm.dht.record_codec import verify_record
from p2pswarm.dht.records import UNNAMED_RUN, stage_key
from p2pswarm.dht.store import LOCAL_SOURCE, RecordStore, StoredRecord
from p2pswarm.errors import LocalProtocolError, RemoteProtocolError

MAX_FETCH_RECORDS = 32  # a reader wants the best few; routing needs K=3..8 candidates per stage
FETCH_REPLY_BUDGET = 12 * 1024  # bytes of records in one reply, well inside wire.MAX_HEADER_BYTES


@wire.message("stage.store")
class StoreRecord(wire.Message):
    """Ask a peer to keep our ``record`` (signed bytes) under the key of its (run, model, stage)."""

    record: bytes


@wire.message("stage.stored")
class StoreReply(wire.Message):
    accepted: bool
    reason: str


@wire.message("stage.fetch")
class FetchRecords(wire.Message):
    """Ask a peer for the fresh records it holds for (model, stage) of run ``run``, best first."""

    model: str
    stage: int
    limit: int
    run: str = UNNAMED_RUN  # the run identity (p2pswarm.run.spec): each run's records live under their own key

    def check(self, payload_len: int) -> None:
        if self.limit < 0:
            raise RemoteProtocolError("stage.fetch: negative limit")
        try:
            stage_key(self.model, self.stage, self.run)  # the same run, model-name and stage rules as records
        except LocalProtocolError as exc:
            raise RemoteProtocolError(f"stage.fetch: {exc}") from None


@wire.message("stage.records")
class FetchReply(wire.Message):
    records: tuple[bytes, ...]


def handle_store(store: RecordStore, message: StoreRecord, now: float, sender: str,
                 sender_ip: str = LOCAL_SOURCE) -> StoreReply:
    """Verify the signature and that ``sender`` (authenticated) is the record's peer, then keep it."""
    record = verify_record(message.record)  # RemoteProtocolError for forged or garbled records
    if record.peer_id != sender:
        raise RemoteProtocolError(f"record of peer {record.peer_id} sent by {sender}: a peer stores only its own")
    key = stage_key(record.model, record.stage, record.run)
    if store.put(key, StoredRecord(record, message.record, sender_ip), now):
        return StoreReply(accepted=True, reason="")
    return StoreReply(accepted=False, reason="expired, from the future, older than held, or over a store limit")


def handle_fetch(store: RecordStore, message: FetchRecords, now: float) -> FetchReply:
    """The fresh records held for the stage, best first, within the reply budget."""
    chosen: list[bytes] = []
    used = 0
    for stored in store.get(stage_key(message.model, message.stage, message.run), now):
        if len(chosen) >= min(message.limit, MAX_FETCH_RECORDS) or used + len(stored.raw) > FETCH_REPLY_BUDGET:
            break
        chosen.append(stored.raw)
        used += len(stored.raw)
    return FetchReply(records=tuple(chosen))

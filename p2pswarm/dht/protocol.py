"""The layer-record protocol: store a signed record on a peer, fetch the records it holds.

py-libp2p's Kademlia gives us closest-peer lookups but cannot hold "which peers serve layer L"
(write-once plain keys, 20 sticky providers, no expiry; see docs/architecture.md). So each
layer key maps to a dictionary of signed entries, one per serving peer, kept by the peers
closest to the key. These two messages travel over the control channel.

The handlers are plain functions of (store, message, now): the driver supplies the clock.
"""

from __future__ import annotations

from p2pswarm import wire
from p2pswarm.dht.records import layer_key, verify_record
from p2pswarm.dht.store import RecordStore, StoredRecord
from p2pswarm.errors import LocalProtocolError, RemoteProtocolError

MAX_FETCH_RECORDS = 32  # a reader wants the best few; routing needs K=3..8 candidates per layer
FETCH_REPLY_BUDGET = 12 * 1024  # bytes of records in one reply, well inside wire.MAX_HEADER_BYTES


@wire.message("layer.store")
class StoreRecord(wire.Message):
    """Ask a peer to keep ``record`` (signed bytes) under the key of ``layer``."""

    layer: int
    record: bytes


@wire.message("layer.stored")
class StoreReply(wire.Message):
    accepted: bool
    reason: str


@wire.message("layer.fetch")
class FetchRecords(wire.Message):
    """Ask a peer for the fresh records it holds for (model, layer), best first."""

    model: str
    layer: int
    limit: int

    def check(self, payload_len: int) -> None:
        if self.limit < 0:
            raise RemoteProtocolError("layer.fetch: negative limit")
        try:
            layer_key(self.model, self.layer)  # the same model-name and layer rules as records
        except LocalProtocolError as exc:
            raise RemoteProtocolError(f"layer.fetch: {exc}") from None


@wire.message("layer.records")
class FetchReply(wire.Message):
    records: tuple[bytes, ...]


def handle_store(store: RecordStore, message: StoreRecord, now: float) -> StoreReply:
    """Verify the signature and that the record serves the layer, then keep it."""
    record = verify_record(message.record)  # RemoteProtocolError for forged or garbled records
    if not record.serves(message.layer):
        raise RemoteProtocolError(f"record serves [{record.start}, {record.end}), not layer {message.layer}")
    key = layer_key(record.model, message.layer)
    if store.put(key, StoredRecord(record, message.record), now):
        return StoreReply(accepted=True, reason="")
    return StoreReply(accepted=False, reason="expired, from the future, older than held, or store full")


def handle_fetch(store: RecordStore, message: FetchRecords, now: float) -> FetchReply:
    """The fresh records held for the layer, best first, within the reply budget."""
    chosen: list[bytes] = []
    used = 0
    for stored in store.get(layer_key(message.model, message.layer), now):
        if len(chosen) >= min(message.limit, MAX_FETCH_RECORDS) or used + len(stored.raw) > FETCH_REPLY_BUDGET:
            break
        chosen.append(stored.raw)
        used += len(stored.raw)
    return FetchReply(records=tuple(chosen))

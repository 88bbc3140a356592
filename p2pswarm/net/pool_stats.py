"""The stream pool's counters (``net/pool.py``, ``net/pool_inbound.py``), as ``/api/stats`` shows them under
``pool``: streams, frames, refusals, and payload bytes sent and received by protocol (``/metrics`` labels them)."""

from __future__ import annotations

from dataclasses import dataclass, field


def stream_protocol(stream: object) -> str:
    """The protocol a (pooled or raw) libp2p stream speaks, or "unknown"."""
    raw = getattr(stream, "_stream", stream)
    try:
        protocol = raw.get_protocol()  # type: ignore[attr-defined]
    except Exception:  # a stream that cannot say (a test's fake, a closed one)
        protocol = None
    return str(protocol) if protocol else "unknown"


@dataclass
class PoolStats:
    opened: int = 0  # streams opened by leases and warm()
    reused: int = 0  # leases served by an idle stream
    reset: int = 0  # streams retired after an error or a cut frame
    moved_to_direct: int = 0  # relayed streams retired because a direct connection exists
    circuit_refusals: int = 0  # frames refused before their first byte: the circuit could not carry them
    circuits_recycled: int = 0  # exhausted relayed connections closed once idle (the next lease re-dials)
    frames_sent: int = 0
    payload_bytes_sent: int = 0  # payload bytes of every frame written (requests and replies): what a peer sends
    frames_received: int = 0  # replies read by lessees
    frames_served: int = 0  # inbound frames handled
    inbound_refused: int = 0  # inbound streams reset: no budget slot, garbage, budget timeout, stall
    handler_failures: int = 0
    payload_bytes: dict[str, dict[str, int]] = field(default_factory=dict)  # protocol -> {"sent", "received"}

    def count(self, stream: object, *, sent: int = 0, received: int = 0) -> None:
        """Payload bytes of one frame on ``stream``, under its protocol."""
        by = self.payload_bytes.setdefault(stream_protocol(stream), {"sent": 0, "received": 0})
        by["sent"] += sent
        by["received"] += received

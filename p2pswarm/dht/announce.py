"""What our stage record says: which addresses, which capacity flags. Pure policy, no I/O.

The node gathers the facts (listen and advertised addresses, reachability, load) and this
module decides what to publish, so the rules can be tested on their own.
"""

from __future__ import annotations

from p2pswarm.dht.records import FLAG_RELAYED, FLAG_TRAINING, UNNAMED_RUN, BackupClaim, Capacity, StageRecord
from p2pswarm.model.catalog import ModelSpec

MAX_RECORD_ADDRS = 8  # addresses in a stage record; well inside the record's size limit


def record_addrs(addrs: list[str], limit: int = MAX_RECORD_ADDRS, public: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The addresses a stage record carries: those dial-backs confirmed first, then relay
    circuits, since a NATed peer's own listen addresses (listed first by the host) are the ones
    nobody outside can dial."""
    def rank(addr: str) -> int:
        return 0 if addr.split("/p2p/")[0] in public else 1 if "/p2p-circuit" in addr else 2

    return tuple(sorted(addrs, key=rank)[:limit])


def capacity_flags(*, training: bool, private: bool) -> int:
    """FLAG_TRAINING for a peer that takes backward passes; FLAG_RELAYED for one that others can
    reach only through a relay until a hole punch succeeds (routers try it last)."""
    return (FLAG_TRAINING if training else 0) | (FLAG_RELAYED if private else 0)


def stage_record(peer_id: str, addrs: list[str], public: tuple[str, ...], model: ModelSpec, stage: int,
                 capacity: Capacity, now: float, ttl: float, run: str = UNNAMED_RUN,
                 agreed: tuple[int, bytes] | None = None, backups: tuple[BackupClaim, ...] = (),
                 worked: tuple[tuple[str, int], ...] = ()) -> StageRecord:
    """Our record for ``stage`` of ``model`` in run ``run``: its exact layer range, our best addresses first,
    the (round, digest) of our stage's agreed backup and the other stages' backups we hold (a held copy of
    ``stage`` itself is left out: right after a move into a stage we may still hold its backup) and the peers
    we saw work (``dht.work``; never ourselves)."""
    start, end = model.stage_range(stage)
    return StageRecord(peer_id=peer_id, addrs=record_addrs(addrs, public=public), model=model.name, stage=stage,
                       start=start, end=end, capacity=capacity, timestamp=now, ttl=ttl, run=run,
                       agreed=agreed, backups=tuple(claim for claim in backups if claim.stage != stage),
                       worked=tuple(pair for pair in worked if pair[0] != peer_id))

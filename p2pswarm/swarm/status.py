"""``GET /api/swarm``: what a training peer shows of its stage (``SwarmService.doc``).

The keys are an interface: ``p2pswarm status`` (``cli``), the benches and the tests read them.
"""

from __future__ import annotations

import time

import trio

from p2pswarm.dht.records import MAX_LOSS_BPB
from p2pswarm.swarm.evaluation import agreement


def swarm_doc(svc) -> dict:
    """The document of ``svc`` (a ``SwarmService``), running or not."""
    now = trio.current_time()
    engine, ledger = svc.engine, svc.ledger.stats(now)
    latest = svc.evals.latest()
    return {
        "stage": svc.stage, "first": svc.is_first, "last": svc.is_last, "blocked": svc.blocked,
        "step": engine.step if engine else 0, "tokens": engine.tokens if engine else 0,
        "micro_batches": engine.micro_batches if engine else 0,
        "tokens_per_s": round(svc.throughput(), 1),
        "train_loss_bpb": svc.train_loss_bpb,
        "heldout_bpb": latest.bits_per_byte if latest else None,
        "heldout": _heldout(svc.evals.history),
        "heldout_by_round": [{"outer_round": a.round, "bpb": round(a.bits_per_byte, 4),
                              "spread": round(a.spread, 4), "chains": len(a.chains)}
                             for a in agreement(svc.evals.history)],  # the chains this last stage saw
        "engine": {"steps": ledger.steps, "local_only": ledger.local_only, "drops": ledger.drops,
                   "local_only_rate": ledger.local_only_rate, "busy_fraction": round(ledger.busy_fraction, 4),
                   "busy_since_first": round(ledger.busy_since_first, 4),
                   "kept_graphs": engine.kept if engine else 0},
        "in_flight": len(svc.inflight), "counts": {str(k): n for k, n in svc.counts.items()},
        "inbound": _fill_doc(svc.inbound.stats(now)), "outbound": _fill_doc(svc.outbound.stats(now)),
        "router": router_doc(svc),
        "delivery": svc.deliverer.stats() if svc.deliverer else {},
        "inference": svc.inference.doc() if svc.inference else {},
    }


def reported_losses(svc) -> tuple[float, float]:
    """(train, held-out) loss in bits per byte as our stage record reports them (``dht.records.Capacity``):
    a last stage's, rounded; 0.0 for none, or for one outside the record's bounds."""
    latest = svc.evals.latest()
    values = (svc.train_loss_bpb, latest.bits_per_byte if latest else None)
    return tuple(round(v, 4) if v is not None and 0 < v <= MAX_LOSS_BPB else 0.0 for v in values)  # type: ignore[return-value]


def _heldout(history) -> list[dict]:
    """The held-out rounds; ``source``: the stage-0 peer's evaluation session."""
    return [{"source": r.session.hex()[:8], "round": r.round, "bpb": round(r.bits_per_byte, 4),
             "tokens": r.tokens, "at": r.at, "outer_round": r.agreed_round,
             "rounds": None if r.rounds is None else list(r.rounds),
             "chain": None if r.chain is None else list(r.chain), "complete": r.complete}
            for r in history]


def router_doc(svc) -> dict:
    """The router's view of the next stage, with each peer's slowness and our partner."""
    doc = svc.router.stats(time.time())
    for peer, entry in doc["peers"].items():
        entry["slow"] = svc.upkeep.slow.get(peer)
    doc["partner"] = svc.router.partners.get(svc.stage + 1)  # None: last stage, affinity off, or no peer
    return doc


def _fill_doc(stats) -> dict:
    return {"items": stats.items, "capacity": stats.capacity_items, "peak": stats.peak_items,
            "mean_fill": round(stats.mean_fill, 4), "offered": stats.offered, "refused": stats.refused}

"""What ``GET /api/diloco`` shows of a replica, and the record of one finished outer round: pure functions.

``service.DilocoService.doc`` gathers its own counters and the loader's, and ``round_record`` is
the entry each finished round leaves in its history (``rounds`` in the doc). No trio, no I/O: the
times are passed in.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from p2pswarm.diloco.aggregation import judged  # (torch: the service that reports rounds has it)


@dataclass(frozen=True)
class RoundTimes:
    """The moments of one round (seconds, one clock): readiness, the group's agreement plus the
    pseudo-gradient's taking (``agreed_s``, ``take_s``: durations), the end of the exchange, of
    the assembly, and of the outer step (``now``)."""

    started: float
    agreed_s: float
    take_s: float
    finished: float
    assembled: float
    now: float


def round_record(round_: int, members, times: RoundTimes, sent: int, received: int, done, *, step: int,
                 tokens: int) -> dict:
    """The history entry of a finished round: its group, time, bytes (this round's), what it missed
    or refused, the norms (``done``: ``offload.Assembled``), and where our training stood at its end."""
    t = times
    return {
        "round": round_, "members": list(members), "seconds": round(t.now - t.started, 2),
        "judged": judged(len(members)),  # False: a round of 2 checked norms only, not directions
        "bytes_sent": sent, "bytes_received": received,
        "missing_shards": done.missing, "refused_results": list(done.refused),
        "pseudo_gradient_norm": round(done.pseudo_norm, 4),
        "update_norm": round(done.update_norm, 4), "at_step": step,
        "tokens": tokens,  # ours, trained into our weights by the end of the round
        "phases_s": {"gather_agree": round(t.agreed_s, 3), "take_pseudo_gradient": round(t.take_s, 3),
                     "exchange": round(t.finished - t.started - t.agreed_s - t.take_s, 3),
                     "assemble": round(t.assembled - t.finished, 3), "outer_step": round(t.now - t.assembled, 3)}}


def diloco_doc(service, *, step: int, compute_s: float) -> dict:
    """``GET /api/diloco`` of ``service`` (a ``service.DilocoService``: its counters, its open round,
    its outer optimizer, None before ``prepare``, and its ``loader``'s snapshots and agreed backup);
    ``step``: the engine's inner step, ``compute_s``: the seconds its engine computed."""
    outer, settings, history, loader = service.outer, service.settings, service.history, service.loader
    phase, agreed = service.round.phase if service.round else None, loader.agreed_backup
    return {
        "stage": service.stage, "inner_step": step, "outer_round": outer.rounds if outer else 0,
        "inner_steps_this_round": outer.inner_steps_done(step) if outer else 0,
        "inner_steps_per_round": outer.config.round_steps if outer else settings.inner_steps,  # H / F
        "fragment": list(outer.fragment()) if outer else None,  # the elements the current round synchronises
        "settings": dataclasses.asdict(settings),
        "phase": phase.name.lower() if phase else "training",
        "last_round": history[-1] if history else None, "rounds": list(history),
        "bytes_sent": service.bytes_sent, "bytes_received": service.bytes_received,
        "rejected_contributions": dict(service.penalties), "counts": dict(service.counts),
        "communicating_s": round(service.comm_s, 2), "computing_s": round(compute_s, 2),
        "loaded_from": service.loaded_from, "last_snapshot": loader.last_snapshot,
        "snapshots_served": {"requests": loader.server.requests, "bytes": loader.server.served},
        "agreed": {"round": agreed.round, "digest": agreed.digest.hex()} if agreed is not None else None,
    }

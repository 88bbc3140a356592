"""What the demo sees of a training swarm, and what it says at the end.

``Progress`` gathers each peer's ``/api/swarm`` and ``/api/diloco`` documents into the held-out
curve by outer round, tokens, failovers and outer rounds; ``print_summary`` prints the summary
and the verdict (did the held-out loss fall?) and writes ``--summary`` JSON.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from p2pswarm.demo.procs import Peer, get_json
from p2pswarm.swarm.evaluation import EvalRound, RoundAgreement, agreement

RECENT_ROUNDS = 3  # held-out rounds averaged for the verdict "it learned"


def latest_rounds(rounds: list[dict]) -> dict[str, tuple[int, float, float]]:
    """Per stage-0 replica (``source``), its highest evaluation round: (round, when, bits per byte).

    A round's micro-batches may be split between last-stage replicas, each reporting its part:
    the parts are combined, weighted by their bytes."""
    parts: dict[tuple[str, int], list[dict]] = {}
    for r in rounds:
        parts.setdefault((r["source"], r["round"]), []).append(r)
    latest: dict[str, tuple[int, float, float]] = {}
    for (source, round_), group in sorted(parts.items()):
        tokens = sum(r["tokens"] for r in group)
        latest[source] = (round_, max(r["at"] for r in group), sum(r["bpb"] * r["tokens"] for r in group) / tokens)
    return latest


def newest(seen: dict[str, tuple[int, float, float]],
           now: dict[str, tuple[int, float, float]]) -> dict[str, tuple[int, float, float]]:
    """Per stage-0 replica, the higher of two (round, when, bits per byte) evaluations. Once the last-stage
    replica that took a session's later rounds is gone, the survivors still report older rounds
    of it (often round 0, the untrained model): they must not replace a newer figure."""
    merged = dict(seen)
    for source, latest in now.items():
        if source not in merged or latest[0] >= merged[source][0]:
            merged[source] = latest
    return merged


@dataclass
class Progress:
    """What the demo saw: held-out rounds, tokens, failovers."""

    heldout: list[tuple[float, float]] = field(default_factory=list)  # (seconds into training, mean bpb)
    tokens: int = 0
    tokens_per_s: float = 0.0
    failovers: int = 0
    lost: int = 0
    duplicates: int = 0  # re-sent micro-batches a receiver dropped (never computed twice)
    timeouts: int = 0
    train_bpb: float | None = None
    busy: dict[int, float] = field(default_factory=dict)  # peer -> compute-busy fraction since its first micro-batch
    latest: dict[str, tuple[int, float, float]] = field(default_factory=dict)  # stage-0 replica -> (round, at, bpb)
    outer: dict[tuple[int, int], dict] = field(default_factory=dict)  # (stage, round) -> a member's account
    loads: dict[int, dict] = field(default_factory=dict)  # peer -> where it loaded its stage from
    evaluations: dict[tuple, EvalRound] = field(default_factory=dict)  # every evaluation seen, by who and what
    round_tokens: dict[tuple[int, int], int] = field(default_factory=dict)  # (stage-0 peer, outer round) -> its tokens
    shown: set[int] = field(default_factory=set)  # outer rounds whose held-out line was printed

    def curve(self) -> list[RoundAgreement]:
        """The held-out figure per outer round: every chain on that round's agreed weights (``agreement``)."""
        return agreement(list(self.evaluations.values()))

    def tokens_at(self, round_: int) -> int | None:
        """Tokens the stage-0 replicas had trained when outer ``round_`` was agreed (round 0: none): each
        replica's count when it finished that round, or (left out of it) the first round after; a
        replica with no round since counts its last. An upper bound: the comparison is never flattered."""
        if round_ == 0:
            return 0
        per_peer: dict[int, dict[int, int]] = {}
        for (peer, r), n in self.round_tokens.items():
            per_peer.setdefault(peer, {})[r] = n
        if not any(r >= round_ for rounds in per_peer.values() for r in rounds):
            return None
        return sum(rounds[min((r for r in rounds if r >= round_), default=max(rounds))]
                   for rounds in per_peer.values())

    def heldout_text(self) -> str:
        """The newest outer round's figure and spread; without outer rounds, the mean over stage-0
        replicas of their latest held-out round (live weights), and each one's."""
        curve = self.curve()
        if curve:
            last = curve[-1]
            return (f"{last.bits_per_byte:.3f} (round {last.round}, {len(last.chains)} chain(s), "
                    f"spread {last.spread:.3f})")
        if not self.heldout:
            return "  -  "
        each = ", ".join(f"{b:.2f}" for *_, b in sorted(self.latest.values(), key=lambda v: v[1]))
        return f"{self.heldout[-1][1]:.3f} ({each})" if len(self.latest) > 1 else f"{self.heldout[-1][1]:.3f}"

    def new_round_lines(self) -> list[str]:
        """A line for each outer round whose held-out figure came in since the last look (its chains
        may still grow: a round is shown once at least two chains, or every stage-0 replica, measured it)."""
        lines, curve = [], self.curve()
        for a in curve[:-1]:  # the newest may be missing chains yet
            if a.round in self.shown:
                continue
            self.shown.add(a.round)
            tokens = self.tokens_at(a.round)
            each = ", ".join(f"{b:.3f}" for b in a.chains.values())
            lines.append(f"demo: held-out after outer round {a.round}: {a.bits_per_byte:.3f} bits/byte "
                         f"({'?' if tokens is None else tokens} tokens; {len(a.chains)} chain(s): {each}; "
                         f"spread {a.spread:.3f})")
        return lines

    def remember(self, entries: list[dict]) -> None:
        """Keep every evaluation a last-stage peer reports (a killed one's stay, for the curve)."""
        for e in entries:
            rounds, chain = e.get("rounds"), e.get("chain")
            r = EvalRound(e["source"].encode(), e["round"], e["bpb"], e["tokens"], 1, e["at"],
                          rounds=None if rounds is None else tuple(rounds),
                          chain=None if chain is None else tuple(chain),
                          complete=e.get("complete", True))
            self.evaluations[(e["source"], e["round"], r.chain)] = r

    def look(self, peers: list[Peer], n_stages: int, since: float) -> dict:
        docs = {p.index: get_json(p.api, "/api/swarm") for p in peers if not p.killed}
        docs = {i: d for i, d in docs.items() if d}
        first = [d for d in docs.values() if d.get("first")]
        last = [d for d in docs.values() if d.get("last")]
        self.tokens = max(self.tokens, sum(d.get("tokens", 0) for d in first))
        self.tokens_per_s = sum(d.get("tokens_per_s", 0.0) for d in first)
        self.failovers = max(self.failovers, sum(d["delivery"].get("rerouted", 0) for d in docs.values()))
        self.lost = max(self.lost, sum(d["delivery"].get("lost", 0) for d in docs.values()))
        self.duplicates = max(self.duplicates, sum(d["counts"].get("duplicates_dropped", 0) for d in docs.values()))
        self.timeouts = max(self.timeouts, sum(d["delivery"].get("timeouts", 0) for d in docs.values()))
        self.busy.update({i: d["engine"].get("busy_since_first", d["engine"]["busy_fraction"])
                          for i, d in docs.items()})  # since its first micro-batch: forming is no idle compute
        losses = [d["train_loss_bpb"] for d in last if d.get("train_loss_bpb") is not None]
        self.train_bpb = sum(losses) / len(losses) if losses else self.train_bpb
        self.remember([r for d in last for r in d.get("heldout", [])])
        self.latest = newest(self.latest, latest_rounds([r for d in last for r in d.get("heldout", [])]))
        if self.latest:
            mean = sum(b for *_, b in self.latest.values()) / len(self.latest)
            if not self.heldout or mean != self.heldout[-1][1]:
                self.heldout.append((max(a for _, a, _ in self.latest.values()) - since, mean))
        return {s: sum(1 for d in docs.values() if d.get("stage") == s) for s in range(n_stages)}

    def outer_rounds(self, peers: list[Peer]) -> list[str]:
        """Lines for the outer rounds completed since the last look, one per stage and round."""
        lines = []
        for peer in peers:
            doc = {} if peer.killed else get_json(peer.api, "/api/diloco")
            if (doc.get("loaded_from") or {}).get("peer") and doc["loaded_from"] != self.loads.get(peer.index):
                self.loads[peer.index] = doc["loaded_from"]
                lines.append(_loaded_text(peer, doc["loaded_from"]))
            for r in doc.get("rounds", []):
                if doc.get("stage") == 0 and "tokens" in r:
                    self.round_tokens[(peer.index, r["round"] + 1)] = r["tokens"]  # round r agreed weights r + 1
                key = (doc["stage"], r["round"])
                if key not in self.outer:
                    self.outer[key] = r
                    lines.append(f"demo: outer round {r['round']} of stage {doc['stage']} done: "
                                 f"{len(r['members'])} replica(s), {r['seconds']:.1f} s, "
                                 f"{r['bytes_sent'] / 1e6:.2f} MB sent by one, |pseudo-gradient| "
                                 f"{r['pseudo_gradient_norm']:.3f}, rejected "
                                 f"{sum(doc.get('rejected_contributions', {}).values())}")
        return lines


def _loaded_text(peer: Peer, loaded: dict) -> str:
    """One line for a load; a rejoin through an agreed backup names no inner step (the backup has none)."""
    step = f", inner step {loaded['step']}" if loaded.get("step") is not None else " (its agreed backup)"
    return (f"demo: peer {peer.index} loaded stage {peer.stage} from {loaded['peer'][-8:]}: outer round "
            f"{loaded['round']}{step}, {loaded['bytes'] / 1e6:.1f} MB in {loaded['seconds']:.1f} s"
            + ("; its own progress kept (rebased)" if loaded.get("rebased") else ""))


def print_summary(progress: Progress, seconds: float, killed: bool, path: Path | None = None) -> int:
    print(f"demo: summary: {progress.tokens} tokens in {seconds:.0f} s ({progress.tokens / seconds:.0f} tok/s), "
          f"{progress.failovers} failovers, {progress.timeouts} timeouts, {progress.lost} micro-batches lost, "
          f"{progress.duplicates} duplicates dropped"
          f"{', one peer SIGKILLed and restarted' if killed else ''}, 0 crashed processes", flush=True)
    per_stage: dict[int, int] = {}
    for stage, _ in progress.outer:
        per_stage[stage] = per_stage.get(stage, 0) + 1
    completed = ', '.join(f'stage {s}: {n}' for s, n in sorted(per_stage.items())) or 'none'
    print(f"demo: outer rounds completed: {completed}", flush=True)
    busy = sorted(progress.busy.values())
    if busy:
        print(f"demo: compute-busy fraction per peer since its first micro-batch {', '.join(f'{b:.3f}' for b in busy)} "
              f"(mean {sum(busy) / len(busy):.3f})", flush=True)
    curve = [(progress.tokens_at(a.round), a) for a in progress.curve()]
    if path is not None:
        _write_summary(path, progress, seconds, curve)
    if curve:
        return round_verdict(curve)
    return _live_verdict(progress.heldout)


def round_verdict(curve: list[tuple[int | None, RoundAgreement]]) -> int:
    """The held-out figure of the agreed weights round after round: it learned if the last round is
    below the first (round 0: the untrained model, the same on every replica)."""
    print("demo: held-out by outer round (agreed weights, every chain): " + ", ".join(
        f"{a.round}: {a.bits_per_byte:.3f}" for _, a in curve), flush=True)
    spreads = [a.spread for _, a in curve if len(a.chains) > 1]
    if spreads:
        print(f"demo: spread between chains after a round: at most {max(spreads):.3f} bits/byte "
              f"over {len(spreads)} round(s) measured by 2 or more chains", flush=True)
    if len(curve) < 2:
        print("demo: too few outer rounds evaluated to tell whether the model learned", file=sys.stderr)
        return 1
    first, last = curve[0][1].bits_per_byte, curve[-1][1].bits_per_byte
    tokens = curve[-1][0]
    print(f"demo: held-out loss {first:.3f} -> {last:.3f} bits/byte at outer round {curve[-1][1].round}"
          f"{'' if tokens is None else f' after {tokens} tokens'} (8 = knowing nothing)", flush=True)
    return 0 if last < first else 1


def _live_verdict(heldout: list[tuple[float, float]]) -> int:
    """Without outer rounds (live weights): the mean of the last RECENT_ROUNDS rounds below the first."""
    if len(heldout) < 2:
        print("demo: too few held-out evaluations to tell whether the model learned", file=sys.stderr)
        return 1
    first, last = heldout[0][1], heldout[-1][1]
    best = min(b for _, b in heldout)
    recent = [b for _, b in heldout[-RECENT_ROUNDS:]]
    late = sum(recent) / len(recent)  # one round can spike: replicas differ until DiLoCo averages them
    print(f"demo: held-out loss {first:.3f} -> {last:.3f} bits/byte (mean of the last {len(recent)} rounds "
          f"{late:.3f}, best {best:.3f}; 8 = knowing nothing)", flush=True)
    return 0 if late < first else 1


def _write_summary(path: Path, progress: Progress, seconds: float,
                   curve: list[tuple[int | None, RoundAgreement]]) -> None:
    """The run as JSON (--summary), for benches: tokens, rates, the held-out curve by outer round."""
    doc = {"tokens": progress.tokens, "seconds": round(seconds, 1), "tokens_per_s": progress.tokens / seconds,
           "failovers": progress.failovers, "lost": progress.lost, "timeouts": progress.timeouts,
           "busy": sorted(progress.busy.values()),
           "outer_rounds": sorted(f"{s}:{r}" for s, r in progress.outer),
           "curve": [{"round": a.round, "tokens": tokens, "bpb": a.bits_per_byte, "spread": a.spread,
                      "chains": len(a.chains)} for tokens, a in curve],
           "live": [{"at": at, "bpb": bpb} for at, bpb in progress.heldout],
           "sources": sorted({source for source, _, _ in progress.evaluations})}  # stage-0 replicas evaluated
    Path(path).write_text(json.dumps(doc, indent=1))

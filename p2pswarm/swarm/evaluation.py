"""Held-out loss as the last stage sees it: evaluation rounds gathered from their micro-batches.

Every stage-0 peer periodically sends the fixed held-out set (``corpus.heldout_batches``, the same
bytes on every peer) through the swarm as a round of inference-priority micro-batches: ``step``
is the round's number, the session is the sender's. Only the last stage computes a loss, so it
is the last stage that adds each micro-batch's summed loss into its round and publishes the
latest complete round in bits per byte (and bits per token: the same with the byte tokenizer;
with another, ``bits_per_byte`` divides by the bytes of text the target tokens stand for). A round
is complete when ``expected`` micro-batches arrived, or when a later round of the same session
starts (a round cut short by a lost micro-batch still counts, over the bytes that arrived). A
straggler of a round already closed (late or duplicated) is ignored.

With DiLoCo, a round evaluates the *agreed* weights of one outer round at every stage (the same
bit-equal weights on every replica of a stage), and its micro-batches say which round each stage
used and through which peers they went (``rounds``, ``chain``). ``agreement`` groups completed
rounds by the outer round every stage used: per outer round, one figure per chain and their
spread, which is 0 when the replicas agree.

Pure: no trio, no torch; ``now`` is seconds. Bounded: at most ``MAX_OPEN_ROUNDS`` open rounds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from p2pswarm.run.spec import DEFAULT_EVAL_BATCHES
from p2pswarm.swarm.activation import NO_ROUND

EVAL_BATCHES = DEFAULT_EVAL_BATCHES  # micro-batches per round (a run's [batch] eval_batches): 32 KiB of text
EVAL_ROWS = 32  # rows per evaluation micro-batch
MAX_OPEN_ROUNDS = 64  # rounds being gathered at once (a few per stage-0 peer)
HISTORY = 256  # completed rounds kept for /api/swarm and the demo's curve


@dataclass(frozen=True)
class EvalRound:
    """One completed evaluation round: the held-out loss of one stage-0 peer's weights at a time."""

    session: bytes
    round: int
    bits_per_byte: float  # over the bytes of text the targets stand for
    tokens: int
    batches: int
    at: float  # when it completed
    bits_per_token: float | None = None  # None: as bits_per_byte (tokens are bytes)
    bytes: int | None = None  # None: as tokens
    rounds: tuple[int, ...] | None = ()  # the outer round each stage evaluated; None: its micro-batches disagreed
    chain: tuple[str, ...] | None = ()  # the peers that computed it, stage by stage; None: more than one chain
    complete: bool = True  # every micro-batch of the round arrived (else it was cut short: another figure)

    @property
    def agreed_round(self) -> int | None:
        """The outer round every stage evaluated, when they all evaluated the same one; else None."""
        if not self.rounds or len(set(self.rounds)) != 1 or self.rounds[0] == NO_ROUND:
            return None
        return self.rounds[0]


@dataclass
class _Open:
    nats: float = 0.0
    tokens: int = 0
    bytes: int = 0
    batches: int = 0
    rounds: tuple[int, ...] | None = None  # None: not seen yet; MIXED: the micro-batches disagreed
    chain: tuple[str, ...] | None = None

    def note(self, rounds: tuple[int, ...], chain: tuple[str, ...]) -> None:
        """One micro-batch's rounds and chain: kept while every micro-batch of the round agrees."""
        first = self.batches == 0
        self.rounds = rounds if first else (self.rounds if self.rounds == rounds else MIXED)
        self.chain = chain if first else (self.chain if self.chain == chain else MIXED)


MIXED = None  # a round's micro-batches came through different chains, or on different outer rounds


class EvalBook:
    """Gathers evaluation micro-batches into rounds (module docstring)."""

    def __init__(self, expected: int = EVAL_BATCHES) -> None:
        if expected < 1:
            raise ValueError(f"an evaluation round has at least one micro-batch, not {expected}")
        self.expected = expected
        self._open: dict[tuple[bytes, int], _Open] = {}
        self._closed: dict[bytes, int] = {}  # session -> its latest closed round: stragglers are ignored
        self.history: list[EvalRound] = []

    def record(self, session: bytes, round_: int, nats_sum: float, tokens: int, now: float,
               nbytes: int | None = None, rounds: tuple[int, ...] = (),
               chain: tuple[str, ...] = ()) -> EvalRound | None:
        """Add one micro-batch's summed loss (nats over ``tokens`` targets that stand for ``nbytes`` bytes
        of text; None: the tokens are bytes), computed on outer ``rounds`` by the peers of ``chain``;
        the round it completed, if any."""
        if tokens <= 0 or not math.isfinite(nats_sum) or round_ <= self._closed.get(session, -1):
            return None
        done = None
        for key in [k for k in self._open if k[0] == session and k[1] < round_]:
            done = self._close(key, now) or done  # a later round started: the earlier one is over
        key = (session, round_)
        if key not in self._open:
            if len(self._open) >= MAX_OPEN_ROUNDS:
                self._close(min(self._open, key=lambda k: k[1]), now)
            self._open[key] = _Open()
        entry = self._open[key]
        entry.note(rounds, chain)
        entry.nats += nats_sum
        entry.tokens += tokens
        entry.bytes += tokens if nbytes is None else nbytes
        entry.batches += 1
        if entry.batches >= self.expected:
            done = self._close(key, now)
        return done

    def _close(self, key: tuple[bytes, int], now: float) -> EvalRound | None:
        entry = self._open.pop(key)
        self._closed[key[0]] = max(key[1], self._closed.get(key[0], -1))
        if len(self._closed) > MAX_OPEN_ROUNDS * 4:  # bounded: forget the sessions closed longest ago
            del self._closed[next(iter(self._closed))]
        if entry.tokens <= 0 or entry.bytes <= 0:
            return None
        per_token = entry.nats / entry.tokens / math.log(2)
        if entry.bytes == entry.tokens:  # byte tokens: one figure, the record as it always was
            done = EvalRound(key[0], key[1], per_token, entry.tokens, entry.batches, now,
                             rounds=entry.rounds, chain=entry.chain, complete=entry.batches >= self.expected)
        else:
            done = EvalRound(key[0], key[1], entry.nats / entry.bytes / math.log(2), entry.tokens, entry.batches,
                             now, per_token, entry.bytes, rounds=entry.rounds, chain=entry.chain,
                             complete=entry.batches >= self.expected)
        self.history.append(done)
        del self.history[:-HISTORY]
        return done

    def latest(self) -> EvalRound | None:
        return self.history[-1] if self.history else None

    def best(self) -> EvalRound | None:
        return min(self.history, key=lambda r: r.bits_per_byte) if self.history else None


@dataclass(frozen=True)
class RoundAgreement:
    """The held-out figure of one outer round: every chain that evaluated that round's agreed weights
    at every stage, and how far apart they are (0 when the replicas hold bit-equal weights)."""

    round: int
    chains: dict[tuple[str, ...], float]  # chain -> bits per byte (its newest evaluation of the round)
    bits_per_byte: float  # the mean over the chains
    spread: float  # the highest chain's figure minus the lowest's


def agreement(rounds: list[EvalRound]) -> list[RoundAgreement]:
    """Per outer round, oldest first, the chains that evaluated it on agreed weights at every stage
    (``EvalRound.agreed_round``): rounds of one chain but mixed outer rounds, or of mixed chains, are left
    out, as they measure no one model, and so are rounds cut short (another set of held-out text).
    Pure: the same evaluations give the same answer, in any order."""
    chains: dict[int, dict[tuple[str, ...], EvalRound]] = {}
    for r in rounds:
        if r.agreed_round is None or not r.chain or not r.complete:
            continue
        seen = chains.setdefault(r.agreed_round, {})
        if r.chain not in seen or (r.at, r.round) > (seen[r.chain].at, seen[r.chain].round):
            seen[r.chain] = r
    out = []
    for round_, seen in sorted(chains.items()):
        figures = {chain: r.bits_per_byte for chain, r in sorted(seen.items())}
        values = list(figures.values())
        out.append(RoundAgreement(round_, figures, sum(values) / len(values), max(values) - min(values)))
    return out

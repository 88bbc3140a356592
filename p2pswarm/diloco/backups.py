"""Stage backups, the pure core: who holds which stage's backup, which announced digests are
trusted, which held copies a mover tries first, whether a decoded backup is what it claims, and
what fits the disk budget. No I/O; ``heal.backup_service`` drives it.

A stage's *agreed backup* is the state every replica of the stage holds alike right after an
outer round: the DiLoCo start weights, the outer momentum and the outer round (no optimizer
state, no inner step: those differ per replica). ``encode_backup`` writes it with
``checkpoint.encode_state``, whose one valid encoding makes equal states equal bytes, so every
honest replica announces the same sha256 (``StageRecord.agreed``) for a round.

- **Duties** (``backup_duties``): rendezvous hashing. For each stage ``s`` the ``copies`` peers
  *not* serving ``s`` with the highest ``sha256(peer | s)`` hold its backup. Every peer computes
  the same answer from the stage map, and a peer joining or leaving moves only its own duties.
- **Trust** (``AgreedLedger``): a digest is trusted for (stage, round) when a signed record of a
  working replica of that stage announced it (``backup_service`` feeds it only those). The ledger
  remembers the last KEEP_ROUNDS announcements of each replica, so it still knows a stage's
  digests after all its replicas are gone. A replica whose digest for a round is outvoted by the
  others' is struck: none of its announcements counts again.
- **Choice** (``choose_backups``): trusted claims first, freshest round first.
- **Pace** (``refresh_due``): a holder's refreshes of a stage take at most BACKUP_LINE_SHARE of the
  time (each fetch itself takes BACKUP_SHARE of the line's time while it runs, ``fetch_pace``).
- **Check** (``check_backup``): the decoded state must be that stage's backup of that round, of
  this model and run, with vectors of the stage's parameter count.
- **Budget** (``BackupBudget``): the bytes the held backups may take on disk.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch

from p2pswarm.dht.records import DIGEST_BYTES, BackupClaim, StageRecord
from p2pswarm.diloco import checkpoint
from p2pswarm.errors import RemoteProtocolError
from p2pswarm.model.catalog import ModelSpec, param_count
from p2pswarm.run.plan import FP32_BYTES, SNAPSHOT_OVERHEAD

BACKUP_FORMAT = 1  # the layout of a backup's state tree; a new layout gets a new number
BACKUP_KIND = "backup"  # tells a backup from a hot snapshot (whose tree has "engine")
BACKUP_COPIES = 2  # holders per stage: one can be gone when the stage's last replica goes too
BACKUP_EVERY_ROUNDS = 1  # refresh at every outer round: a lost stage loses at most the round in progress
BACKUP_SHARE = 0.5  # of a line's time a refresh's fetch may take (fetch_pace.py): training keeps the rest
BACKUP_LINE_SHARE = 0.1  # of all the time, refreshes of one stage's backup take at most (refresh_due)
DEFAULT_BACKUP_BUDGET_MB = 2048  # disk for held backups: a couple of small-tier stages' start and momentum
KEEP_ROUNDS = 8  # announcements remembered per replica: a backup up to 8 rounds old can still be checked
MAX_TRACKED_REPLICAS = 64  # replicas remembered per stage (the oldest-seen forgotten first): bounds memory
MAX_STRUCK = 1024  # struck replicas remembered (the first struck forgotten first): identities are free
MIN_UNTRUSTED_HOLDERS = 2  # holders that must agree on a (round, digest) no replica announced to us
BACKUP_VECTORS = 2  # fp32 vectors in a backup: start and momentum


def backup_duties(me: str, members: Mapping[int, Iterable[str]], copies: int = BACKUP_COPIES) -> frozenset[int]:
    """The stages whose backup ``me`` holds: for each stage, the ``copies`` peers of other stages
    (among all of ``members``' peers) ranking highest by ``sha256(peer | stage)``."""
    serving = {stage: frozenset(peers) for stage, peers in members.items()}
    everyone = frozenset().union(*serving.values()) if serving else frozenset()
    duties = set()
    for stage, replicas in serving.items():
        outside = sorted(everyone - replicas, key=lambda peer: (_rendezvous(peer, stage), peer), reverse=True)
        if me in outside[:copies]:
            duties.add(stage)
    return frozenset(duties)


def refresh_due(now: float, last: tuple[float, float] | None, share: float = BACKUP_LINE_SHARE) -> bool:
    """Whether a holder may fetch a stage's backup again at ``now``, given its ``last`` attempt (when it
    ended, how long it took; None: none yet): not before that duration x (1 / ``share`` - 1) has
    passed since, so refreshes take at most ``share`` of the time (1: whenever a round is due). On a LAN a fetch takes
    a fraction of a second and every round's backup is taken; on a 0.2 Mbit/s uplink a tiny-lm stage's
    5.5 MB take minutes, and refreshing every round kept the serving replica's uplink busy for good."""
    if last is None:
        return True
    ended, seconds = last
    return now >= ended + max(0.0, seconds) * (1 / share - 1)


def _rendezvous(peer: str, stage: int) -> bytes:
    return hashlib.sha256(peer.encode() + b"|" + str(stage).encode()).digest()


@dataclass
class _Announced:
    """One replica's recent agreed announcements, oldest first."""

    pairs: list[tuple[int, bytes]] = field(default_factory=list)
    seen_at: float = 0.0


class AgreedLedger:
    """The (round, digest) pairs the replicas of each stage announced in their signed records."""

    def __init__(self) -> None:
        self._stages: dict[int, dict[str, _Announced]] = {}
        self.struck: dict[str, str] = {}  # replicas outvoted on a round's digest, and why (``newest``)

    def observe(self, records: Iterable[StageRecord], now: float) -> None:
        """Remember the ``agreed`` pair of each fresh record (stage map records are signed and checked)."""
        for record in records:
            if record.agreed is None or not record.is_fresh(now):
                continue
            replicas = self._stages.setdefault(record.stage, {})
            announced = replicas.setdefault(record.peer_id, _Announced())
            announced.seen_at = now
            if record.agreed not in announced.pairs:
                announced.pairs = sorted([*announced.pairs, record.agreed])[-KEEP_ROUNDS:]
            if len(replicas) > MAX_TRACKED_REPLICAS:
                del replicas[min(replicas, key=lambda peer: (replicas[peer].seen_at, peer))]

    def votes(self, stage: int, round_: int, digest: bytes) -> int:
        """How many replicas of ``stage`` announced ``digest`` for ``round_`` (struck ones never count)."""
        return sum((round_, digest) in a.pairs for peer, a in self._stages.get(stage, {}).items()
                   if peer not in self.struck)

    def trusted(self, stage: int, round_: int, digest: bytes) -> bool:
        return self.votes(stage, round_, digest) > 0

    def newest(self, stage: int) -> tuple[int, bytes] | None:
        """The latest round announced for ``stage`` and its digest (most replicas, then the lowest digest).

        Replicas that agreed announce the same digest for a round: one whose digest for a round is outvoted
        by others' is a liar (or broken) and is struck (``struck``): none of its announcements counts again."""
        replicas = {peer: a for peer, a in self._stages.get(stage, {}).items() if peer not in self.struck}
        for round_ in sorted({r for a in replicas.values() for r, _ in a.pairs}):
            votes = {d: self.votes(stage, round_, d) for a in replicas.values() for r, d in a.pairs if r == round_}
            most = max(votes.values())
            for peer, a in replicas.items():
                if any(r == round_ and votes[d] < most for r, d in a.pairs):
                    self.struck[peer] = f"announced another digest for outer round {round_} than {most} replicas"
                    while len(self.struck) > MAX_STRUCK:
                        del self.struck[next(iter(self.struck))]
        pairs = {pair for peer, a in replicas.items() if peer not in self.struck for pair in a.pairs}
        if not pairs:
            return None
        latest = max(round_ for round_, _ in pairs)
        return min((pair for pair in pairs if pair[0] == latest),
                   key=lambda pair: (-self.votes(stage, *pair), pair[1]))

    def stages(self) -> list[int]:
        return sorted(self._stages)


def choose_backups(stage: int, claims: Iterable[tuple[str, BackupClaim]],
                   ledger: AgreedLedger) -> list[tuple[str, BackupClaim]]:
    """The claims of ``stage``'s backup worth fetching, best first: trusted ones (a replica of the
    stage announced that (round, digest)) first, then the freshest round, then the most holders.

    A claim whose (round, digest) the ledger never saw from the stage itself is usable only if at
    least MIN_UNTRUSTED_HOLDERS distinct holders claim the same (round, digest): one lying holder
    alone cannot make a mover load its bytes (which ``check_backup`` still checks)."""
    claims = [(holder, claim) for holder, claim in claims if claim.stage == stage]
    holders: dict[tuple[int, bytes], set[str]] = {}
    for holder, claim in claims:
        holders.setdefault((claim.round, claim.digest), set()).add(holder)

    def trusted(claim: BackupClaim) -> bool:
        return ledger.trusted(stage, claim.round, claim.digest)

    usable = {(h, c) for h, c in claims
              if trusted(c) or len(holders[(c.round, c.digest)]) >= MIN_UNTRUSTED_HOLDERS}
    return sorted(usable, key=lambda hc: (not trusted(hc[1]), -hc[1].round,
                                          -len(holders[(hc[1].round, hc[1].digest)]), hc[1].digest, hc[0]))


def backup_state(model: str, stage: int, run: str, round_: int, start: torch.Tensor,
                 momentum: torch.Tensor | None) -> dict:
    """A stage's agreed backup as a state tree: nothing in it differs between honest replicas. ``momentum``
    None: the run's outer momentum is 0, so the buffer never acts on a later step (``outer_step`` adds
    ``lr * 0 * m``) and is left out: half the bytes (the demo's setting)."""
    state = {"format": BACKUP_FORMAT, "kind": BACKUP_KIND, "model": model, "stage": stage, "run": run,
             "round": round_, "start": start}
    return state if momentum is None else {**state, "momentum": momentum}


def encode_backup(model: str, stage: int, run: str, round_: int, start: torch.Tensor,
                  momentum: torch.Tensor | None) -> bytes:
    """The backup's bytes (``checkpoint.encode_state``: equal states, equal bytes); O(stage): a worker thread's job."""
    return checkpoint.encode_state(backup_state(model, stage, run, round_, start, momentum))


def digest(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def backup_max_bytes(model: ModelSpec, stage: int) -> int:
    """The most bytes a backup of ``stage`` takes: its two fp32 vectors and the snapshot overhead."""
    return BACKUP_VECTORS * FP32_BYTES * param_count(model, stage) + SNAPSHOT_OVERHEAD


def check_backup(state: object, model: ModelSpec, stage: int, run: str, round_: int) -> dict:
    """``state`` if it is ``stage``'s backup of outer round ``round_`` of ``model`` in run ``run``,
    with fp32 vectors of the stage's parameter count; else RemoteProtocolError."""
    expected = {"format": BACKUP_FORMAT, "kind": BACKUP_KIND, "model": model.name, "stage": stage, "run": run,
                "round": round_}
    if not isinstance(state, dict) or set(state) - {"momentum"} != set(expected) | {"start"}:
        raise RemoteProtocolError("not a stage backup (its keys differ)")
    for key, value in expected.items():
        if type(state[key]) is not type(value) or state[key] != value:
            raise RemoteProtocolError(f"a backup whose {key} is {state[key]!r:.80}, not {value!r}")
    numel = param_count(model, stage)
    for key in ("start", "momentum") if "momentum" in state else ("start",):
        vector = state[key]
        if not isinstance(vector, torch.Tensor) or vector.dtype != torch.float32 or vector.shape != (numel,):
            raise RemoteProtocolError(f"a backup whose {key} is not {numel} fp32 values")
        if not bool(torch.isfinite(vector).all()):
            raise RemoteProtocolError(f"a backup whose {key} is not finite")
    return state


def decode_backup(data, model: ModelSpec, stage: int, run: str, round_: int) -> dict:
    """A backup's bytes decoded (``checkpoint.decode_state``, total) and checked as ``stage``'s backup of
    ``round_`` (``check_backup``); RemoteProtocolError otherwise. O(stage): a worker thread's job."""
    return check_backup(checkpoint.decode_state(data, max_bytes=backup_max_bytes(model, stage)), model, stage, run,
                        round_)


def outer_state(state: dict, round_started_step: int, config: dict) -> dict:
    """The outer optimizer's state (``OuterOptimizer.load_state_dict``) a checked backup holds."""
    momentum = state["momentum"] if "momentum" in state else torch.zeros_like(state["start"])  # (momentum 0)
    return {"start": state["start"], "momentum": momentum, "rounds": state["round"],
            "round_started_step": round_started_step, "config": config}


def apply_backup(engine, outer, state: dict, round_steps: int, config: dict) -> None:
    """On the engine's compute thread: a checked backup ``state`` becomes the engine's weights (its
    start; AdamW's moments, per replica, start afresh) and ``outer``'s start, momentum and round
    (``config``: our own outer settings); the engine's step goes to ``round x round_steps``, so the
    LR schedule continues about where the stage was. RemoteProtocolError if it does not fit."""
    step = state["round"] * round_steps  # (H / F: OuterConfig.round_steps)
    try:
        outer.load_state_dict(outer_state(state, step, config))
    except ValueError as exc:  # (nothing changed)
        raise RemoteProtocolError(f"the backup does not fit: {exc}") from None
    engine.step = step
    with torch.no_grad():
        for name, value in engine.params_from_flat(outer.start).items():
            engine.params[name].copy_(value)
    engine.optimizer.state.clear()
    engine.weights_changed()
    engine.agree(outer.rounds, outer.start.clone())


@dataclass(frozen=True)
class BackupBudget:
    """The disk the held backups may take."""

    limit_bytes: int

    def fits(self, held: Mapping[int, int], stage: int, size: int) -> bool:
        """Whether ``stage``'s new backup of ``size`` bytes fits beside the others ``held`` (stage ->
        bytes); the copy it replaces is removed once the new one is written."""
        return size + sum(bytes_ for other, bytes_ in held.items() if other != stage) <= self.limit_bytes


def is_digest(value: object) -> bool:
    return type(value) is bytes and len(value) == DIGEST_BYTES

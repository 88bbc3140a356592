"""Health you can see: each stage healthy (>= 2 live replicas), degraded (1) or down (0).

The pure core counts a stage's live replicas (its fresh records in the stage map) and turns them
into levels (``stage_health``); ``HealthWatch`` says when a stage's level really changed (a level
must hold FLAP_S before it is reported, so one lookup that missed a record is no change);
``BlockWatch`` is stage 0's verdict on whether training can go on (a stage down for BLOCK_AFTER_S
of consecutive observations blocks it, and ``blocked_reason`` says which). ``AgreedRounds``
remembers when this node first saw each stage's agreed outer round, the basis of a backup's age.
The ``*_doc`` helpers shape ``/api/stages``' health fields (``dht.stagemap``).

``serve_health_watch`` is the thin driver: every HEALTH_CHECK_S it reads the stage map and logs
one line per change ("stage 1 is down: 0 live replicas (was healthy: 2)"), WARNING when a stage
is degraded or down, INFO when it is healthy again.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import trio

log = logging.getLogger(__name__)

HEALTHY_REPLICAS = 2  # one replica can die and the stage still serves: the "healthy"
HEALTH_CHECK_S = 5.0  # seconds between checks of the stage map: its rebuild period (STAGE_MAP_PERIOD)
FLAP_S = HEALTH_CHECK_S  # a new level is reported once seen this long: two checks in a row, not one missed lookup
BLOCK_AFTER_S = 5.0  # stage 0 stops cutting micro-batches once a stage was seen down this long without a break
BLOCK_CHECK_S = 1.0  # stage 0 reads its cached stage map this often (cheap: a rebuild runs at most every 5 s)
MAX_ROUNDS_REMEMBERED = 64  # agreed rounds remembered per stage (first-seen times); older ones are no backup's
MAX_STAGES_LISTED = 3  # stages named in a blocked reason before "and N more"


class Health(enum.Enum):
    """A stage's level, by its live replicas."""

    HEALTHY = "healthy"  # >= HEALTHY_REPLICAS
    DEGRADED = "degraded"  # 1: one more loss and the stage is down
    DOWN = "down"  # 0: no peer serves it; no micro-batch can complete


def level_of(replicas: int) -> Health:
    """The level of a stage with ``replicas`` live replicas."""
    if replicas >= HEALTHY_REPLICAS:
        return Health.HEALTHY
    return Health.DEGRADED if replicas >= 1 else Health.DOWN


def stage_health(counts: Mapping[int, int], n_stages: int) -> dict[int, Health]:
    """Each stage's level from its live replicas; a stage missing from ``counts`` is DOWN."""
    return {stage: level_of(counts.get(stage, 0)) for stage in range(n_stages)}


def known_counts(stages: Mapping[int, Sequence], n_stages: int, complete: bool) -> dict[int, int]:
    """Live replicas per stage from a stage map's fresh records. Once a whole map was built
    (``complete``) every stage has a count (a stage no lookup answered has none); before that,
    only the stages looked up: the others are unknown, not down."""
    counts = {stage: len(records) for stage, records in stages.items() if 0 <= stage < n_stages}
    return {stage: counts.get(stage, 0) for stage in range(n_stages)} if complete else counts


@dataclass(frozen=True)
class Change:
    """Stage ``stage`` went from ``before`` (None: first seen) to ``after``, now with ``replicas``."""

    stage: int
    before: Health | None
    after: Health
    replicas: int
    replicas_before: int | None = None  # live replicas when ``before`` was last seen

    @property
    def log_level(self) -> int:
        return logging.INFO if self.after is Health.HEALTHY else logging.WARNING

    def message(self) -> str:
        was = "" if self.before is None else f" (was {self.before.value}: {self.replicas_before})"
        if self.after is Health.HEALTHY and self.before is not None:
            return f"stage {self.stage} is healthy again: {_replicas(self.replicas)}{was}"
        hint = "" if self.after is Health.HEALTHY else "; more peers on it would help (p2pswarm join --layers auto)"
        return f"stage {self.stage} is {self.after.value}: {_replicas(self.replicas)}{was}{hint}"


def _replicas(n: int) -> str:
    return f"{n} live replica{'' if n == 1 else 's'}"


@dataclass
class _Seen:
    """One stage as a HealthWatch saw it: the level last reported (None: none yet) and a new one waiting to hold."""

    reported: Health | None
    replicas: int  # at the last observation of the reported level
    pending: Health | None = None
    since: float = 0.0


class HealthWatch:
    """Which stages' levels changed. A stage first seen healthy is no news; first seen degraded or
    down, it is reported (``before`` None) once that has held ``hold_s``. After that a new level is
    reported once it has held ``hold_s`` (a flap back within that is nothing), so the same level is
    never reported twice in a row. A stage absent from an observation is unknown this time:
    neither a change nor the end of one."""

    def __init__(self, hold_s: float = FLAP_S) -> None:
        self.hold_s = hold_s
        self._seen: dict[int, _Seen] = {}

    def observe(self, counts: Mapping[int, int], now: float) -> list[Change]:
        """The changes ``counts`` (live replicas per stage, at ``now``) make, by stage."""
        return [change for stage, replicas in sorted(counts.items())
                if (change := self._observe_one(stage, replicas, now)) is not None]

    def _observe_one(self, stage: int, replicas: int, now: float) -> Change | None:
        level, seen = level_of(replicas), self._seen.setdefault(stage, _Seen(None, replicas))
        if level is seen.reported or (seen.reported is None and level is Health.HEALTHY):
            seen.reported, seen.replicas, seen.pending = level, replicas, None  # no news (or a healthy start)
            return None
        if level is not seen.pending:
            seen.pending, seen.since = level, now
        if now - seen.since < self.hold_s:
            return None
        change = Change(stage, seen.reported, level, replicas, None if seen.reported is None else seen.replicas)
        self._seen[stage] = _Seen(level, replicas)
        return change

    def levels(self) -> dict[int, Health]:
        """The level last reported of every stage seen."""
        return {stage: seen.reported for stage, seen in self._seen.items() if seen.reported is not None}


def blocked_reason(levels: Mapping[int, Health]) -> str | None:
    """Why stage 0 cannot train (its down stages), or None when no stage is down."""
    down = sorted(stage for stage, level in levels.items() if level is Health.DOWN)
    if not down:
        return None
    if len(down) == 1:
        return f"stage {down[0]} is down; waiting for a peer to take it"
    return f"stages {_listed(down)} are down; waiting for peers to take them"


def _listed(stages: Sequence[int]) -> str:
    """"1 and 2", "0, 1 and 2", "0, 1, 2 and 5 more"."""
    shown = [str(s) for s in stages[:MAX_STAGES_LISTED]]
    rest = len(stages) - len(shown)
    if rest:
        return f"{', '.join(shown)} and {rest} more"
    return f"{', '.join(shown[:-1])} and {shown[-1]}"


class BlockWatch:
    """Stage 0's verdict: blocked while some stage has been seen down in every observation for
    ``after_s`` (a lookup that failed once never blocks). A stage absent from an observation is
    unknown: its run of down observations neither grows nor breaks. ``serving``, the stage we
    serve, is never down while we run (before our own record is in the map it may look so)."""

    def __init__(self, after_s: float = BLOCK_AFTER_S, serving: int | None = None) -> None:
        self.after_s, self.serving = after_s, serving
        self._down_since: dict[int, float] = {}
        self.down: tuple[int, ...] = ()  # the stages that block us now

    @property
    def reason(self) -> str | None:
        return blocked_reason({stage: Health.DOWN for stage in self.down})

    def observe(self, counts: Mapping[int, int], now: float) -> str | None:
        """Take in live replicas per stage at ``now``; the line to log when what blocks us changed."""
        for stage, replicas in counts.items():
            if replicas > 0 or stage == self.serving:
                self._down_since.pop(stage, None)
            else:
                self._down_since.setdefault(stage, now)
        before = self.down
        self.down = tuple(sorted(s for s, since in self._down_since.items() if now - since >= self.after_s))
        if self.down == before:
            return None
        if self.down:
            return f"not training: {self.reason}"
        back = _listed(list(before)) if len(before) > 1 else str(before[0])
        return f"stage{'s' if len(before) > 1 else ''} {back} {'are' if len(before) > 1 else 'is'} up again: " \
               "training resumes"


class AgreedRounds:
    """When this node first saw each stage's agreed outer rounds (``StageRecord.agreed``): a
    backup's age is the time since its round was first seen agreed. Bounded per stage."""

    def __init__(self, keep: int = MAX_ROUNDS_REMEMBERED) -> None:
        self.keep = keep
        self._first_seen: dict[int, dict[int, float]] = {}

    def note(self, stage: int, rounds: Iterable[int], now: float) -> None:
        seen = self._first_seen.setdefault(stage, {})
        for round_ in rounds:
            seen.setdefault(round_, now)
        for old in sorted(seen)[:max(0, len(seen) - self.keep)]:
            del seen[old]

    def newest(self, stage: int) -> int | None:
        """The newest round of ``stage`` ever seen agreed (still remembered), None if none."""
        seen = self._first_seen.get(stage)
        return max(seen) if seen else None

    def age(self, stage: int, round_: int, now: float) -> float | None:
        """Seconds since ``round_`` of ``stage`` was first seen agreed; None if never (or forgotten)."""
        first = self._first_seen.get(stage, {}).get(round_)
        return None if first is None else max(0.0, now - first)


# --- /api/stages ---------------------------------------------------------------------------------

def backups_doc(stage: int, stages: Mapping[int, Sequence], agreed: AgreedRounds, now: float) -> list[dict]:
    """The backups of ``stage`` that the fresh records of other stages' peers claim, freshest first:
    holder, round, rounds behind the stage's newest agreed round and age (None where unknown)."""
    newest = agreed.newest(stage)
    found = [(record.peer_id, claim.round) for other, records in stages.items() if other != stage
             for record in records for claim in record.backups if claim.stage == stage]
    return [{"holder": holder, "round": round_, "rounds_behind": None if newest is None else newest - round_,
             "age_s": _rounded(agreed.age(stage, round_, now))}
            for holder, round_ in sorted(found, key=lambda found: (-found[1], found[0]))]


def _rounded(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 1)


def health_doc(counts: Mapping[int, int]) -> dict:
    """``/api/stages``' top-level ``health``: each known stage's level and what blocks training."""
    levels = {stage: level_of(n) for stage, n in counts.items()}
    return {"stages": {str(stage): level.value for stage, level in sorted(levels.items())},
            "blocked": blocked_reason(levels)}


# --- the driver ----------------------------------------------------------------------------------

async def serve_health_watch(stage_map, period: float = HEALTH_CHECK_S) -> None:
    """Every ``period``, read the stage map (rebuilt when stale; waiting ``period`` at most) and log
    each stage whose level changed. Never returns."""
    watch = HealthWatch()
    while True:
        stages = await stage_map.current(wait=period)
        counts = known_counts(stages, stage_map.model.n_stages, complete=stage_map.updated_at > 0)
        for change in watch.observe(counts, time.time()):
            log.log(change.log_level, change.message())
        await trio.sleep(period)

"""The swarm's stage map as one node sees it (our own stage's announcement: ``announcing``).

The map (which peers serve each stage of the model, with what capacity) is rebuilt on demand,
when asked and older than STAGE_MAP_PERIOD: a full map costs one lookup per stage, and a node
nobody asks should not spend that every few seconds. Each stage's answer replaces its entry as
soon as it is in; a stage whose lookup overruns the bound keeps its previous entry. A joining
peer also keeps its own and the adjacent stages fresh and checks their peers (candidates).
``/api/stages`` serves the map: it waits for a rebuild at most API_WAIT, and the rebuild goes on
in the background (on a loaded machine it takes seconds; an API call must not). It shows each stage's
health (live replicas, level, backups claimed and their age), every stage's level, what blocks training.

A stage's lookup keeps a *pool* of up to CHECK_POOL records, and the map shows its top DEFAULT_K,
re-ranked whenever read (``dht.ranking``): our own record, the peers that answered us, then
strangers a few per address. The pool is wider than the top so that an honest newcomer crowded
out of a stranger's place is still checked, answers, and takes its place as a vouched peer; and a
lookup that misses our own or a vouched peer's record (still fresh) does not drop it.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Awaitable, Callable, Iterable

import trio

from p2pswarm import wire
from p2pswarm.dht import health, ranking, work
from p2pswarm.dht.candidates import CHECK_PERIOD, CandidateBook, asks_first
from p2pswarm.dht.discovery import ANNOUNCE_PERIOD, DEFAULT_K, LOOKUP_TIMEOUT, RECORD_TTL, STAGE_MAP_PERIOD, StageIndex
from p2pswarm.dht.ranking import Standing
from p2pswarm.dht.records import PLAUSIBLE_THROUGHPUT, UNNAMED_RUN, StageRecord
from p2pswarm.errors import DialError
from p2pswarm.model.catalog import ModelSpec, least_served_stage

log = logging.getLogger(__name__)

STAGE_MAP_BUILD_TIMEOUT = 2 * LOOKUP_TIMEOUT + 1.0  # a closest-peer search and a fetch round, each
#                                                   bounded, with room to finish rather than be cut
CHECK_TIMEOUT = 3.0  # connect plus one control round trip; a peer slower than this is no candidate
MAX_CHECKS_AT_ONCE = 8  # round trips in flight while checking candidates
API_WAIT = 1.0  # seconds /api/stages waits for a rebuild before it answers with the map it has
CHECK_POOL = 3 * DEFAULT_K  # records kept (and checked) per stage: room for newcomers behind a crowd
MAX_SEEN = 1024  # peers whose newest record ``addrs_of`` remembers (signed records; the expired go first)
ALIVE_S = RECORD_TTL - ANNOUNCE_PERIOD  # s after a peer's last work we saw in which its expired record counts
#                 (_alive); no longer: a killed peer still leaves every map RECORD_TTL after its last record
LOOKUP_GRACE = 45.0  # s past a stage's last answered lookup until which its records are judged (_fresh):
#                     a dead peer leaves a map whose lookups fail within RECORD_TTL + this (MAX_TTL) of its end


class StageMap:
    """The cached stage map of ``model`` in run ``run``, rebuilt on demand through ``index``; records of
    other runs live under other keys, and any that come back anyway are dropped by the lookup."""

    def __init__(self, index: StageIndex, model: ModelSpec, nursery: trio.Nursery, run: str = UNNAMED_RUN,
                 clock: Callable[[], float] = time.time, roots: Iterable[str] = ()) -> None:
        self._index, self.model, self._nursery, self.run = index, model, nursery, run
        self.clock = clock  # wall-clock seconds, as records' timestamps are (a test passes a virtual one)
        self._pools: dict[int, list[StageRecord]] = {}  # per stage: the last lookup's CHECK_POOL best
        self._answered: dict[int, float] = {}  # per stage: when a lookup last answered (``_fresh``)
        self._unanswered: set[int] = set()  # stages whose last lookup overran its bound (``_fresh``)
        self._seen: dict[str, StageRecord] = {}  # per peer: its newest record any lookup returned (addrs_of)
        self.updated_at = 0.0
        self._rebuilt: trio.Event | None = None  # while a rebuild runs: set when it ends
        self.book = CandidateBook()  # who answered us; only they are candidates
        self.agreed = health.AgreedRounds()  # when each stage's agreed rounds were first seen: backups' age
        self.work = work.WorkBook()  # the work we saw peers do first-hand (``saw``)
        self.attested = work.WorkBook()  # peers counted on others' word lately (``workers``): never attesters
        self.roots = frozenset(roots)  # whose attestations we take before we saw any work: our bootstrap peers
        self.news = trio.Event()  # set when a peer starts working in our book (``announcing``)

    def own(self, record: StageRecord) -> None:
        """Our newest record, as we just signed it (``announcing``): we count ourselves whether or not a
        store took it. On a thin line no announcement got through for a while, and a peer's map read its
        own stage as down while it trained in it."""
        self._seen = _remember(self._seen, [record], self.clock())

    def saw(self, peer: str, stage: int, weight: float = 1.0) -> None:
        """``peer`` did verifiable work for ``stage``, seen by us (``dht.work``). A peer new to our book is
        news our record should carry soon: its replicas count it only once some peer attests it."""
        if self.work.saw(peer, stage, self.clock(), weight):
            self.news.set()

    def workers(self, now: float | None = None) -> dict[int, set[str]]:
        """Per stage, the peers counted as working (``dht.work.workers``): us, those we saw work, and those
        attested by peers we trust. Stage choice, health, rebalancing and DiLoCo's invitations count these."""
        now = self.clock() if now is None else now
        fresh = {stage: self._fresh(stage, now) for stage in self._pools}
        first_hand = self.work.working(now)
        counted = work.workers(fresh, first_hand, me=self._index.me, roots=self.roots,
                               network=ranking.record_network, remembered=self.attested.working(now))
        for stage, peers in counted.items():  # remembered a while: a far stage is known only through the
            for peer in peers - first_hand.keys() - {self._index.me}:  # stages between, which may die first
                self.attested.keep(peer, stage, now)
        return counted

    def standings(self, now: float | None = None) -> Callable[[str], Standing]:
        """Each peer's standing now: our own record, a working peer, a peer that answered us recently, or a
        stranger. The working peers are worked out once, here: rank many records with one call."""
        return _standings(self, self.clock() if now is None else now)

    def _fresh(self, stage: int, now: float) -> list[StageRecord]:
        """The kept records of ``stage`` not yet expired. While the stage's lookups go unanswered (they
        overrun their bound and leave the pool as it was), its records are judged as of the last answer
        (up to LOOKUP_GRACE before now), not now: on a 0.2 Mbit/s line a reader's lookups wait seconds behind its
        training frames, and every stage of its map expired at once and blocked its training while
        every peer trained. A record past its TTL at that time is never shown, except the newest record of a
        peer alive a moment ago (``_alive``)."""
        last = self._answered.get(stage)
        at = now if last is None or stage not in self._unanswered else max(last, now - LOOKUP_GRACE)
        fresh = [r for r in self._pools.get(stage, []) if r.is_fresh(at)]
        listed = {r.peer_id for r in fresh}
        alive = _alive(self._seen, [self._index.me, *self.work.active(now, ALIVE_S)], stage, now)
        return fresh + [r for r in alive if r.peer_id not in listed]

    def pool(self, stage: int) -> list[StageRecord]:
        """Every fresh record kept for ``stage``, best first, crowded strangers last: the peers we check."""
        return ranking.pool(self._fresh(stage, now := self.clock()), _standings(self, now), CHECK_POOL)

    @property
    def stages(self) -> dict[int, list[StageRecord]]:
        """Per stage looked up, its top DEFAULT_K fresh records as we rank them now."""
        now = self.clock()
        standing = _standings(self, now)
        return {stage: ranking.top(self._fresh(stage, now), standing, DEFAULT_K) for stage in self._pools}

    async def refresh(self) -> dict[int, list[StageRecord]]:
        """Look every stage up again (each stage's answer kept as soon as it is in)."""
        await self.refresh_stages(list(range(self.model.n_stages)))
        self.updated_at = self.clock()
        return self.stages

    async def current(self, wait: float = math.inf) -> dict[int, list[StageRecord]]:
        """The stage map, rebuilt when older than STAGE_MAP_PERIOD (a stage whose lookup overruns
        its bound keeps its previous answer; the others are updated). One rebuild at a time, in the
        background: a caller waits for it at most ``wait`` seconds, then has the map as it is."""
        if self._rebuilt is None and self.clock() - self.updated_at >= STAGE_MAP_PERIOD:
            rebuilt = self._rebuilt = trio.Event()

            async def rebuild() -> None:
                try:
                    await self.refresh()
                finally:
                    self._rebuilt = None
                    rebuilt.set()
            self._nursery.start_soon(rebuild)
        if self._rebuilt is not None:
            with trio.move_on_after(wait):
                await self._rebuilt.wait()
        return self.stages

    async def refresh_stages(self, stages: list[int]) -> None:
        """Look up ``stages`` and update each in the map as its answer comes in (bounded)."""
        began = self.clock()
        async def one(stage: int) -> None:
            records = await self._index.lookup_stage(self.model.name, stage, k=CHECK_POOL, standing=self.standings(),
                                                     run=self.run)
            self._keep(stage, [r for r in records if (r.start, r.end) == self.model.stage_range(stage)])

        with trio.move_on_after(STAGE_MAP_BUILD_TIMEOUT) as scope:
            async with trio.open_nursery() as nursery:
                for stage in stages:
                    nursery.start_soon(one, stage)
        if scope.cancelled_caught:  # the stages not answered in time are judged as of their last answer
            self._unanswered |= {stage for stage in stages if self._answered.get(stage, -math.inf) < began}

    def _keep(self, stage: int, found: list[StageRecord]) -> None:
        """A lookup's answer replaces the stage's pool, but our own and vouched peers' records it
        missed stay until they expire: one store that answered alone (a hostile one serving only
        its identities) or a lookup cut short must not make us forget the peers we work with."""
        now = self._answered[stage] = self.clock()
        self._unanswered.discard(stage)
        self._seen = _remember(self._seen, found, now)
        got, standing = {r.peer_id for r in found}, _standings(self, now)
        kept = [r for r in self._pools.get(stage, []) if r.peer_id not in got and r.is_fresh(now)
                and standing(r.peer_id) is not Standing.STRANGER]
        self._pools[stage] = ranking.pool(found + kept, standing, CHECK_POOL)
        self.agreed.note(stage, [r.agreed[0] for r in self._pools[stage] if r.agreed is not None], now)

    async def answer_ping(self, peer: str, message: wire.Ping) -> wire.Pong:
        """Answer a peer's ping (control channel); a peer that checks us has answered us too."""
        self.book.answered(peer, self.clock())
        return wire.Pong(nonce=message.nonce)

    def candidates(self, stage: int) -> list[StageRecord]:
        """The peers serving ``stage`` that answered us recently, best first: what a router may use."""
        return self.book.candidates(self.pool(stage), self.clock())

    def records(self) -> dict[str, StageRecord]:
        """Every peer of the current map, by peer id."""
        return {r.peer_id: r for records in self.stages.values() for r in records}

    async def addrs_of(self, peer_id: str) -> tuple[str, ...]:
        """The addresses of ``peer_id``'s newest fresh record (``/api/ping`` by peer id): from any lookup while
        the record lives, not only from the map's top: a peer asked for by name may be a crowded stranger, or
        missing from the last lookup's answer (a lookup cut short on a loaded machine)."""
        await self.current()
        now = self.clock()
        pooled = [r for stage in self._pools for r in self._fresh(stage, now) if r.peer_id == peer_id]
        seen = self._seen.get(peer_id)
        fresh = [*pooled, *([seen] if seen is not None and seen.is_fresh(now) else [])]
        return max(fresh, key=lambda r: r.timestamp).addrs if fresh else ()

    def counts(self, claimed: bool = False) -> dict[int, int]:
        """Working replicas per stage (``workers``; ``health.known_counts``): every stage once a whole map was
        built; a stage whose peers only claim it is down. ``claimed``: fresh records, claims too (stage 0's
        block watch: workers alone deadlocked a swarm whose first round trip outlasted the block's hold, on a
        thin line: blocked, stage 0 cut nothing, so it saw no work)."""
        now = self.clock()
        workers = {} if claimed else self.workers(now)
        per_stage = {stage: self._fresh(stage, now) if claimed else sorted(workers.get(stage, ()))
                     for stage in self._pools}
        return health.known_counts(per_stage, self.model.n_stages, complete=self.updated_at > 0)

    def doc(self) -> dict:
        now, stages, counts, workers = self.clock(), self.stages, self.counts(), self.workers()
        return {
            "model": self.model.name,
            "run": self.run,
            "n_layers": self.model.n_layers,
            "n_stages": self.model.n_stages,
            "updated_at": self.updated_at,
            "stages": {
                str(stage): {
                    "start": self.model.stage_range(stage)[0],
                    "end": self.model.stage_range(stage)[1],
                    "health": health.level_of(counts[stage]).value,
                    "replicas": counts[stage],
                    "peers": [{**_record_doc(r, now), "answered": self.book.has_answered(r.peer_id, now),
                               "working": r.peer_id in workers.get(stage, ())}
                              for r in stages.get(stage, [])],
                    "backups": health.backups_doc(stage, stages, self.agreed, now),
                }
                for stage in sorted(counts)
            },
            "health": health.health_doc(counts),
        }

    async def stages_json(self, params: dict) -> dict:
        await self.current(wait=API_WAIT)
        return self.doc()

    def routes(self) -> dict:
        return {"/api/stages": self.stages_json}


def _standings(stage_map: StageMap, now: float) -> Callable[[str], Standing]:
    """``StageMap.standings``: the working peers worked out once, for ranking many records."""
    working = {peer for peers in stage_map.workers(now).values() for peer in peers}
    me = stage_map._index.me

    def standing(peer: str) -> Standing:
        if peer == me:
            return Standing.OWN
        if peer in working:
            return Standing.WORKING
        return Standing.VOUCHED if stage_map.book.has_answered(peer, now) else Standing.STRANGER
    return standing


async def choose_stage(stage_map: StageMap, rng: random.Random) -> int:
    """``--layers auto``: the stage served least by working peers (``workers``: their announced
    throughput, else their number); ties broken at random (``catalog.least_served_stage``). Claims
    alone never count: records of identities that did no work weigh nothing. Only a joiner that knows
    of no work at all (no root of its own saw any) breaks ties by the peers that answered it, a few per
    address: then an answer is all the evidence there is."""
    await stage_map.refresh()
    now = stage_map.clock()
    workers, standing = stage_map.workers(now), _standings(stage_map, now)
    fresh = {stage: stage_map._fresh(stage, now) for stage in range(stage_map.model.n_stages)}
    answered = {stage: len(ranking.top([r for r in records if standing(r.peer_id) is Standing.VOUCHED],
                                       standing, DEFAULT_K)) for stage, records in fresh.items()}
    throughputs = {stage: [min(r.capacity.throughput, PLAUSIBLE_THROUGHPUT) for r in records
                           if r.peer_id in workers.get(stage, ())] for stage, records in fresh.items()}
    chosen = least_served_stage(stage_map.model, {s: len(workers.get(s, ())) for s in fresh}, rng, throughputs,
                                tie_break=None if any(workers.values()) else answered)
    log.info("--layers auto: chose stage %d, layers [%d, %d): the least served (%s working, %s answering)",
             chosen, *stage_map.model.stage_range(chosen), _per_stage({s: len(workers.get(s, ())) for s in fresh}),
             _per_stage(answered))
    return chosen


def _alive(seen: dict[str, StageRecord], alive: list[str], stage: int, now: float) -> list[StageRecord]:
    """The newest records of ``stage`` of the ``alive`` peers (us, and those whose work we saw within ALIVE_S),
    expired up to LOOKUP_GRACE ago at most (``StageMap._fresh``). Their announcements wait behind training
    frames on a thin line and reach no store for a while: a stage-0 peer's map read stage 1 as down, and
    stopped training, while stage 1 sent it gradients every two seconds. Only first-hand work counts here,
    never a claim or an attestation."""
    return [r for p in alive if (r := seen.get(p)) is not None and r.stage == stage and r.is_fresh(now - LOOKUP_GRACE)]


def _remember(seen: dict[str, StageRecord], found: list[StageRecord], now: float) -> dict[str, StageRecord]:
    """Each found record as its peer's newest seen (bounded: expired ones, then the oldest, go first)."""
    for record in found:
        held = seen.get(record.peer_id)
        if held is None or record.timestamp > held.timestamp:
            seen[record.peer_id] = record
    if len(seen) > MAX_SEEN:
        live = sorted((r for r in seen.values() if r.is_fresh(now)), key=lambda r: r.timestamp)
        return {r.peer_id: r for r in live[-MAX_SEEN:]}
    return seen


def _per_stage(values: dict[int, int]) -> str:
    return ", ".join(f"stage {stage}: {value}" for stage, value in sorted(values.items()))


def _record_doc(record: StageRecord, now: float) -> dict:
    cap = record.capacity
    return {"peer_id": record.peer_id, "addrs": list(record.addrs), "queue_depth": cap.queue_depth,
            "free_memory_mb": cap.free_memory_mb, "flags": cap.flags, "throughput": cap.throughput,
            "outer_round": cap.outer_round, "agreed_round": None if record.agreed is None else record.agreed[0],
            "train_loss_bpb": cap.train_loss_bpb or None, "heldout_bpb": cap.heldout_bpb or None,
            "expires_in_s": round(record.expires_at - now, 1)}


async def meet_peers(stage_map: StageMap, connected: set[str], connect: Callable[..., Awaitable[object]],
                     rng: random.Random, want: int) -> None:
    """Connect (directly) to up to ``want`` peers of the stage map not in ``connected``.

    A joining peer starts as a DHT client and talks to the bootstrap peers only; reachability
    needs two dial-back servers, so it meets a few of the swarm's other peers.
    """
    await stage_map.current()
    records = {p: r for p, r in stage_map.records().items() if p not in connected}
    chosen = rng.sample(sorted(records), min(want, len(records)))

    async def meet(peer: str) -> None:
        try:
            await connect(peer, records[peer].addrs, via_relay=False)
        except DialError:
            pass  # a NATed peer: someone else will do

    async with trio.open_nursery() as nursery:
        for peer in chosen:
            nursery.start_soon(meet, peer)


def neighbour_stages(model: ModelSpec, stage: int) -> list[int]:
    """The stages a peer of ``stage`` exchanges work with: its own (replicas) and the adjacent ones."""
    return [s for s in (stage - 1, stage, stage + 1) if 0 <= s < model.n_stages]


async def serve_candidate_checks(stage_map: StageMap, stages: list[int], me: str,
                                 round_trip: Callable[[str, tuple[str, ...]], Awaitable[object]]) -> None:
    """Keep ``stages`` of the map fresh and ask their peers for a round trip, so that
    ``StageMap.candidates`` offers only peers that answer us. Peers with a smaller id than ours
    ask us instead (``StageMap.answer_ping`` counts their pings)."""
    while True:
        await stage_map.refresh_stages(stages)
        records = {r.peer_id: r for s in stages for r in stage_map.pool(s) if asks_first(me, r.peer_id)}
        await check_peers(stage_map, [records[p] for p in stage_map.book.to_ask(records, stage_map.clock())],
                          round_trip)
        await trio.sleep(CHECK_PERIOD / 2)


async def check_peers(stage_map: StageMap, records: list[StageRecord],
                      round_trip: Callable[[str, tuple[str, ...]], Awaitable[object]]) -> None:
    """Ask each of ``records``' peers for a round trip (MAX_CHECKS_AT_ONCE at a time, each bounded by
    CHECK_TIMEOUT); those that answer are vouched (``StageMap.book``)."""
    limiter = trio.CapacityLimiter(MAX_CHECKS_AT_ONCE)

    async def check(record: StageRecord) -> None:
        async with limiter:
            stage_map.book.asked(record.peer_id, stage_map.clock())
            with trio.move_on_after(CHECK_TIMEOUT):
                try:
                    await round_trip(record.peer_id, record.addrs)
                except DialError:
                    return
                stage_map.book.answered(record.peer_id, stage_map.clock())

    async with trio.open_nursery() as nursery:
        for record in records:
            nursery.start_soon(check, record)


async def check_every_stage(stage_map: StageMap, me: str,
                            round_trip: Callable[[str, tuple[str, ...]], Awaitable[object]]) -> None:
    """Before ``--layers auto`` chooses: every stage looked up and each pooled peer asked once, so that
    where no work is known to us yet, peers that answer weigh more than records alone."""
    await stage_map.refresh()
    records = {r.peer_id: r for s in range(stage_map.model.n_stages) for r in stage_map.pool(s) if r.peer_id != me}
    await check_peers(stage_map, list(records.values()), round_trip)


async def control_round_trip(connector, control, peer: str, addrs: tuple[str, ...]) -> None:
    """Reach ``peer`` (direct, hole punch or relay) and get a Pong back; DialError otherwise."""
    await connector.connect(peer, addrs)
    nonce = random.getrandbits(63)
    reply = await control.request(peer, wire.Ping(nonce=nonce), CHECK_TIMEOUT)
    if reply != wire.Pong(nonce=nonce):
        raise DialError(f"{peer} answered a ping with {reply!r:.80}")

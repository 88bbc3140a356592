"""StageMap.current: one rebuild at a time, in the background; a caller waits for it at most
its bound (an /api/stages call must answer even when DHT lookups take seconds).

Tests that depend on time run on trio's MockClock (autojump): the map's wall clock is the virtual
clock plus EPOCH, so a record's expiry is reached by ``trio.sleep`` exactly, never raced."""

from __future__ import annotations

import time

import trio
import trio.testing

from p2pswarm.dht.announcing import serve_announcements
from p2pswarm.dht.candidates import ANSWER_FRESH
from p2pswarm.dht.discovery import ANNOUNCE_PERIOD, LOOKUP_TIMEOUT, RECORD_TTL, STAGE_MAP_PERIOD
from p2pswarm.dht.ranking import Standing
from p2pswarm.dht.records import UNNAMED_RUN, Capacity, StageRecord, stage_key
from p2pswarm.dht.stagemap import API_WAIT, StageMap, choose_stage
from p2pswarm.dht.store import RecordStore, StoredRecord
from p2pswarm.model.catalog import get_model

MODEL = get_model("tiny-lm/2")
EPOCH = 1.7e9  # unix seconds the virtual clock starts at (records carry wall-clock timestamps)


def virtual_now() -> float:
    """Wall-clock seconds on trio's (mock) clock."""
    return EPOCH + trio.current_time()


def run_virtual(main) -> None:
    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


class SlowIndex:
    """lookup_stage answers only when the test lets it (``release``), and counts the lookups."""

    me = "me"

    def __init__(self) -> None:
        self.lookups = 0
        self.release = trio.Event()
        self.peers = ["first"]
        self.ttl = 60.0
        self.runs: set[str] = set()  # the runs looked up: a stage map asks for its own only

    async def lookup_stage(self, model: str, stage: int, k: int, standing=None, run=UNNAMED_RUN) -> list[StageRecord]:
        self.lookups += 1
        self.runs.add(run)
        await self.release.wait()
        start, end = MODEL.stage_range(stage)
        return [StageRecord(p, (), model, stage, start, end, Capacity(0, 0), virtual_now(), self.ttl, run)
                for p in self.peers]


def peers(stages: dict) -> set[str]:
    return {r.peer_id for records in stages.values() for r in records}


def test_a_slow_rebuild_does_not_hold_the_caller_and_runs_once():
    async def main():
        index = SlowIndex()
        async with trio.open_nursery() as nursery:
            stage_map = StageMap(index, MODEL, nursery, run="fdd1f91421b0282a", clock=virtual_now)
            assert await stage_map.current(wait=0.05) == {}  # the rebuild is still looking
            assert await stage_map.current(wait=0.05) == {}
            assert index.lookups == MODEL.n_stages  # one rebuild, not one per call
            index.release.set()
            assert peers(await stage_map.current()) == {"first"}  # waits for the running rebuild
            index.peers, index.release = ["second"], trio.Event()
            stage_map.updated_at = 0.0  # stale again
            assert peers(await stage_map.current(wait=0.05)) == {"first"}  # the map it has
            index.release.set()
            assert peers(await stage_map.current()) == {"second"}
            doc = await stage_map.stages_json({})
            assert [p["peer_id"] for p in doc["stages"]["0"]["peers"]] == ["second"]
            assert index.lookups == 2 * MODEL.n_stages
            assert index.runs == {"fdd1f91421b0282a"} and doc["run"] == "fdd1f91421b0282a"  # its own run only

    run_virtual(main)  # each 0.05 s wait ends (virtually) once every task is blocked: the lookups have begun


def test_a_record_past_its_ttl_leaves_the_map_while_lookups_hang():
    """A killed peer must drop out when its record expires, even if every later lookup overruns."""
    async def main():
        index = SlowIndex()
        index.ttl = 2 * STAGE_MAP_PERIOD
        index.release.set()
        async with trio.open_nursery() as nursery:
            stage_map = StageMap(index, MODEL, nursery, clock=virtual_now)
            assert peers(await stage_map.current()) == {"first"}
            [record] = stage_map.pool(0)
            index.release = trio.Event()  # from now on every lookup hangs
            await trio.sleep(STAGE_MAP_PERIOD)
            lookups = index.lookups
            assert peers(await stage_map.current(wait=0.0)) == {"first"}  # stale: a rebuild starts, and hangs
            await trio.sleep(record.expires_at - virtual_now() - 0.001)
            assert index.lookups == lookups + MODEL.n_stages  # the rebuild is still waiting on its lookups
            assert peers(stage_map.stages) == {"first"}  # a millisecond before its expiry: still shown
            await trio.sleep(0.001)
            assert virtual_now() >= record.expires_at
            assert peers(stage_map.stages) == set()
            assert stage_map.pool(0) == [] and stage_map.records() == {}
            assert [p for s in stage_map.doc()["stages"].values() for p in s["peers"]] == []
            nursery.cancel_scope.cancel()

    run_virtual(main)


class StoreIndex:
    """Announcements go into one real RecordStore; a lookup takes ``lookup_time`` (virtual) seconds
    and returns what the store holds then: the DHT of one store, on the virtual clock."""

    me = "reader"

    def __init__(self, lookup_time: float) -> None:
        self.store, self.lookup_time = RecordStore(), lookup_time

    async def announce(self, record: StageRecord, signed: bytes) -> int:
        key = stage_key(record.model, record.stage, record.run)
        return int(self.store.put(key, StoredRecord(record, signed), virtual_now()))

    async def lookup_stage(self, model: str, stage: int, k: int, standing=None, run=UNNAMED_RUN) -> list[StageRecord]:
        await trio.sleep(self.lookup_time)
        return [stored.record for stored in self.store.get(stage_key(model, stage, run), virtual_now())]


def test_a_killed_peer_leaves_every_read_of_the_map_record_ttl_after_its_last_announcement():
    """Issue 24: how long can a SIGKILLed peer stay in a node's map? Its last record, made before it
    died, expires RECORD_TTL later, and no read of the map shows it after that, although the
    peer answered our checks until it died (vouched for ANSWER_FRESH, longer than RECORD_TTL: the
    map keeps a vouched peer's record that a lookup misses), lookups take seconds, and the map is
    read the way /api/stages reads it. A live peer announcing every ANNOUNCE_PERIOD never leaves a map
    read this often whose lookups take LOOKUP_TIMEOUT (a map nobody reads is not rebuilt, and its
    copies of live peers' records expire too: by design, see the module docstring)."""
    assert ANSWER_FRESH > RECORD_TTL  # otherwise the vouched part would prove nothing
    poll = 0.5  # how often the map is read, as the integration test polls /api/stages

    async def main():
        index = StoreIndex(lookup_time=LOOKUP_TIMEOUT)
        announced: dict[str, float] = {}  # peer -> timestamp of its last record

        def signer(peer: str, stage: int):
            def signed_record(_wall_now: float, _ttl: float = RECORD_TTL) -> tuple[StageRecord, bytes]:
                start, end = MODEL.stage_range(stage)
                announced[peer] = virtual_now()
                return (StageRecord(peer, (f"/ip4/10.0.0.{stage + 1}/tcp/1",), MODEL.name, stage, start, end,
                                    Capacity(0, 0), announced[peer], RECORD_TTL), b"signed")
            return signed_record

        async with trio.open_nursery() as nursery:
            stage_map = StageMap(index, MODEL, nursery, clock=virtual_now)
            victim_scope = trio.CancelScope()

            async def victim() -> None:
                with victim_scope:
                    await serve_announcements(index, signer("victim", 0))
            nursery.start_soon(victim)
            nursery.start_soon(serve_announcements, index, signer("live", 1))
            await trio.sleep(3 * ANNOUNCE_PERIOD)
            assert peers(await stage_map.current()) == {"victim", "live"}
            first = announced["victim"]
            while announced["victim"] < first + 2 * ANNOUNCE_PERIOD:  # read as /api/stages is, two announcements on
                stage_map.book.answered("victim", virtual_now())  # it answers our checks while it lives
                assert peers(await stage_map.current(wait=API_WAIT)) == {"victim", "live"}
                await trio.sleep(poll)
            # killed within a poll of its last announcement (the bound below counts from that announcement)
            victim_scope.cancel()  # SIGKILL
            expires_at = announced["victim"] + RECORD_TTL
            assert stage_map.standings()("victim") is Standing.VOUCHED
            shown_at, standing_past_expiry = [], set()
            while virtual_now() < expires_at + 3 * STAGE_MAP_PERIOD:
                shown = peers(await stage_map.current(wait=API_WAIT))
                assert "live" in shown, virtual_now() - expires_at
                if "victim" in shown:
                    shown_at.append(virtual_now())
                if virtual_now() >= expires_at and not standing_past_expiry:  # the first read after its expiry
                    standing_past_expiry.add(stage_map.standings()("victim"))
                assert "victim" not in peers(stage_map.stages) or virtual_now() < expires_at
                assert "victim" not in {p["peer_id"] for s in stage_map.doc()["stages"].values() for p in s["peers"]} \
                    or virtual_now() < expires_at
                await trio.sleep(poll)
            assert shown_at and max(shown_at) < expires_at  # shown until (near) its expiry, never after
            assert standing_past_expiry == {Standing.VOUCHED}  # still vouched when it left: the book keeps no record
            nursery.cancel_scope.cancel()

    run_virtual(main)


class MapIndex:
    """lookup_stage answers at once with the records the test put under each stage."""

    me = "me"

    def __init__(self, records: dict[int, list[StageRecord]]) -> None:
        self.records = records

    async def lookup_stage(self, model: str, stage: int, k: int, standing=None, run=UNNAMED_RUN) -> list[StageRecord]:
        return list(self.records.get(stage, []))


def test_the_map_shows_each_stages_health_replicas_and_the_backups_other_stages_hold():
    from p2pswarm.dht.records import BackupClaim

    three = get_model("tiny-lm/3")
    digest = bytes(32)

    def record(peer: str, stage: int, agreed: int | None, backups=()) -> StageRecord:
        start, end = three.stage_range(stage)
        return StageRecord(peer, (), three.name, stage, start, end, Capacity(0, 0), time.time(), 60.0,
                           agreed=None if agreed is None else (agreed, digest),
                           backups=tuple(BackupClaim(s, r, digest) for s, r in backups))

    async def main():
        index = MapIndex({0: [record("a", 0, 7, [(1, 4), (2, 3)]), record("b", 0, 6)],
                          1: [record("c", 1, 4, [(0, 6), (2, 2)])]})
        async with trio.open_nursery() as nursery:
            stage_map = StageMap(index, three, nursery)
            await stage_map.current()
            for peer, stage in (("a", 0), ("b", 0), ("c", 1)):  # only peers seen working count as replicas
                stage_map.saw(peer, stage)
            doc = stage_map.doc()
            nursery.cancel_scope.cancel()
        stages = doc["stages"]
        assert [(stages[s]["health"], stages[s]["replicas"]) for s in "012"] == [
            ("healthy", 2), ("degraded", 1), ("down", 0)]
        assert {p["peer_id"]: p["agreed_round"] for p in stages["0"]["peers"]} == {"a": 7, "b": 6}
        [backup] = stages["0"]["backups"]  # c (stage 1) holds stage 0's round 6: one behind round 7
        assert backup["holder"] == "c" and backup["round"] == 6 and backup["rounds_behind"] == 1
        assert backup["age_s"] >= 0.0  # round 6 was seen agreed (b's record): its age is known
        assert [(b["holder"], b["round"], b["rounds_behind"]) for b in stages["1"]["backups"]] == [("a", 4, 0)]
        # stage 2: no peer, so no round of it was ever seen agreed: rounds behind and age unknown
        assert stages["2"]["backups"] == [{"holder": "a", "round": 3, "rounds_behind": None, "age_s": None},
                                          {"holder": "c", "round": 2, "rounds_behind": None, "age_s": None}]
        assert doc["health"] == {"stages": {"0": "healthy", "1": "degraded", "2": "down"},
                                 "blocked": "stage 2 is down; waiting for a peer to take it"}

    trio.run(main)


def test_a_stage_never_looked_up_is_unknown_not_down():
    async def main():
        async with trio.open_nursery() as nursery:
            stage_map = StageMap(MapIndex({}), MODEL, nursery)
            assert stage_map.doc()["health"] == {"stages": {}, "blocked": None}  # nothing looked up yet
            await stage_map.refresh_stages([0])
            assert stage_map.counts() == {0: 0}
            await stage_map.current()  # a whole map: every stage has a count now
            assert stage_map.counts() == {0: 0, 1: 0}
            assert stage_map.doc()["health"]["blocked"] == "stages 0 and 1 are down; waiting for peers to take them"
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_stage_0_is_blocked_only_by_a_stage_nobody_claims_while_health_counts_only_workers():
    """A starting swarm on a thin line: stage 1's peers have records but nobody saw them work yet (the first
    round trip takes longer than the block's hold). Health calls stage 1 down; the block watch, which reads
    claims, does not block stage 0, which would otherwise never cut the micro-batch that shows the work."""
    def record(peer: str, stage: int) -> StageRecord:
        start, end = MODEL.stage_range(stage)
        return StageRecord(peer, (), MODEL.name, stage, start, end, Capacity(0, 0), time.time(), 60.0)

    async def main():
        index = MapIndex({0: [record("me", 0)], 1: [record("b", 1), record("c", 1)]})
        async with trio.open_nursery() as nursery:
            stage_map = StageMap(index, MODEL, nursery)
            await stage_map.current()
            assert stage_map.counts() == {0: 1, 1: 0} and stage_map.counts(claimed=True) == {0: 1, 1: 2}
            stage_map.saw("b", 1)
            assert stage_map.counts() == {0: 1, 1: 1}
            nursery.cancel_scope.cancel()

    trio.run(main)


class ListIndex:
    """lookup_stage answers at once with ``answer`` (records made by the test)."""

    me = "me"

    def __init__(self) -> None:
        self.answer: list[StageRecord] = []

    async def lookup_stage(self, model: str, stage: int, k: int, standing=None, run=UNNAMED_RUN) -> list[StageRecord]:
        return [r for r in self.answer if r.stage == stage]


def test_a_peer_asked_for_by_id_is_found_while_its_record_lives_even_when_a_lookup_misses_it():
    """``addrs_of`` (``/api/ping`` by peer id) gives a stranger's addresses from any lookup while its record is
    fresh: the next lookup's answer may lack it (cut short), or its address crowd may keep it out of the top."""
    async def main():
        index = ListIndex()
        start, end = MODEL.stage_range(0)

        def record(peer: str, addr: str, ttl: float = 60.0) -> StageRecord:
            return StageRecord(peer, (addr,), MODEL.name, 0, start, end, Capacity(0, 0), virtual_now(), ttl,
                               UNNAMED_RUN)

        async with trio.open_nursery() as nursery:
            stage_map = StageMap(index, MODEL, nursery, clock=virtual_now)
            crowd = [record(f"crowd{i}", f"/ip4/10.1.0.{i}/tcp/1/p2p-circuit") for i in range(6)]  # one /24
            index.answer = [record("wanted", "/ip4/10.2.0.1/tcp/4001", ttl=30.0), *crowd]
            await stage_map.refresh()
            assert await stage_map.addrs_of("wanted") == ("/ip4/10.2.0.1/tcp/4001",)
            assert "crowd5" not in stage_map.records()  # crowded out of the top ...
            assert await stage_map.addrs_of("crowd5") == ("/ip4/10.1.0.5/tcp/1/p2p-circuit",)  # ... still found
            index.answer = crowd  # the next lookup misses it
            await trio.sleep(STAGE_MAP_PERIOD)
            await stage_map.refresh()
            assert "wanted" not in stage_map.records()
            assert await stage_map.addrs_of("wanted") == ("/ip4/10.2.0.1/tcp/4001",)  # its record still lives
            await trio.sleep(30.0)  # past its TTL
            assert await stage_map.addrs_of("wanted") == ()
            assert await stage_map.addrs_of("nobody") == ()
            nursery.cancel_scope.cancel()

    run_virtual(main)


def _fake_records(model, stage: int, n: int, addrs: int, worked=()) -> list[StageRecord]:
    """``n`` identities claiming ``stage`` of ``model`` with everything plausible maxed, from ``addrs`` addresses."""
    start, end = model.stage_range(stage)
    return [StageRecord(f"fake{i:02d}", (f"/ip4/203.0.{113 + i % addrs}.7/tcp/{4001 + i}",), model.name, stage,
                        start, end, Capacity(2**31, 0, 0, 1e7, 99), time.time(), 60.0,
                        worked=tuple((f"fake{(i + j) % n:02d}", stage) for j in (1, 2))) for i in range(n)]


def test_sixteen_fake_records_claiming_stage_1_send_an_honest_joiner_to_stage_1():
    """The probe of issue 25, on the map's core: an honest peer serves stage 0 of tiny-lm/2 and answers
    us; 16 identities of one address claim stage 1. The joiner knows no work yet: stage 1 has no working
    peer and nobody there answers, so it takes stage 1; and both stages are down in its map until it sees work."""
    import random

    two = get_model("tiny-lm/2")
    honest = StageRecord("a", ("/ip4/198.51.100.1/tcp/4001",), two.name, 0, *two.stage_range(0), Capacity(100, 0),
                         time.time(), 60.0)
    index = MapIndex({0: [honest], 1: _fake_records(two, 1, 16, 1)})

    async def main():
        async with trio.open_nursery() as nursery:
            stage_map = StageMap(index, two, nursery)
            stage_map.book.answered("a", stage_map.clock())
            chosen = {await choose_stage(stage_map, random.Random(seed)) for seed in range(8)}
            assert chosen == {1} and stage_map.counts() == {0: 0, 1: 0}
            assert not stage_map.workers()
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_64_answering_fakes_from_4_addresses_are_neither_chosen_by_nor_invited_by_an_honest_joiner():
    """64 identities from 4 addresses claim stage 1, answer every ping and attest each other. The joiner's
    bootstrap peer ``a`` (stage 0) attests ``b`` (stage 1), which attests ``a``: the working peers are
    a and b alone, a stage with a working peer is chosen like any other, and no fake is counted."""
    import random

    two = get_model("tiny-lm/2")

    def honest(peer: str, stage: int, other: str) -> StageRecord:
        return StageRecord(peer, (f"/ip4/198.51.100.{stage + 1}/tcp/4001",), two.name, stage, *two.stage_range(stage),
                           Capacity(100, 0), time.time(), 60.0, worked=((other, 1 - stage),))

    fakes = _fake_records(two, 1, 64, 4)
    index = MapIndex({0: [honest("a", 0, "b")], 1: [honest("b", 1, "a"), *fakes]})

    async def main():
        async with trio.open_nursery() as nursery:
            stage_map = StageMap(index, two, nursery, roots=["a"])
            for fake in fakes:
                stage_map.book.answered(fake.peer_id, stage_map.clock())
            assert {await choose_stage(stage_map, random.Random(seed)) for seed in range(16)} == {0, 1}
            assert stage_map.workers() == {0: {"a"}, 1: {"b"}}  # what health, moves and DiLoCo's invitations read
            assert stage_map.counts() == {0: 1, 1: 1}
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_a_peer_whose_announcements_are_cut_announces_longer_lived_records_until_one_gets_through():
    """On a 0.2 Mbit/s uplink full of training frames three cut announcements in a row expired a live
    peer's record everywhere (RECORD_TTL 15 s), and its stage was reported degraded while it trained."""
    from p2pswarm.dht.discovery import announce_ttl
    from p2pswarm.dht.records import MAX_TTL

    ttls: list[float] = []
    slow = [True] * 4 + [False] * 10  # four announcements cut at ANNOUNCE_PERIOD, then the rest in time
    taken = [1, 0] + [1] * 8  # (cut ones take nothing) the sixth in time, yet no store took it

    class SlowIndex:
        async def announce(self, record, signed) -> int:
            await trio.sleep(2 * ANNOUNCE_PERIOD if slow.pop(0) else 0.1)
            return taken.pop(0)

    def signed_record(_wall_now: float, ttl: float = RECORD_TTL):
        ttls.append(ttl)
        start, end = MODEL.stage_range(0)
        return StageRecord("p", ("/ip4/10.0.0.1/tcp/1",), MODEL.name, 0, start, end, Capacity(0, 0), 0.0, ttl), b""

    async def main():
        with trio.move_on_after(8 * ANNOUNCE_PERIOD + 1):
            await serve_announcements(SlowIndex(), signed_record)

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert ttls[:9] == [RECORD_TTL, 2 * RECORD_TTL, 4 * RECORD_TTL, MAX_TTL, MAX_TTL, RECORD_TTL, 2 * RECORD_TTL,
                        RECORD_TTL, RECORD_TTL]
    assert all(announce_ttl(t, cut=True) <= MAX_TTL for t in ttls)


def test_while_a_stages_lookups_go_unanswered_its_records_are_judged_as_of_the_last_answer_plus_a_grace():
    """On a 0.2 Mbit/s line a reader's lookups wait seconds behind its training frames and overrun their
    bound: every record in its map expired at once, every stage read as down while every peer trained,
    and stage 0 stopped training. Now the records are judged as of the last answer plus LOOKUP_GRACE:
    a peer that died meanwhile still leaves the map, within RECORD_TTL + LOOKUP_GRACE of its last record."""
    from p2pswarm.dht.stagemap import LOOKUP_GRACE

    class Unanswered(StoreIndex):
        answering = True

        async def lookup_stage(self, *args, **kwargs):
            if not self.answering:
                await trio.sleep_forever()  # overruns the rebuild's bound: the stage keeps its previous entry
            return await super().lookup_stage(*args, **kwargs)

    async def main():
        index = Unanswered(lookup_time=0.1)
        start, end = MODEL.stage_range(1)
        record = StageRecord("live", ("/ip4/10.0.0.2/tcp/1",), MODEL.name, 1, start, end, Capacity(0, 0),
                             virtual_now(), RECORD_TTL)
        await index.announce(record, b"signed")
        async with trio.open_nursery() as nursery:
            stage_map = StageMap(index, MODEL, nursery, clock=virtual_now)
            assert "live" in peers(await stage_map.current())
            index.answering = False
            while virtual_now() < record.timestamp + RECORD_TTL + 2 * STAGE_MAP_PERIOD:
                assert "live" in peers(await stage_map.current(wait=API_WAIT))  # past its TTL: no answer said so
                assert stage_map.counts(claimed=True)[1] == 1  # and stage 0 does not stop training on it
                await trio.sleep(1.0)
            await trio.sleep_until(record.timestamp - EPOCH + RECORD_TTL + LOOKUP_GRACE - 3 * API_WAIT)
            assert "live" in peers(await stage_map.current(wait=API_WAIT))
            await trio.sleep(4 * API_WAIT)
            assert "live" not in peers(await stage_map.current(wait=API_WAIT))  # RECORD_TTL + LOOKUP_GRACE: gone
            nursery.cancel_scope.cancel()

    run_virtual(main)


def test_a_peer_whose_records_reach_no_store_counts_while_we_see_it_work_and_leaves_alive_s_after_its_last():
    """On a 0.2 Mbit/s line a stage-1 peer's announcements waited behind its training frames and reached no
    store for a minute: its record expired in stage 0's maps, which read stage 1 as down and stopped training
    while stage 1 sent them gradients every two seconds. Work seen first-hand keeps its newest record counted
    (never a claim: a claimant whose record expired is gone at once), until ALIVE_S after its last work, and
    never past LOOKUP_GRACE after the record's own expiry. Our own record counts whether or not a store took it."""
    from p2pswarm.dht.stagemap import ALIVE_S, LOOKUP_GRACE

    class NoStore(StoreIndex):
        async def announce(self, record: StageRecord, signed: bytes) -> int:
            await trio.sleep_forever()  # a thin line: no store ever hears of it
            return 0

    def record(peer: str, stage: int) -> StageRecord:
        start, end = MODEL.stage_range(stage)
        return StageRecord(peer, (f"/ip4/10.0.0.{stage + 1}/tcp/1",), MODEL.name, stage, start, end, Capacity(0, 0),
                           virtual_now(), RECORD_TTL)

    async def main():
        index = NoStore(lookup_time=0.1)
        worker, claimant = record("worker", 1), record("claimant", 1)
        for found in (worker, claimant):
            await StoreIndex.announce(index, found, b"signed")  # their last records that got through
        async with trio.open_nursery() as nursery:
            stage_map = StageMap(index, MODEL, nursery, clock=virtual_now)
            nursery.start_soon(serve_announcements, index, lambda _now, ttl: (record("reader", 0), b""), stage_map)
            assert peers(await stage_map.current()) == {"worker", "claimant", "reader"}
            while virtual_now() < worker.expires_at + LOOKUP_GRACE - 3.0:  # it works; no record of it gets through
                stage_map.saw("worker", 1)
                await stage_map.current(wait=API_WAIT)
                assert stage_map.counts() == {0: 1, 1: 1}  # and stage 0 does not stop training:
                assert stage_map.counts(claimed=True)[1] == 1 + (virtual_now() < claimant.expires_at)
                assert "claimant" not in peers(stage_map.stages) or virtual_now() < claimant.expires_at
                await trio.sleep(2.0)
            last_work = virtual_now() - 2.0
            while virtual_now() < last_work + ALIVE_S + 2 * STAGE_MAP_PERIOD:  # it died, or its record's grace ended
                await stage_map.current(wait=API_WAIT)
                gone = virtual_now() >= min(last_work + ALIVE_S, worker.expires_at + LOOKUP_GRACE)
                assert ("worker" in peers(stage_map.stages)) is not gone
                assert stage_map.counts()[1] == (0 if gone else 1)
                assert stage_map.counts()[0] == 1  # we count ourselves throughout, though no store ever took us
                await trio.sleep(1.0)
            nursery.cancel_scope.cancel()

    run_virtual(main)

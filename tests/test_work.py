"""Work, not claims (``dht.work``): the decayed book of work we saw, and who counts as working."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from p2pswarm.dht.ranking import MAX_PER_IP, record_network
from p2pswarm.dht.records import MAX_FREE_MEMORY_MB, MAX_THROUGHPUT, Capacity, StageRecord
from p2pswarm.dht.work import MAX_ATTESTED, MAX_TRUST_HOPS, MIN_WORK, WORK_HALF_LIFE, WorkBook, workers

N_STAGES = 3


def rec(peer: str, stage: int, addr: str = "/ip4/198.51.100.1/tcp/4001", worked=(), ts: float = 0.0,
        mem: int = 0, tput: float = 0.0) -> StageRecord:
    return StageRecord(peer, (addr,), "m", stage, stage, stage + 1, Capacity(mem, 0, 0, tput), ts, 60.0,
                       worked=tuple(worked))


def by_stage(records) -> dict[int, list[StageRecord]]:
    stages: dict[int, list[StageRecord]] = {}
    for r in records:
        stages.setdefault(r.stage, []).append(r)
    return stages


def count(records, first_hand, me="me", roots=()):
    return workers(by_stage(records), first_hand, me=me, roots=roots, network=record_network)


def test_one_event_counts_for_two_half_lives_and_then_not():
    book = WorkBook()
    book.saw("b", 1, now=100.0)
    assert book.working(100.0 + 2 * WORK_HALF_LIFE - 0.01) == {"b": 1}
    assert book.working(100.0 + 2 * WORK_HALF_LIFE + 0.01) == {}
    assert book.score("b", 100.0 + 2 * WORK_HALF_LIFE) == MIN_WORK


def test_a_peer_that_moved_starts_again_in_its_new_stage():
    book = WorkBook()
    for t in range(50):
        book.saw("b", 1, now=float(t))
    book.saw("b", 2, now=50.0)
    assert book.working(50.0) == {"b": 2} and book.score("b", 50.0) == 1.0


@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 2), st.floats(0, 1000)), max_size=200))
def test_the_book_is_bounded_and_attests_its_best_working_peers(events):
    book = WorkBook(max_workers=16)
    now = 0.0
    for peer, stage, dt in events:
        now += dt
        book.saw(f"p{peer}", stage, now)
    attested = book.attested(now)
    assert len(book.working(now)) <= 16 and len(attested) <= MAX_ATTESTED
    assert all(book.score(p, now) >= MIN_WORK for p, _ in attested)
    scores = [book.score(p, now) for p, _ in attested]
    assert scores == sorted(scores, reverse=True)
    left_out = set(book.working(now)) - {p for p, _ in attested}
    assert all(book.score(p, now) <= min(scores) for p in left_out)


def test_claims_and_pings_count_for_nothing_work_counts():
    """The probe of issue 25: an honest peer serves stage 0, 16 identities claim stage 1 (and attest
    each other). No fake counts; the honest peer counts once we saw it work or a trusted peer attests it."""
    fakes = [rec(f"fake{i:02d}", 1, "/ip4/203.0.113.7/tcp/4001", [(f"fake{(i + 1) % 16:02d}", 1)],
                 mem=MAX_FREE_MEMORY_MB, tput=MAX_THROUGHPUT) for i in range(16)]
    honest = rec("a", 0)
    assert count([honest, *fakes], {}) == {}
    assert count([honest, *fakes], {"a": 0}) == {0: {"a"}}
    assert count([honest, *fakes], {}, roots={"a"}) == {}  # a root that saw nothing attests nothing
    voucher = rec("root", 2, worked=[("a", 0)])
    assert count([honest, voucher, *fakes], {}, roots={"root"}) == {0: {"a"}}


def test_attestations_are_followed_a_few_hops_from_what_we_saw():
    """A chain of stages, each peer attesting the next: MAX_TRUST_HOPS hops from our own work."""
    chain = [f"s{i}" for i in range(MAX_TRUST_HOPS + 3)]
    records = [rec(p, i % N_STAGES, f"/ip4/198.51.100.{i}/tcp/1", [(chain[i + 1], (i + 1) % N_STAGES)]
                   if i + 1 < len(chain) else []) for i, p in enumerate(chain)]
    counted = {p for peers in count(records, {"s0": 0}).values() for p in peers}
    assert counted == set(chain[:MAX_TRUST_HOPS + 1])


def test_a_worker_that_moved_counts_in_its_new_stage_and_a_peer_without_a_record_nowhere():
    """Two peers must not move into one dead stage: the first one's new record counts at once for the
    second, because the work it did in its old stage makes it a worker."""
    records = [rec("a", 0, worked=[("b", 2), ("ghost", 1)]), rec("b", 1), rec("c", 2)]
    assert count(records, {"a": 0}) == {0: {"a"}, 1: {"b"}}  # attested for stage 2, now serving stage 1
    assert count(records, {"c": 1}) == {2: {"c"}}  # seen working for stage 1, now serving stage 2


def test_first_hand_workers_behind_one_address_all_count_attested_ones_a_few():
    """A CGNAT: every peer we saw work counts; of those only attested, MAX_PER_IP per address."""
    cgnat = "/ip4/100.64.0.1/tcp/4001"
    seen = [rec(f"seen{i}", 1, cgnat) for i in range(5)]
    told = [rec(f"told{i}", 2, cgnat) for i in range(5)]
    attester = rec("a", 0, worked=[(r.peer_id, 2) for r in told])
    counted = count([*seen, *told, attester], {**{r.peer_id: 1 for r in seen}, "a": 0})
    assert counted[1] == {r.peer_id for r in seen} and len(counted[2]) == MAX_PER_IP


def test_attested_peers_of_other_stages_behind_one_address_never_crowd_a_stage_out_of_the_count():
    """One machine's swarm (loopback), after its middle stage died and a first-stage peer moved into it: the
    first stage's last peer, known only through attestations, counts although attested peers of the last
    stage and the dead ones' still-fresh records share its address. Counted across stages, it was crowded
    out, its stage looked down, and a last-stage peer moved out of a served stage (the heal test, CI)."""
    here = "/ip4/127.0.0.1/tcp/4001"
    moved, first, last, dead = rec("moved", 1, here), rec("s0", 0, here), rec("s2", 2, here), \
        [rec(f"dead{i}", 1, here) for i in range(2)]
    remembered = {"s0": 0, "s2": 2, "dead0": 1, "dead1": 1}
    counted = workers(by_stage([moved, first, last, *dead]), {"moved": 1}, me="me", roots=(),
                      network=record_network, remembered=remembered)
    assert "s0" in counted[0] and "s2" in counted[2]
    told = [rec(f"told{s}{i}", s, here) for s in range(N_STAGES) for i in range(MAX_PER_IP + 2)]
    attester = rec("a", 0, "/ip4/198.51.100.9/tcp/1", worked=[(r.peer_id, r.stage) for r in told][:MAX_ATTESTED])
    per_stage = count([*told, attester], {"a": 0})
    assert all(len(per_stage.get(s, set()) - {"a"}) <= MAX_PER_IP for s in range(N_STAGES))


fake_ids = [f"fake{i:02d}" for i in range(64)]
honest_ids = ["me", "h1", "h2", "h3", "h4", "h5"]


@st.composite
def swarms(draw):
    """Honest peers (they attest only honest peers they saw work) beside 64 fakes from 4 addresses that
    claim anything, attest anyone, and may be named roots or claimed first-hand by nobody honest."""
    honest = [rec(p, draw(st.integers(0, N_STAGES - 1)), f"/ip4/198.51.100.{i}/tcp/1",
                  draw(st.lists(st.tuples(st.sampled_from(honest_ids[1:]), st.integers(0, 2)), max_size=4,
                                unique_by=lambda pair: pair[0])), ts=1.0)
              for i, p in enumerate(honest_ids)]
    honest = [r if all(p != r.peer_id for p, _ in r.worked) else rec(r.peer_id, r.stage, r.addrs[0]) for r in honest]
    rng = draw(st.randoms(use_true_random=False))  # the 64 fakes' choices: one draw, not 64 x 8

    def attests(me: str) -> list[tuple[str, int]]:
        peers = [p for p in rng.sample(fake_ids + honest_ids[1:], rng.randint(0, MAX_ATTESTED + 1)) if p != me]
        return [(p, rng.randrange(N_STAGES)) for p in peers[:MAX_ATTESTED]]

    fakes = [rec(p, rng.randrange(N_STAGES), f"/ip4/203.0.113.{i % 4}/tcp/{i}", attests(p), ts=rng.uniform(0, 2),
                 mem=MAX_FREE_MEMORY_MB, tput=MAX_THROUGHPUT) for i, p in enumerate(fake_ids)]
    first_hand = draw(st.dictionaries(st.sampled_from(honest_ids[1:]), st.integers(0, 2), max_size=5))
    roots = draw(st.sets(st.sampled_from([*honest_ids, "bootstrap"]), max_size=3))
    return honest + fakes, first_hand, roots


@given(swarms())
@settings(max_examples=60)
def test_no_fake_ever_counts_whatever_it_claims_or_attests(swarm):
    records, first_hand, roots = swarm
    counted = {p for peers in count(records, first_hand, roots=roots).values() for p in peers}
    assert not any(p.startswith("fake") for p in counted)
    assert "me" in counted  # our own record always counts


class WorkBookMachine(RuleBasedStateMachine):
    """Events and time in any order: the book never counts a peer whose evidence decayed below MIN_WORK,
    always counts one that just worked, and never grows past its bound."""

    def __init__(self) -> None:
        super().__init__()
        self.book, self.now, self.last = WorkBook(max_workers=8), 0.0, {}
        self.newest: str | None = None

    @rule(peer=st.integers(0, 12), stage=st.integers(0, 2), weight=st.sampled_from([1.0, 8.0]))
    def saw(self, peer, stage, weight):
        self.book.saw(f"p{peer}", stage, self.now, weight)
        self.last[f"p{peer}"] = (self.now, stage)
        self.newest = f"p{peer}"
        assert self.book.working(self.now)[f"p{peer}"] == stage

    @rule(dt=st.floats(0, 3 * WORK_HALF_LIFE))
    def wait(self, dt):
        self.now += dt

    @precondition(lambda self: self.last)
    @invariant()
    def decayed_peers_are_gone(self):
        working = self.book.working(self.now)
        assert len(working) <= 8
        for peer, (at, stage) in self.last.items():
            if peer in working:
                assert working[peer] == stage
            weight_bound = 8.0 * len(self.last) * 64  # more than any peer's total events here
            if self.now - at > WORK_HALF_LIFE * 2 * 14 and weight_bound:  # 2^-28 of any sum: far below MIN_WORK
                assert peer not in working


    @invariant()
    def active_peers_are_those_that_worked_a_moment_ago(self):
        within = 10.0
        active = self.book.active(self.now, within)
        assert all(self.now - self.last[peer][0] <= within and self.last[peer][1] == stage
                   for peer, stage in active.items())  # never a peer idle for longer, nor in another stage
        newest = self.newest  # the peer of the last event (the bound may evict others)
        assert newest is None or self.now - self.last[newest][0] > within or newest in active  # active while it is


TestWorkBookMachine = WorkBookMachine.TestCase


def test_a_peer_attested_a_moment_ago_still_counts_while_its_attesters_are_gone_but_attests_nobody():
    """A far stage is known only through the stages between: when those die, its peers stay counted a
    while (``WorkBook.keep``), so a dead middle stage does not make the far one look dead too."""
    far = rec("far", 0, worked=[("further", 2)])
    records = [far, rec("further", 2)]
    assert count(records, {}) == {}
    counted = workers(by_stage(records), {}, me="me", roots=(), network=record_network, remembered={"far": 0})
    assert counted == {0: {"far"}}  # and "further", attested by "far" alone, is not counted
    assert workers(by_stage([rec("far", 1)]), {}, me="me", roots=(), network=record_network,
                   remembered={"far": 0}) == {1: {"far"}}  # it moved: a worker still, where it serves now
    book = WorkBook()
    book.keep("far", 0, now=0.0)
    assert book.working(2 * WORK_HALF_LIFE - 0.1) == {"far": 0} and book.working(2 * WORK_HALF_LIFE + 0.1) == {}

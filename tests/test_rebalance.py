"""Properties of the rebalancing rule (p2pswarm.heal.rebalance): who moves, where to, when, and that it stops.

The swarm is simulated: every peer has its own ``Rebalancer``, all see the same map each period
and act on their decision at the end of it (a move is seen by everyone at the next period).
"""

import random
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from p2pswarm.heal.rebalance import (
    DOWN_GRACE,
    IMBALANCE_GRACE,
    JOIN_GRACE,
    MOVE_JITTER,
    PEER_COOLDOWN,
    STAGE_COOLDOWN,
    Move,
    Rebalancer,
    counts,
    rank,
    wanted,
)
from p2pswarm.model.catalog import get_model

PERIOD = 5.0  # the mover's check period (heal.mover.MOVE_CHECK_S)
SLOW_PERIOD = 30.0  # a coarser clock for the convergence runs: the rule does not depend on the period
MODEL3 = get_model("tiny-lm/3")  # the integration test's model: 3 stages


class SimSwarm:
    """Peers (id -> stage), some pinned, each with its own Rebalancer; ``period`` applies every decision."""

    def __init__(self, n_stages: int, seed: int = 0) -> None:
        self.n_stages, self.seed, self.now = n_stages, seed, 0.0
        self.stage: dict[str, int] = {}
        self.pinned: set[str] = set()
        self.cores: dict[str, Rebalancer] = {}
        self.moves: list[tuple[float, str, Move]] = []

    def join(self, peer: str, stage: int, pinned: bool = False) -> None:
        self.stage[peer] = stage
        self.cores[peer] = Rebalancer(peer, self.n_stages, random.Random(f"{self.seed}/{peer}"))
        if pinned:
            self.pinned.add(peer)

    def leave(self, peer: str) -> None:
        del self.stage[peer], self.cores[peer]
        self.pinned.discard(peer)

    def members(self) -> dict[int, list[str]]:
        members: dict[int, list[str]] = {}
        for peer, stage in self.stage.items():
            members.setdefault(stage, []).append(peer)
        return members

    def counts(self) -> tuple[int, ...]:
        return counts(self.members(), self.n_stages)

    def period(self, dt: float) -> list[tuple[str, Move]]:
        self.now += dt
        members, movable = self.members(), set(self.stage) - self.pinned
        decided = [(peer, core.observe(members, movable, self.now)) for peer, core in self.cores.items()]
        moves = [(peer, move) for peer, move in decided if move is not None]
        for peer, move in moves:
            assert move.from_stage == self.stage[peer]
            self.stage[peer] = move.to_stage
            self.cores[peer].moved(move.from_stage, move.to_stage, self.now)
            self.moves.append((self.now, peer, move))
        return moves

    def balanced(self) -> bool:
        donors = {s for p, s in self.stage.items() if p not in self.pinned}
        return wanted(self.counts(), sorted(donors)) is None


def peers(n: int) -> list[str]:
    return [f"peer{i}" for i in range(n)]


@st.composite
def populations(draw, max_peers=10):
    n_stages = draw(st.integers(1, 4))
    n = draw(st.integers(1, max_peers))
    stages = draw(st.lists(st.integers(0, n_stages - 1), min_size=n, max_size=n))
    pinned = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    return n_stages, list(zip(peers(n), stages, pinned))


def swarm_of(population, seed=0) -> SimSwarm:
    n_stages, members = population
    swarm = SimSwarm(n_stages, seed)
    for peer, stage, pinned in members:
        swarm.join(peer, stage, pinned)
    return swarm


@given(st.lists(st.integers(0, 9), min_size=1, max_size=6), st.data())
def test_a_wanted_move_never_empties_and_raises_the_weakest(count, data):
    donors = data.draw(st.lists(st.integers(0, len(count) - 1), unique=True))
    want = wanted(count, donors)
    if want is None:
        assert not donors or max(count[s] for s in donors) - min(count) <= 1
        return
    a, b = want
    assert count[a] >= 2 and count[a] - 1 >= count[b] + 1  # the donor keeps at least as many as the target gets
    after = list(count)
    after[a], after[b] = after[a] - 1, after[b] + 1
    assert sorted(after) > sorted(count)  # leximin: the potential that bounds the moves
    assert sum(c * c for c in after) <= sum(c * c for c in count) - 2


@settings(max_examples=40)
@given(populations(), st.integers(0, 3))
def test_moves_stop_balanced_and_never_start_again(population, seed):
    swarm = swarm_of(population, seed)
    squares = sum(c * c for c in swarm.counts())
    per_move = int((max(STAGE_COOLDOWN, PEER_COOLDOWN) + IMBALANCE_GRACE) / SLOW_PERIOD) + 3
    for _ in range((squares // 2 + 1) * per_move):  # each move lowers the sum of squares by 2 at least
        swarm.period(SLOW_PERIOD)
        if swarm.balanced():
            break
    assert swarm.balanced(), (swarm.counts(), swarm.moves)
    assert len(swarm.moves) <= squares // 2
    before = len(swarm.moves)
    for _ in range(2 * per_move):
        swarm.period(SLOW_PERIOD)
    assert len(swarm.moves) == before, swarm.moves[before:]  # no oscillation
    movable_stages = {s for p, s in swarm.stage.items() if p not in swarm.pinned}
    if movable_stages:
        assert max(swarm.counts()[s] for s in movable_stages) - min(swarm.counts()) <= 1


def test_two_dead_middle_replicas_are_replaced_by_one_peer():
    swarm = SimSwarm(3)
    for peer, stage in zip(peers(6), [0, 0, 1, 1, 2, 2]):
        swarm.join(peer, stage)
    for _ in range(int(JOIN_GRACE / PERIOD) + 1):
        assert not swarm.period(PERIOD)
    swarm.leave("peer2"), swarm.leave("peer3")
    killed_at, moved_at = swarm.now, None
    for _ in range(10):
        if swarm.period(PERIOD):
            moved_at = swarm.now
            break
    assert swarm.counts() == (1, 1, 2)  # the donor is the lowest of the most served stages
    assert DOWN_GRACE <= moved_at - killed_at <= DOWN_GRACE + 2 * PERIOD  # the grace, then the next check
    for _ in range(200):
        assert not swarm.period(PERIOD)


def test_a_peer_that_just_started_does_not_move():
    swarm = SimSwarm(3)
    for peer, stage in zip(peers(4), [0, 0, 0, 2]):  # what a half-filled map looks like at start
        swarm.join(peer, stage)
    while not swarm.moves:
        swarm.period(PERIOD)
    assert swarm.now >= JOIN_GRACE
    assert swarm.moves[0][2].to_stage == 1


def test_the_old_rule_stalled_here_and_a_balanced_swarm_never_moves():
    swarm = SimSwarm(3)
    for peer, stage in zip(peers(5), [0, 1, 1, 2, 2]):
        swarm.join(peer, stage)
    for _ in range(int(2 * STAGE_COOLDOWN / PERIOD)):
        assert not swarm.period(PERIOD)


def test_an_imbalance_waits_its_grace_and_the_stage_cooldown():
    swarm = SimSwarm(2)
    for peer, stage in zip(peers(6), [0, 0, 0, 0, 0, 1]):
        swarm.join(peer, stage)
    while not swarm.moves:
        swarm.period(PERIOD)
    assert swarm.now >= STAGE_COOLDOWN  # a peer that just started does not know the last moves
    first = swarm.now
    while len(swarm.moves) < 2:
        swarm.period(PERIOD)
    assert swarm.now - first >= STAGE_COOLDOWN
    assert swarm.counts() == (3, 3)


@given(populations(max_peers=12), st.integers(0, 3))
def test_at_most_one_move_per_period_and_the_mover_is_the_lowest_movable(population, seed):
    swarm = swarm_of(population, seed)
    for _ in range(int(STAGE_COOLDOWN / PERIOD) + 20):
        before = dict(swarm.stage)
        moves = swarm.period(PERIOD)
        assert len(moves) <= 1
        for peer, move in moves:
            assert peer not in swarm.pinned
            cooling = {p for at, p, _ in swarm.moves[:-1] if swarm.now - at < PEER_COOLDOWN}
            donors = [p for p, s in before.items() if s == move.from_stage and p not in swarm.pinned | cooling]
            assert peer == min(donors, key=rank)


def test_a_pinned_stage_gives_nothing():
    swarm = SimSwarm(2)
    for peer in peers(4):
        swarm.join(peer, 0, pinned=True)
    for _ in range(100):
        assert not swarm.period(PERIOD)
    assert swarm.counts() == (4, 0)


def test_delay_is_the_jitter():
    core = Rebalancer("me", 3, random.Random(1))
    delays = [core.delay() for _ in range(200)]
    assert all(0.0 <= d <= MOVE_JITTER for d in delays) and max(delays) - min(delays) > MOVE_JITTER / 2


def test_a_peer_counted_once_and_missing_stages_are_empty():
    assert counts({0: ["a", "a", "b"], 2: ["c"]}, 3) == (2, 0, 1)


def test_import_is_torch_and_trio_free():
    code = "import p2pswarm.heal.rebalance, sys; assert not {'torch', 'trio'} & set(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True)


class Churn(RuleBasedStateMachine):
    """Peers join, die and rebalance as time passes: no stage is ever emptied by a move, at most one
    peer moves per period, at most one out of a stage per STAGE_COOLDOWN unless its target was down,
    a pinned peer never moves."""

    @initialize(n_stages=st.integers(1, 4), seed=st.integers(0, 3))
    def start(self, n_stages, seed):
        self.swarm = SimSwarm(n_stages, seed)
        self.next_id = 0
        self.last_out: dict[int, float] = {}

    @rule(stage=st.integers(0, 3), pinned=st.booleans())
    def join(self, stage, pinned):
        self.swarm.join(f"peer{self.next_id}", stage % self.swarm.n_stages, pinned)
        self.next_id += 1

    @precondition(lambda self: self.swarm.stage)
    @rule(index=st.integers(0, 100))
    def die(self, index):
        self.swarm.leave(sorted(self.swarm.stage)[index % len(self.swarm.stage)])

    @rule(periods=st.integers(1, 80))
    def run(self, periods):
        for _ in range(periods):
            before = self.swarm.counts()
            moves = self.swarm.period(PERIOD)
            assert len(moves) <= 1
            for peer, move in moves:
                assert peer not in self.swarm.pinned
                assert before[move.from_stage] >= 2  # never emptied by the move
                if before[move.to_stage] > 0:
                    assert self.swarm.now - self.last_out.get(move.from_stage, -STAGE_COOLDOWN) >= STAGE_COOLDOWN
                self.last_out[move.from_stage] = self.swarm.now

    @invariant()
    def pinned_peers_stay(self):
        assert all(peer not in self.swarm.pinned for _, peer, _ in self.swarm.moves)


TestChurn = Churn.TestCase


@pytest.mark.parametrize("count, donors, want", [
    ([2, 0, 2], [0, 2], (0, 1)), ([2, 1, 2], [0, 1, 2], None), ([4, 1, 1], [0], (0, 1)), ([4, 0], [], None),
    ([3, 3, 0], [1], (1, 2)), ([1], [0], None)])
def test_wanted_examples(count, donors, want):
    assert wanted(count, donors) == want


@pytest.mark.parametrize("flags, rebalance", [([], True), (["--layers", "0:2"], False),
                                              (["--layers", "0:2", "--rebalance"], True),
                                              (["--no-rebalance"], False)])
def test_join_rebalances_by_default_only_with_layers_auto(flags, rebalance):
    from p2pswarm.cli import build_parser, config_from_args

    boot = "/ip4/1.2.3.4/tcp/4001/p2p/12D3KooWC4p8cVcVJXqt72KsBpXPXDKQtfn7YXyuMP4RMEUkfFiF"
    config = config_from_args(build_parser().parse_args(["join", "--bootstrap", boot, "--model", "tiny-lm", *flags]))
    assert config.rebalance is rebalance


def test_join_takes_a_backup_budget():
    from p2pswarm.cli import build_parser, config_from_args
    from p2pswarm.errors import ConfigError
    from p2pswarm.node.config import DEFAULT_BACKUP_BUDGET_MB

    boot = "/ip4/1.2.3.4/tcp/4001/p2p/12D3KooWC4p8cVcVJXqt72KsBpXPXDKQtfn7YXyuMP4RMEUkfFiF"
    parse = build_parser().parse_args
    assert config_from_args(parse(["join", "--bootstrap", boot])).backup_budget_mb == DEFAULT_BACKUP_BUDGET_MB
    assert config_from_args(parse(["join", "--bootstrap", boot, "--backup-budget-mb", "10"])).backup_budget_mb == 10
    with pytest.raises(ConfigError, match="--backup-budget-mb"):
        config_from_args(parse(["join", "--bootstrap", boot, "--backup-budget-mb", "-1"]))


def record(peer: str, stage: int, timestamp: float = 1000.0, pinned: bool = False):
    from p2pswarm.dht.records import FLAG_PINNED, Capacity, StageRecord

    return StageRecord(peer, ("/ip4/127.0.0.1/tcp/1",), "tiny-lm/3", stage, *MODEL3.stage_range(stage),
                       Capacity(0, 0, FLAG_PINNED if pinned else 0), timestamp, 15.0)


def test_members_count_a_peer_once_in_its_newest_record_and_us_where_we_are():
    from p2pswarm.heal.mover import members_of

    stages = {0: [record("a", 0, 1000.0), record("me", 0)], 1: [record("a", 1, 1001.0), record("p", 1, pinned=True)],
              2: [record("b", 2, 1002.0)]}
    members, movable = members_of(stages, "me", 2)
    assert members == {1: ["a", "p"], 2: ["b", "me"]}
    assert movable == {"a", "b", "me"}


def test_the_mover_moves_the_elected_peer_once_and_then_stays():
    import trio
    import trio.testing

    from p2pswarm.heal.mover import Mover

    me = "me"
    assert rank(me) < rank("x")  # we are the elected peer of stage 0
    stage_of = {me: 0, "x": 0, "y": 2, "z": 2, "fake1": 1, "fake2": 1}  # both replicas of stage 1 are gone;
    moved_to = []  # two identities that did no work claim it

    class Map:
        async def current(self, wait=0.0):
            return {s: [record(p, s) for p, at in stage_of.items() if at == s] for s in range(3)}

        def workers(self):  # the fakes are never seen working (dht.work)
            return {s: {p for p, at in stage_of.items() if at == s and not p.startswith("fake")} for s in range(3)}

        def standings(self):  # nor do they answer
            from p2pswarm.dht.ranking import Standing

            return lambda peer: Standing.STRANGER if peer.startswith("fake") else Standing.VOUCHED

        async def refresh_stages(self, stages):
            pass

    async def move(stage):
        moved_to.append(stage)
        stage_of[me] = stage

    async def main():
        mover = Mover(stage_map=Map(), me=me, core=Rebalancer(me, 3, random.Random(0)),
                      stage=lambda: stage_of[me], move=move, clock=trio.current_time)
        with trio.move_on_after(STAGE_COOLDOWN * 3):
            await mover.run()
        return mover

    mover = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert moved_to == [1]
    assert mover.doc()["moves"] == 1 and mover.doc()["last_move"]["to"] == 1
    assert "balanced" in mover.doc()["last_decision"]


def test_a_down_stage_elects_the_same_mover_whatever_each_peer_saw_of_earlier_moves():
    """X (the lower rank) moved 150 s ago (its own cooldown) and Y joined after that move (it never saw it): their
    histories differ, yet exactly one of them moves into the down stage (they once elected each other)."""
    a, b = Rebalancer("peer-x", 3, random.Random(1)), Rebalancer("peer-y", 3, random.Random(2))
    a.observe({0: ["peer-x", "c"], 1: ["b0", "b1"], 2: ["d", "e"]}, {"peer-x", "c"}, 0.0)
    a.moved(0, 1, 100.0)
    members = {0: [], 1: ["peer-x", "peer-y"], 2: ["d", "e"]}
    movable = {"peer-x", "peer-y", "d", "e"}
    for view in (a, b):
        view.observe(members, movable, 200.0)
        view.observe(members, movable, 240.0)
    moves = [view.observe(members, movable, 250.0) for view in (a, b)]
    assert sum(move is not None for move in moves) == 1, (moves, a.last, b.last)

"""Properties of the replica rule (p2pswarm.model.assignment): who moves, where to, and when."""

import random
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from p2pswarm.model.assignment import (
    GAP_GRACE, GAP_JITTER, MOVE_FROM_REPLICAS, TARGET_REPLICAS, GapClock, choose_stage, gaps,
)

AGES = st.floats(0.0, 3 * (GAP_GRACE + GAP_JITTER), allow_nan=False)
NOW = st.floats(0.0, 1e9, allow_nan=False)


@st.composite
def swarms(draw):
    replicas = draw(st.lists(st.integers(0, 6), min_size=1, max_size=8))
    mine = draw(st.integers(0, len(replicas) - 1))
    replicas[mine] = max(replicas[mine], 1)  # the counts include this peer
    return replicas, mine


@given(swarms(), AGES, NOW, st.integers())
def test_moves_only_from_a_crowded_stage_to_an_empty_one_after_the_grace(swarm, age, now, seed):
    replicas, mine = swarm
    stage = choose_stage(replicas, mine, age, now, random.Random(seed))
    if stage != mine:
        assert replicas[mine] >= MOVE_FROM_REPLICAS
        assert replicas[mine] - 1 >= TARGET_REPLICAS  # the stage left behind keeps the target
        assert replicas[stage] == 0
        assert age >= GAP_GRACE


@given(swarms(), st.floats(0.0, GAP_GRACE, exclude_max=True), NOW, st.integers())
def test_never_moves_before_the_grace(swarm, age, now, seed):
    replicas, mine = swarm
    assert choose_stage(replicas, mine, age, now, random.Random(seed)) == mine


@given(swarms(), AGES, NOW, st.integers())
def test_deterministic_for_a_seeded_random(swarm, age, now, seed):
    replicas, mine = swarm
    first = choose_stage(replicas, mine, age, now, random.Random(seed))
    assert all(choose_stage(replicas, mine, age, now, random.Random(seed)) == first for _ in range(3))


@given(swarms(), st.floats(GAP_GRACE + GAP_JITTER, 1e6), NOW, st.integers())
def test_always_moves_once_grace_and_jitter_have_passed(swarm, age, now, seed):
    replicas, mine = swarm
    stage = choose_stage(replicas, mine, age, now, random.Random(seed))
    if replicas[mine] >= MOVE_FROM_REPLICAS and gaps(replicas):
        assert stage in gaps(replicas)
    else:
        assert stage == mine


def test_jitter_spreads_the_movers():
    ages = [GAP_GRACE + GAP_JITTER * k / 10 for k in range(11)]
    moved = [sum(choose_stage([0, 5], 1, age, 0.0, random.Random(seed)) == 0 for seed in range(200))
             for age in ages]
    assert moved[0] < 20 and moved[-1] == 200  # few move at the grace, all once the jitter is over
    assert moved == sorted(moved)


@pytest.mark.parametrize("replicas, mine", [([], 0), ([2], 1), ([2], -1), ([0, 3], 0), ([-1, 3], 1),
                                            ([True, 3], 1), ([3], 0.0)])
def test_local_misuse_raises(replicas, mine):
    with pytest.raises(ValueError):
        choose_stage(replicas, mine, 0.0, 0.0, random.Random(0))


@given(st.lists(st.tuples(st.lists(st.integers(0, 3), min_size=1, max_size=4), st.floats(0, 100)),
                max_size=20))
def test_gap_clock_measures_the_unbroken_gap(observations):
    clock, now, since = GapClock(), 0.0, None
    for replicas, step in observations:
        now += step
        clock = clock.observe(replicas, now)
        since = (since if since is not None else now) if gaps(replicas) else None
        assert clock.since == since
        assert clock.age(now) == (0.0 if since is None else now - since)


def test_import_is_torch_free():
    code = "import p2pswarm.model.assignment, sys; assert not {'torch', 'trio'} & set(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True)


class ReplicaSwarm(RuleBasedStateMachine):
    """Peers join, die and apply the rule as time passes: moves never break the target."""

    @initialize(stages=st.integers(1, 4), seed=st.integers())
    def start(self, stages, seed):
        self.peers: list[int] = []  # each peer's stage
        self.rngs: list[random.Random] = []
        self.stages, self.seed = stages, seed
        self.now = 0.0
        self.clock = GapClock().observe(self.counts(), self.now)

    def counts(self):
        return [self.peers.count(s) for s in range(self.stages)]

    @rule(stage=st.integers(0, 3))
    def join(self, stage):
        self.peers.append(stage % self.stages)
        self.rngs.append(random.Random(f"{self.seed}/{len(self.rngs)}"))
        self.clock = self.clock.observe(self.counts(), self.now)

    @precondition(lambda self: self.peers)
    @rule(index=st.integers(0, 100))
    def die(self, index):
        del self.peers[index % len(self.peers)], self.rngs[index % len(self.rngs)]
        self.clock = self.clock.observe(self.counts(), self.now)

    @rule(dt=st.floats(0.0, GAP_JITTER))
    def tick(self, dt):
        self.now += dt
        self.clock = self.clock.observe(self.counts(), self.now)
        for i, stage in enumerate(self.peers):
            before = self.counts()
            new = choose_stage(before, stage, self.clock.age(self.now), self.now, self.rngs[i])
            if new != stage:
                assert before[stage] >= MOVE_FROM_REPLICAS and before[new] == 0
                assert self.clock.age(self.now) >= GAP_GRACE
                self.peers[i] = new  # the others see the move at once: the gap is closed
                assert self.counts()[stage] >= TARGET_REPLICAS
            self.clock = self.clock.observe(self.counts(), self.now)

    @invariant()
    def gap_clock_follows_the_gaps(self):
        assert (self.clock.since is None) == (not gaps(self.counts()))


TestReplicaSwarm = ReplicaSwarm.TestCase

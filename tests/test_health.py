"""heal.health: stage levels, the watch that reports real changes only, stage 0's block verdict, backups' age."""

from __future__ import annotations

import logging

import pytest
from hypothesis import given
from hypothesis import strategies as st

from p2pswarm.dht.health import (
    BLOCK_AFTER_S,
    FLAP_S,
    HEALTHY_REPLICAS,
    AgreedRounds,
    BlockWatch,
    Change,
    Health,
    HealthWatch,
    blocked_reason,
    health_doc,
    known_counts,
    level_of,
    stage_health,
)

N_STAGES = 4
counts_st = st.dictionaries(st.integers(0, N_STAGES - 1), st.integers(0, 4))
# a run of observations: each a gap in seconds since the previous one and the counts seen (absent: unknown)
runs_st = st.lists(st.tuples(st.floats(0.0, 3 * FLAP_S), counts_st), max_size=40)

HINT = "; more peers on it would help (p2pswarm join --layers auto)"  # what a warning tells the operator


def timed(run):
    now, out = 0.0, []
    for gap, counts in run:
        now += gap
        out.append((now, counts))
    return out


@given(counts_st)
def test_every_stage_has_a_level_and_a_missing_stage_is_down(counts):
    levels = stage_health(counts, N_STAGES)
    assert set(levels) == set(range(N_STAGES))
    for stage, level in levels.items():
        n = counts.get(stage, 0)
        assert level is (Health.HEALTHY if n >= HEALTHY_REPLICAS else Health.DEGRADED if n == 1 else Health.DOWN)


def test_levels_by_replicas():
    assert [level_of(n) for n in (0, 1, 2, 5)] == [Health.DOWN, Health.DEGRADED, Health.HEALTHY, Health.HEALTHY]


def test_known_counts_leave_unlooked_stages_unknown_until_a_whole_map_was_built():
    stages = {0: ["a", "b"], 2: []}
    assert known_counts(stages, 3, complete=False) == {0: 2, 2: 0}
    assert known_counts(stages, 3, complete=True) == {0: 2, 1: 0, 2: 0}


@given(runs_st)
def test_the_watch_reports_a_chain_of_real_changes_never_the_same_level_twice(run):
    watch, last = HealthWatch(), {}
    for now, counts in timed(run):
        changes = watch.observe(counts, now)
        for stage, n in counts.items():
            if stage not in last and level_of(n) is Health.HEALTHY:
                last[stage] = Health.HEALTHY  # first seen healthy: the baseline, said nothing
        for change in changes:
            assert change.after is level_of(counts[change.stage]) and change.replicas == counts[change.stage]
            assert change.before is last.get(change.stage)  # each change starts where the last one ended
            assert change.after is not change.before
            if change.before is None:
                assert change.after is not Health.HEALTHY  # a stage healthy from the start is no news
            last[change.stage] = change.after
    assert all(watch.levels()[stage] is level for stage, level in last.items())


@given(runs_st, st.integers(0, 4))
def test_a_level_that_holds_is_reported_in_the_end(run, final):
    watch = HealthWatch()
    timeline = timed(run)
    end = timeline[-1][0] if timeline else 0.0
    for now, counts in timeline:
        watch.observe(counts, now)
    watch.observe({1: final}, end + 1.0)
    watch.observe({1: final}, end + 2.0 + FLAP_S)
    assert watch.levels()[1] is level_of(final)


def test_a_flap_within_the_hold_is_not_reported_and_a_loss_that_holds_is():
    watch = HealthWatch(hold_s=5.0)
    assert watch.observe({0: 2, 1: 2}, 0.0) == []
    assert watch.observe({1: 0}, 1.0) == []  # one lookup missed both records
    assert watch.observe({1: 2}, 2.0) == []  # ... and they were back: nothing happened
    assert watch.observe({1: 0}, 10.0) == []
    assert watch.observe({1: 0}, 15.0) == [Change(1, Health.HEALTHY, Health.DOWN, 0, 2)]
    assert watch.observe({1: 0}, 30.0) == []  # reported once
    assert watch.observe({1: 2}, 31.0) == []
    [back] = watch.observe({1: 3}, 36.0)
    assert back.message() == "stage 1 is healthy again: 3 live replicas (was down: 0)"
    assert back.log_level == logging.INFO


def test_change_lines():
    down = Change(1, Health.HEALTHY, Health.DOWN, 0, 2)
    assert down.message() == "stage 1 is down: 0 live replicas (was healthy: 2)" + HINT
    assert Change(2, None, Health.DEGRADED, 1).message() == "stage 2 is degraded: 1 live replica" + HINT
    assert Change(2, None, Health.DEGRADED, 1).log_level == logging.WARNING


def test_the_first_look_reports_degraded_and_down_stages_only_once_they_held():
    watch = HealthWatch(hold_s=5.0)
    assert watch.observe({0: 2, 1: 1, 2: 0, 3: 0}, 0.0) == []  # a map still filling up at start is no news yet
    assert watch.observe({0: 2, 1: 1, 2: 0, 3: 2}, 4.0) == []  # stage 3 was only late: a healthy start
    changes = watch.observe({0: 2, 1: 1, 2: 0, 3: 2}, 5.0)
    assert [(c.stage, c.before, c.after) for c in changes] == [(1, None, Health.DEGRADED), (2, None, Health.DOWN)]
    assert watch.levels() == {0: Health.HEALTHY, 1: Health.DEGRADED, 2: Health.DOWN, 3: Health.HEALTHY}


@pytest.mark.parametrize("down, reason", [
    ((), None),
    ((2,), "stage 2 is down; waiting for a peer to take it"),
    ((2, 1), "stages 1 and 2 are down; waiting for peers to take them"),
    ((0, 1, 2), "stages 0, 1 and 2 are down; waiting for peers to take them"),
    ((1, 2, 3, 4, 5), "stages 1, 2, 3 and 2 more are down; waiting for peers to take them"),
])
def test_blocked_reasons(down, reason):
    levels = {stage: Health.HEALTHY for stage in range(6)} | {stage: Health.DOWN for stage in down}
    levels[0] = Health.DOWN if 0 in down else Health.DEGRADED
    assert blocked_reason(levels) == reason


@given(runs_st)
def test_stage_0_is_blocked_only_by_a_stage_seen_down_without_a_break_for_the_whole_hold(run):
    watch, timeline = BlockWatch(serving=0), timed(run)
    for i, (now, counts) in enumerate(timeline):
        line = watch.observe(counts, now)
        for stage in watch.down:
            assert stage != 0  # our own stage never blocks us
            seen = [(t, c[stage]) for t, c in timeline[:i + 1] if stage in c]
            assert seen and seen[-1][1] == 0
            last_up = max((j for j, (_, n) in enumerate(seen) if n > 0), default=-1)
            first_down = seen[last_up + 1][0]  # the start of the unbroken run of down observations
            assert now - first_down >= BLOCK_AFTER_S
        assert (watch.reason is None) == (not watch.down)
        if line is not None:
            assert line == (f"not training: {watch.reason}" if watch.down else line)
            assert watch.down or line.endswith("up again: training resumes")


def test_stage_0_says_once_why_it_stops_and_once_that_it_resumes():
    watch = BlockWatch(after_s=5.0, serving=0)
    assert watch.observe({0: 0, 1: 2, 2: 0}, 0.0) is None and watch.reason is None  # not yet: maybe one bad lookup
    assert watch.observe({2: 0}, 3.0) is None
    assert watch.observe({1: 2, 2: 0}, 5.0) == "not training: stage 2 is down; waiting for a peer to take it"
    assert watch.observe({1: 2, 2: 0}, 6.0) is None and watch.reason.startswith("stage 2 is down")
    assert watch.observe({1: 0, 2: 0}, 7.0) is None
    assert watch.observe({1: 0, 2: 0}, 12.0) == "not training: stages 1 and 2 are down; waiting for peers to take them"
    assert watch.observe({1: 1, 2: 1}, 13.0) == "stages 1 and 2 are up again: training resumes"
    assert watch.reason is None and watch.observe({1: 1, 2: 1}, 14.0) is None


def test_a_down_stage_that_comes_back_before_the_hold_never_blocks():
    watch = BlockWatch(after_s=5.0)
    for now in range(0, 40, 2):
        assert watch.observe({1: 0 if now % 4 == 0 else 1}, float(now)) is None
    assert watch.reason is None


@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 200)), max_size=60))
def test_agreed_rounds_keep_their_first_sighting_and_stay_bounded(sightings):
    agreed, first = AgreedRounds(keep=8), {}
    for now, (stage, round_) in enumerate(sightings):
        agreed.note(stage, [round_], float(now))
        first.setdefault((stage, round_), float(now))
    for stage in range(3):
        rounds = sorted({r for s, r in first if s == stage})
        assert agreed.newest(stage) == (rounds[-1] if rounds else None)
        for round_ in rounds[-8:]:
            assert agreed.age(stage, round_, 1000.0) == 1000.0 - first[(stage, round_)]
        for round_ in rounds[:-8]:
            assert agreed.age(stage, round_, 1000.0) is None  # forgotten: unknown, never wrong


def test_health_doc():
    assert health_doc({0: 2, 1: 0, 2: 1}) == {
        "stages": {"0": "healthy", "1": "down", "2": "degraded"},
        "blocked": "stage 1 is down; waiting for a peer to take it"}
    assert health_doc({0: 3})["blocked"] is None


def test_stage_0s_service_stops_feeding_while_blocked_and_shows_why():
    import trio
    import trio.testing

    from p2pswarm.model.catalog import get_model
    from p2pswarm.swarm.service import SwarmService

    class Map:
        async def current(self, wait=0.0):
            return {}

        def counts(self, claimed=False):
            return {0: 1, 1: 0}

    async def main():
        service = SwarmService(spec=get_model("tiny-lm/2"), stage=0, me="me", pool=None, stage_map=Map(), host=None)
        service.blocks = BlockWatch(after_s=0.0, serving=0)
        assert service.doc()["blocked"] is None
        await service._check_blocked()
        assert service.doc()["blocked"] == "stage 1 is down; waiting for a peer to take it"
        with trio.move_on_after(60):  # virtual seconds (MockClock): _feed waits before the router or the corpus
            await service._feed(corpus=None)
        assert service._local_queued == 0 and service.inbound.stats(trio.current_time()).offered == 0

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))

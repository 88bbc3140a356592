"""The pure buffers and engine accounting: order, bounds, explicit backpressure, exact statistics."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from p2pswarm.errors import ConfigError
from p2pswarm.swarm.buffers import (
    INBOUND,
    OUTBOUND,
    BufferConfig,
    EngineLedger,
    Offer,
    Outcome,
    Priority,
    PriorityBuffer,
    TimeWeighted,
    hand_on,
    inbound_buffer,
    outbound_queue,
)

PRIORITIES = st.sampled_from(list(Priority))
SIZES = st.integers(0, 50)
STEPS = st.integers(0, 5)  # time advances by whole seconds: hand-checkable, float-exact
CONFIGS = st.builds(BufferConfig, st.integers(1, 6), st.one_of(st.none(), st.integers(1, 120)))
OPS = st.lists(st.one_of(st.tuples(st.just("offer"), PRIORITIES, SIZES, STEPS),
                         st.tuples(st.just("take"), STEPS)), max_size=60)


def expected_verdict(config: BufferConfig, held: list, size: int) -> Offer:
    cap = config.capacity_bytes
    if cap is not None and size > cap:
        return Offer.TOO_LARGE
    if len(held) >= config.capacity_items or (cap is not None and sum(h[3] for h in held) + size > cap):
        return Offer.FULL
    return Offer.ACCEPTED


@given(CONFIGS, OPS)
def test_buffer_matches_a_sorted_list_model(config, ops):
    """Order by priority then arrival; never over capacity; take on empty is None."""
    buf, now, seq, model = PriorityBuffer(config, 0), 0, 0, []
    for op in ops:
        now += op[-1]
        if op[0] == "offer":
            _, priority, size, _ = op
            verdict = expected_verdict(config, model, size)
            assert buf.offer(seq, priority, now, size) is verdict
            if verdict.accepted:
                model.append((priority, seq, now, size))
                model.sort()
            seq += 1
        else:
            entry = buf.take(now)
            if not model:
                assert entry is None
            else:
                priority, item, at, size = model.pop(0)
                assert (entry.priority, entry.item, entry.offered_at, entry.size) == (priority, item, at, size)
        assert len(buf) == len(model) <= config.capacity_items
        assert buf.bytes == sum(m[3] for m in model)
        if config.capacity_bytes is not None:
            assert buf.bytes <= config.capacity_bytes


@given(CONFIGS, OPS)
def test_every_offer_is_counted_as_accepted_or_refused(config, ops):
    buf, now, offers = PriorityBuffer(config, 0), 0, {p: [0, 0] for p in Priority}
    for op in ops:
        now += op[-1]
        if op[0] == "offer":
            accepted = buf.offer("x", op[1], now, op[2]).accepted
            offers[op[1]][0] += 1
            offers[op[1]][1] += accepted
        else:
            buf.take(now)
    stats = buf.stats(now)
    assert [c.priority for c in stats.counts] == list(Priority)
    for c in stats.counts:
        assert c.offered == c.accepted + c.refused == offers[c.priority][0]
        assert c.accepted == offers[c.priority][1]
    assert stats.offered == stats.accepted + stats.refused
    assert 0.0 <= stats.mean_fill <= 1.0
    assert stats.peak_items <= config.capacity_items


@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 9)), max_size=30), st.integers(0, 9))
def test_time_weighted_mean_is_the_exact_step_integral(changes, tail):
    tw, now, area, level = TimeWeighted(0), 0, 0, 0
    for dt, new_level in changes:
        area += level * dt
        now += dt
        tw.set(now, new_level)
        level = new_level
    end = now + tail
    area += level * tail
    assert tw.area_until(end) == area
    assert tw.mean(end) == (area / end if end else level)


def test_mean_occupancy_on_a_hand_built_timeline():
    buf = PriorityBuffer(BufferConfig(2), start=10)
    assert buf.offer("a", Priority.TRAINING_FORWARD, 10) is Offer.ACCEPTED  # 1 item from 10
    assert buf.offer("b", Priority.INFERENCE, 12) is Offer.ACCEPTED  # 2 items from 12
    assert buf.offer("c", Priority.INFERENCE_URGENT, 13) is Offer.FULL  # said so, not dropped silently
    assert buf.take(14).item == "b"  # 1 item from 14
    assert buf.take(18).item == "a"  # empty from 18
    assert buf.take(19) is None
    stats = buf.stats(20)  # area 2*1 + 2*2 + 4*1 + 2*0 = 10 over 10 s
    assert stats.mean_items == 1.0 and stats.mean_fill == 0.5 and stats.peak_items == 2
    assert stats.counts[Priority.INFERENCE_URGENT].refused == 1
    assert (stats.offered, stats.accepted, stats.refused) == (3, 2, 1)


def test_byte_capacity_is_explicit():
    buf = PriorityBuffer(BufferConfig(10, capacity_bytes=100), start=0)
    assert buf.offer("big", Priority.INFERENCE, 0, size=101) is Offer.TOO_LARGE
    assert buf.offer("a", Priority.INFERENCE, 0, size=60) is Offer.ACCEPTED
    assert buf.room_for(41) is Offer.FULL and buf.offer("b", Priority.INFERENCE, 0, size=41) is Offer.FULL
    assert buf.offer("c", Priority.INFERENCE, 0, size=40) is Offer.ACCEPTED
    assert buf.room_for(1) is Offer.FULL and buf.bytes == 100  # only an empty item still fits


def test_misuse_raises_at_once():
    with pytest.raises(ConfigError):
        BufferConfig(0)
    with pytest.raises(ConfigError):
        BufferConfig(1, capacity_bytes=0)
    buf = PriorityBuffer(BufferConfig(1), start=5)
    with pytest.raises(ValueError):
        buf.offer("x", Priority.INFERENCE, 4)
    with pytest.raises(ValueError):
        buf.offer("x", Priority.INFERENCE, 5, size=-1)
    ledger = EngineLedger(0)
    with pytest.raises(ValueError):
        ledger.finish(1, Outcome.SENT)
    ledger.begin(1)
    with pytest.raises(ValueError):
        ledger.begin(2)


def test_inbound_and_outbound_defaults():
    assert inbound_buffer(0).config == INBOUND and outbound_queue(0).config == OUTBOUND
    assert INBOUND.capacity_items >= OUTBOUND.capacity_items >= 1


def test_soft_overflow_counts_a_local_only_step_and_goes_on():
    out, ledger = outbound_queue(0, BufferConfig(1)), EngineLedger(0)
    for t in range(3):
        ledger.begin(2 * t)
        ledger.finish(2 * t + 1, hand_on(out, t, Priority.TRAINING_FORWARD, 2 * t + 1))
    ledger.drop()
    stats = ledger.stats(6)
    assert (stats.steps, stats.local_only, stats.drops) == (3, 2, 1)
    assert stats.local_only_rate == 2 / 3
    assert stats.busy_fraction == 0.5  # busy [0,1], [2,3], [4,5] of [0,6]
    assert out.stats(6).counts[Priority.TRAINING_FORWARD].refused == 2


def test_busy_fraction_on_hand_built_timelines():
    ledger = EngineLedger(100)
    assert ledger.stats(100).busy_fraction == 0.0  # no time has passed
    ledger.begin(100)
    assert ledger.stats(104).busy_fraction == 1.0  # an ongoing micro-batch counts until now
    ledger.finish(104, Outcome.DROPPED)
    ledger.begin(106)
    ledger.finish(107, Outcome.SENT)
    stats = ledger.stats(110)  # busy 4 + 1 of 10
    assert stats.busy_fraction == 0.5 and stats.drops == 1 and stats.steps == 1
    assert stats.elapsed == 10
    late = EngineLedger(0)  # the swarm formed at 10: idle before it is not the engine's
    late.begin(10)
    late.finish(14, Outcome.SENT)
    assert late.stats(15).busy_since_first == 0.8 and late.stats(15).busy_fraction == 4 / 15


@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 5), st.sampled_from(list(Outcome))), max_size=30),
       st.integers(0, 5), st.booleans())
def test_busy_fraction_is_the_exact_share_and_within_bounds(work, tail, end_busy):
    ledger, now, busy, counts = EngineLedger(0), 0, 0, {o: 0 for o in Outcome}
    for idle, length, outcome in work:
        now += idle
        ledger.begin(now)
        now += length
        busy += length
        ledger.finish(now, outcome)
        counts[outcome] += 1
    if end_busy:
        ledger.begin(now)
        busy += tail
    end = now + tail
    stats = ledger.stats(end)
    assert 0.0 <= stats.busy_fraction <= 1.0
    assert stats.busy_fraction == (busy / end if end else 0.0)
    first = next((sum(i for i, _, _ in work[:k + 1]) + sum(n for _, n, _ in work[:k])
                  for k in range(len(work))), now if end_busy else None)  # the first begin
    since = end - first if first is not None else 0
    assert stats.busy_since_first == (busy / since if since else 0.0) >= stats.busy_fraction - 1e-12
    assert stats.steps == counts[Outcome.SENT] + counts[Outcome.LOCAL_ONLY]
    assert stats.local_only == counts[Outcome.LOCAL_ONLY] and stats.drops == counts[Outcome.DROPPED]
    assert 0.0 <= stats.local_only_rate <= 1.0


class BufferMachine(RuleBasedStateMachine):
    """The buffer next to a sorted-list model, with time moving forward between operations."""

    @initialize(config=CONFIGS)
    def start(self, config):
        self.config = config
        self.buf = PriorityBuffer(config, 0)
        self.now, self.seq, self.model = 0, 0, []
        self.offered = self.refused = 0

    @rule(dt=STEPS)
    def tick(self, dt):
        self.now += dt

    @rule(priority=PRIORITIES, size=SIZES)
    def offer(self, priority, size):
        verdict = expected_verdict(self.config, self.model, size)
        assert self.buf.offer(self.seq, priority, self.now, size) is verdict
        self.offered += 1
        if verdict.accepted:
            self.model.append((priority, self.seq, self.now, size))
            self.model.sort()
        else:
            self.refused += 1
        self.seq += 1

    @rule()
    def take(self):
        entry = self.buf.take(self.now)
        if not self.model:
            assert entry is None
        else:
            assert (entry.priority, entry.item) == self.model.pop(0)[:2]

    @invariant()
    def bounded_and_counted(self):
        stats = self.buf.stats(self.now)
        assert stats.items == len(self.model) <= self.config.capacity_items
        assert stats.offered == self.offered and stats.refused == self.refused
        assert 0.0 <= stats.mean_fill <= 1.0
        assert self.buf.full == (self.buf.room_for(0) is not Offer.ACCEPTED)


TestBufferMachine = BufferMachine.TestCase

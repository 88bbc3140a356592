"""The pure DiLoCo outer round (p2pswarm.diloco.round): unit tests per rule, and a simulated swarm.

Members run real ``OuterRound`` objects connected by a simulated network that holds every
message in flight (requests and their replies), so tests choose delivery order, duplicate,
drop, advance a clock, make a member send garbage or kill it. Each member's pseudo-gradient is
int32 elements all equal to ``1 << index``, and ``combine`` (the simulated driver's answer to a
``CombineShard``, at once or later) sums them after verifying each contribution is exactly its
sender's: a result's value therefore names the members combined.

Properties, checked by a RuleBasedStateMachine after every step: members that finished with
the same group hold identical results; a result's contributors are members of the group,
include its owner and never a garbage part; nobody sends a Part or Result outside its group or
with another group's digest; a member's group lies within the proposal of each other member of
it; only garbage senders are ever ``Rejected``; every message sent is valid on the wire. Liveness:
once the clock passes every deadline, every live started member is DONE or LEFT_OUT. With no drops,
garbage or kills and all members ready, every member finishes with the full group and every shard,
in any delivery order.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from p2pswarm import wire
from p2pswarm.diloco import messages
from p2pswarm.diloco.messages import Hello, Part, Reply, Result, group_digest, shard_bounds
from p2pswarm.diloco.round import (
    AGREE_S,
    GATHER_S,
    REDUCE_S,
    CatchUp,
    CombineShard,
    Finished,
    NeedShards,
    OuterRound,
    Phase,
    Rejected,
    RoundTiming,
    SendHello,
    SendPart,
    SendResult,
)

PEERS = ["p0", "p1", "p2", "p3"]
BIT = {peer: 1 << i for i, peer in enumerate(PEERS)}  # member i's pseudo-gradient: every element 1 << i
CODEC = "float32"  # int32 elements stand in for it: 4 bytes each, and the size is all the round sees
STAGE, ROUND = 2, 7
GARBAGE_VALUE = 0x7000  # a value no honest member sends (no sum of BITs reaches it)
FAR = GATHER_S + AGREE_S + 2 * REDUCE_S + 1.0  # one step past every deadline of any phase
FAR_AFTER_STEPS = 15  # the machine checks liveness only once the members had a chance to talk


def pack(values: list[int]) -> bytes:
    return struct.pack(f"<{len(values)}i", *values)


def unpack(data: bytes) -> list[int]:
    return list(struct.unpack(f"<{len(data) // 4}i", data))


def own_shards(peer: str, bounds) -> list[bytes]:
    return [pack([BIT[peer]] * (stop - start)) for start, stop in bounds]


def combine(contributions: dict[str, bytes], me: str) -> tuple[bytes, dict[str, str]]:
    """Exact sum after verification: a contribution must be its sender's own data."""
    sizes = {len(data) for data in contributions.values()}
    assert len(sizes) == 1, "the round passed contributions of different sizes"  # never a wrong-sized part
    total, rejected = [0] * (sizes.pop() // 4), {}
    for peer, data in sorted(contributions.items()):
        values = unpack(data)
        if any(v != BIT.get(peer) for v in values):
            rejected[peer] = "not its data"
            continue
        total = [t + v for t, v in zip(total, values)]
    return pack(total), rejected


def answer_combines(rnd: OuterRound, actions, now: float) -> list:
    """``actions`` with each CombineShard replaced by what the round does with its answer (a driver at once)."""
    out = []
    for action in actions:
        if isinstance(action, CombineShard):
            out += answer_combines(rnd, rnd.combined(*combine(action.parts, rnd.me), now), now)
        else:
            out.append(action)
    return out


def contributors_of(data: bytes) -> set[str] | None:
    """The members a result combined (None for an empty shard, which names nobody)."""
    values = set(unpack(data))
    if not values:
        return None
    assert len(values) == 1, f"a result mixes values {values}"
    value = values.pop()
    assert value & ~sum(BIT.values()) == 0, f"a result holds foreign data {value:#x}"
    return {peer for peer, bit in BIT.items() if value & bit}


GARBAGE_KINDS = ["numel", "bytes", "codec", "content", "digest"]  # digest: another group's, not a fault


def forge(msg: Part | Result, data: bytes, kind: str, src: str) -> tuple[Part | Result, bytes]:
    """A garbage version of ``msg``: wrong size, payload, codec, content or digest."""
    n = msg.numel
    if kind == "content" and (isinstance(msg, Result) or n == 0):
        kind = "bytes"  # results are not verified by the round (the driver does), an empty shard holds nothing
    return {
        "numel": lambda: (replace(msg, numel=n + 1), pack([BIT[src]] * (n + 1))),
        "bytes": lambda: (msg, data + b"\0\0\0\0"),
        "codec": lambda: (replace(msg, codec="float16"), b"\0\0" * n),
        "content": lambda: (msg, pack([GARBAGE_VALUE] * n)),
        "digest": lambda: (replace(msg, group=b"y" * 32), data),
    }[kind]()


@dataclass
class Flight:
    """One message in the network: a request (hello, part, result) or the reply to one."""

    kind: str  # "hello", "part", "result" (requests) or "reply" (the answer to any of them)
    src: str
    dst: str
    msg: object
    data: bytes = b""


class Swarm:
    """Members, the network between them, and what they did."""

    def __init__(self, peers, numel=10, timing=RoundTiming(), expected=None, auto_provide=True, auto_combine=True):
        self.peers, self.numel, self.now, self.auto_provide = list(peers), numel, 0.0, auto_provide
        self.auto_combine = auto_combine  # answer a CombineShard at once, or when a test says so (a slow thread)
        self.rounds = {
            p: OuterRound(me=p, stage=STAGE, round=ROUND, numel=numel, codec=CODEC,
                          expected=frozenset(self.peers if expected is None else expected[p]) - {p},
                          now=0.0, timing=timing, expected_bytes=messages.expected_bytes)
            for p in self.peers}
        self.flights: list[Flight] = []
        self.started: set[str] = set()
        self.dead: set[str] = set()
        self.need: dict[str, NeedShards] = {}
        self.combining: dict[str, CombineShard] = {}  # member -> the combine its driver has not answered yet
        self.outcomes: dict = {}
        self.rejected: list[tuple[str, str, str]] = []  # (by, peer, reason)
        self.catch_ups: list[tuple[str, CatchUp]] = []
        self.replies: list[tuple[str, Reply]] = []  # (who got it, the Reply)
        self.garble: dict[str, tuple[str, bool]] = {}  # member -> (garbage kind, instead of the real one?)
        self.garbage_senders: set[str] = set()

    # --- members act -------------------------------------------------------------------------

    def act(self, peer: str, actions) -> None:
        rnd = self.rounds[peer]
        for action in actions:
            if isinstance(action, SendHello):
                wire.encode_frame(action.hello)
                self.flights.append(Flight("hello", peer, action.peer, action.hello))
            elif isinstance(action, (SendPart, SendResult)):
                msg = action.part if isinstance(action, SendPart) else action.result
                wire.encode_frame(msg, action.data)
                assert rnd.group is not None and action.peer in rnd.group and action.peer != peer
                assert msg.group == group_digest(STAGE, ROUND, rnd.group) == rnd.digest
                kind = "part" if isinstance(action, SendPart) else "result"
                if peer in self.garble:
                    garbage, instead = self.garble[peer]
                    self.garbage_senders.add(peer)
                    self.flights.append(Flight(kind, peer, action.peer, *forge(msg, action.data, garbage, peer)))
                    if instead:
                        continue
                self.flights.append(Flight(kind, peer, action.peer, msg, action.data))
            elif isinstance(action, NeedShards):
                assert action.group == rnd.group and list(action.bounds) == shard_bounds(self.numel, len(rnd.group))
                self.need[peer] = action
                if self.auto_provide:
                    self.provide(peer)
            elif isinstance(action, CombineShard):
                assert peer not in self.combining and rnd.group is not None and action.shard == rnd.group.index(peer)
                assert peer in action.parts and action.numel == self.numel_of(peer, action.shard)
                self.combining[peer] = action
                if self.auto_combine:
                    self.answer_combine(peer)
            elif isinstance(action, Rejected):
                self.rejected.append((peer, action.peer, action.reason))
            elif isinstance(action, CatchUp):
                self.catch_ups.append((peer, action))
            else:
                assert isinstance(action, Finished) and peer not in self.outcomes, "Finished twice"
                self.outcomes[peer] = action.outcome

    def start(self, peer: str) -> None:
        self.started.add(peer)
        self.act(peer, self.rounds[peer].start(self.now))

    def start_all(self) -> None:
        for peer in self.peers:
            self.start(peer)

    def provide(self, peer: str) -> None:
        need = self.need.pop(peer)
        self.act(peer, self.rounds[peer].provide_shards(own_shards(peer, need.bounds), self.now))

    def numel_of(self, peer: str, shard: int) -> int:
        start, stop = shard_bounds(self.numel, len(self.rounds[peer].group))[shard]
        return stop - start

    def answer_combine(self, peer: str) -> None:
        """The driver's worker thread is done: hand the aggregate back to the round."""
        action = self.combining.pop(peer)
        self.act(peer, self.rounds[peer].combined(*combine(action.parts, peer), self.now))

    def tick(self, dt: float = 0.0) -> None:
        self.now += dt
        for peer in self.peers:
            if peer not in self.dead:
                self.act(peer, self.rounds[peer].tick(self.now))

    # --- the network -------------------------------------------------------------------------

    def deliver(self, index: int = 0) -> None:
        f = self.flights.pop(index)
        if f.kind == "reply":
            if f.dst not in self.dead and isinstance(f.msg, Hello):
                self.act(f.dst, self.rounds[f.dst].on_hello(f.src, f.msg, self.now)[1])
            elif f.dst not in self.dead:
                wire.encode_frame(f.msg)
                self.replies.append((f.dst, f.msg))
            return
        if f.dst in self.dead:  # the sender's driver sees its send fail
            if f.src not in self.dead:
                self.act(f.src, self.rounds[f.src].on_send_failed(f.dst, self.now))
            return
        rnd = self.rounds[f.dst]
        if f.kind == "hello":
            reply, actions = rnd.on_hello(f.src, f.msg, self.now)
        else:
            handler = rnd.on_part if f.kind == "part" else rnd.on_result
            reply, actions = handler(f.src, f.msg, f.data, self.now)
            if reply.accepted and reply.reason == "":  # used now: it must be for this member's group
                assert f.msg.group == rnd.digest
        wire.encode_frame(reply)
        self.act(f.dst, actions)
        self.flights.append(Flight("reply", f.dst, f.src, reply))

    def deliver_all(self, order=None) -> None:
        while self.flights:
            self.deliver(order.randrange(len(self.flights)) if order is not None else 0)

    def send(self, src: str, dst: str, msg, data: bytes = b"") -> None:
        kind = {Hello: "hello", Part: "part", Result: "result"}[type(msg)]
        self.flights.append(Flight(kind, src, dst, msg, data))


def expected_result(members, n: int) -> bytes:
    return pack([sum(BIT[p] for p in members)] * n)


def assert_full_success(swarm: Swarm, members) -> None:
    group = tuple(sorted(members))
    bounds = shard_bounds(swarm.numel, len(group))
    for peer in members:
        outcome = swarm.outcomes[peer]
        assert swarm.rounds[peer].phase is Phase.DONE
        assert (outcome.group, outcome.missing, outcome.left_out) == (group, (), False)
        assert outcome.results == {i: expected_result(group, b - a) for i, (a, b) in enumerate(bounds)}
        assert outcome.contributors == {i: len(group) for i in range(len(group))}


# --- unit tests, one rule at a time ----------------------------------------------------------


def test_happy_path_three_members_in_order():
    swarm = Swarm(PEERS[:3])
    swarm.start_all()
    swarm.deliver_all()
    assert_full_success(swarm, PEERS[:3])
    assert not swarm.rejected and not swarm.catch_ups
    assert all(r.next_deadline() is None for r in swarm.rounds.values())
    assert all(reply.accepted for _, reply in swarm.replies)


def test_a_member_never_ready_is_left_out_by_the_gather_deadline():
    swarm = Swarm(PEERS[:3])
    swarm.start("p0"), swarm.start("p1")
    swarm.deliver_all()
    assert swarm.rounds["p0"].phase is Phase.GATHER  # waiting for p2, who still trains
    assert swarm.rounds["p0"].next_deadline() == GATHER_S
    assert swarm.rounds["p2"].status() == Hello(STAGE, ROUND, 10, CODEC, False, False, ("p0", "p1"))
    swarm.tick(GATHER_S - 0.01)
    assert not swarm.flights
    swarm.tick(0.01)
    swarm.deliver_all()
    assert_full_success(swarm, ["p0", "p1"])
    swarm.start("p2")  # too late: the others answer with their group, without it
    swarm.deliver_all()
    assert swarm.outcomes["p2"].left_out and swarm.rounds["p2"].phase is Phase.LEFT_OUT
    assert swarm.rounds["p2"].status().closed and not swarm.rounds["p2"].status().ready  # it withdrew


def test_a_late_joiner_gets_a_closed_status_without_itself_and_is_left_out():
    swarm = Swarm(PEERS[:3], expected={"p0": ["p1"], "p1": ["p0"], "p2": PEERS[:3]})
    swarm.start("p0"), swarm.start("p1")
    swarm.deliver_all()
    assert_full_success(swarm, ["p0", "p1"])
    status = swarm.rounds["p0"].status()
    assert (status.ready, status.closed, status.members) == (True, True, ("p0", "p1"))
    swarm.start("p2")
    swarm.deliver(0)  # p2's ready Hello to p0, then p0's reply
    swarm.deliver(swarm.flights.index(next(f for f in swarm.flights if f.kind == "reply")))
    assert swarm.outcomes["p2"].left_out and swarm.outcomes["p2"].group == ("p0", "p1")  # who went on
    swarm.deliver_all()
    assert swarm.outcomes["p0"].group == ("p0", "p1")  # unchanged by the late joiner


@pytest.mark.parametrize("garbage", ["numel", "bytes", "codec", "content"])
def test_a_garbage_part_is_rejected_and_the_honest_members_finish(garbage):
    swarm = Swarm(PEERS[:3], numel=9)
    swarm.start_all()
    while not all(swarm.rounds[p].phase is Phase.REDUCE for p in PEERS[:3]):
        swarm.deliver(0)
    bad = swarm.rounds["p2"]
    part = next(f for f in swarm.flights if f.kind == "part" and f.src == "p2" and f.dst == "p0")
    swarm.flights.remove(part)  # p2 sends garbage to p0 instead of its part
    msg, n = part.msg, part.msg.numel
    forged = {
        "numel": (Part(**{**vars(msg), "numel": n + 1}), pack([BIT["p2"]] * (n + 1))),
        "bytes": (msg, pack([BIT["p2"]] * n) + b"\0\0\0\0"),
        "codec": (Part(**{**vars(msg), "codec": "float16"}), b"\0\0" * n),
        "content": (msg, pack([GARBAGE_VALUE] * n)),
    }[garbage]
    swarm.send("p2", "p0", *forged)
    swarm.deliver_all()
    assert [(by, peer) for by, peer, _ in swarm.rejected] == [("p0", "p2")]
    assert bad.phase is Phase.DONE
    for peer in PEERS[:3]:
        outcome = swarm.outcomes[peer]
        assert outcome.group == tuple(PEERS[:3]) and outcome.missing == ()
        assert contributors_of(outcome.results[0]) == {"p0", "p1"} and outcome.contributors[0] == 2
        assert contributors_of(outcome.results[1]) == contributors_of(outcome.results[2]) == set(PEERS[:3])
    refused = [reply for who, reply in swarm.replies if who == "p2" and not reply.accepted]
    assert len(refused) == (0 if garbage == "content" else 1)  # content fails verification, after the reply


def test_duplicates_are_ignored_and_counted():
    swarm = Swarm(PEERS[:3])
    swarm.start_all()
    sent = []
    while swarm.flights:
        flight = swarm.flights[0]
        if flight.kind != "reply":
            sent.append(flight)
        swarm.deliver(0)
    assert_full_success(swarm, PEERS[:3])
    outcomes = dict(swarm.outcomes)
    for flight in sent:  # every request again, after the round
        swarm.flights.append(Flight(flight.kind, flight.src, flight.dst, flight.msg, flight.data))
    swarm.deliver_all()
    assert swarm.outcomes == outcomes and not swarm.rejected
    assert sum(r.counts["late"] for r in swarm.rounds.values()) == sum(f.kind != "hello" for f in sent)


def test_duplicates_during_the_reduce_keep_the_first():
    swarm = Swarm(PEERS[:3], auto_provide=False)
    swarm.start_all()
    swarm.deliver_all()
    assert set(swarm.need) == set(PEERS[:3])
    swarm.provide("p1")
    part = next(f for f in swarm.flights if f.kind == "part" and f.dst == "p0")
    for _ in range(2):
        reply, actions = swarm.rounds["p0"].on_part("p1", part.msg, part.data, swarm.now)
        assert reply.accepted and actions == []
    assert swarm.rounds["p0"].counts["duplicates"] == 1
    reply, _ = swarm.rounds["p0"].on_part("p1", part.msg, pack([GARBAGE_VALUE] * part.msg.numel), swarm.now)
    assert (reply.accepted, reply.reason) == (True, "duplicate")  # the first one is kept
    swarm.provide("p0"), swarm.provide("p2")
    swarm.deliver_all()
    assert_full_success(swarm, PEERS[:3])


def test_catch_up_on_a_later_round():
    swarm = Swarm(PEERS[:2])
    swarm.start("p0")
    rnd = swarm.rounds["p0"]
    later = Hello(STAGE, ROUND + 3, 10, CODEC, True, False, ("p1",))
    reply, actions = rnd.on_hello("p1", later, 1.0)
    assert actions[0] == CatchUp("p1", ROUND + 3) and isinstance(actions[1], Finished)
    assert actions[1].outcome.left_out and rnd.phase is Phase.LEFT_OUT
    assert (reply.round, reply.ready, reply.closed) == (ROUND, False, True)
    assert rnd.on_hello("p1", later, 2.0)[1] == []  # once per round
    newer = Hello(STAGE, ROUND + 4, 10, CODEC, False, False, ())  # ready or not, it is further on
    assert rnd.on_hello("p1", newer, 2.0)[1] == [CatchUp("p1", ROUND + 4)]
    assert rnd.on_hello("p1", Hello(STAGE, ROUND - 1, 10, CODEC, True, False, ()), 2.0)[1] == []  # behind: no action


def test_the_next_round_is_no_catch_up_for_a_member_that_finished():
    swarm = Swarm(PEERS[:2])
    swarm.start_all()
    swarm.deliver_all()
    rnd = swarm.rounds["p0"]
    assert rnd.on_hello("p1", Hello(STAGE, ROUND + 1, 10, CODEC, True, False, ("p1",)), 9.0)[1] == []
    two_ahead = Hello(STAGE, ROUND + 2, 10, CODEC, True, False, ("p1",))
    assert rnd.on_hello("p1", two_ahead, 9.0)[1] == [CatchUp("p1", ROUND + 2)]
    assert rnd.phase is Phase.DONE


def test_a_lone_replica_finishes_alone_without_exchanging():
    swarm = Swarm(["p0"])
    swarm.start("p0")
    assert swarm.outcomes["p0"].group == ("p0",) and swarm.outcomes["p0"].results == {}
    assert not swarm.flights and not swarm.need


def test_a_hello_with_another_numel_or_codec_is_rejected_once():
    rnd = Swarm(PEERS[:2]).rounds["p0"]
    rnd.start(0.0)
    wrong = [Hello(STAGE, ROUND, 11, CODEC, True, False, ("p1",)), Hello(STAGE, ROUND, 10, "int8", True, False, ())]
    for hello in wrong:
        reply, _actions = rnd.on_hello("p1", hello, 0.0)
        assert reply == rnd.status()
    assert rnd.counts["rejected"] == 2 and rnd.phase is Phase.GATHER
    assert rnd.on_hello("p9", Hello(STAGE + 1, ROUND, 10, CODEC, True, True, ("p0", "p9")), 0.0)[1] == []
    assert rnd.counts["mismatched"] == 1 and rnd.phase is Phase.GATHER  # another stage: ignored


def test_a_closed_hello_invites_at_once_and_intersection_decides():
    swarm = Swarm(PEERS[:3])
    rnd = swarm.rounds["p0"]
    rnd.start(0.0)  # p0 knows nobody is ready yet; p1 closes with p0 in its proposal
    reply, actions = rnd.on_hello("p1", Hello(STAGE, ROUND, 10, CODEC, True, True, ("p0", "p1", "p2")), 1.0)
    assert rnd.phase is Phase.AGREE and reply.closed and reply.members == ("p0", "p1", "p2")
    assert {a.peer for a in actions if isinstance(a, SendHello)} == {"p1", "p2"}
    _, actions = rnd.on_hello("p2", Hello(STAGE, ROUND, 10, CODEC, True, True, ("p0", "p2")), 1.5)
    assert rnd.phase is Phase.REDUCE and rnd.group == ("p0", "p2")  # p2 did not see p1: p1 is out
    assert actions[0] == NeedShards(("p0", "p2"), ((0, 5), (5, 10)))


def test_a_proposal_without_me_leaves_me_out_at_once():
    rnd = Swarm(PEERS[:3]).rounds["p0"]
    rnd.start(0.0)
    _, actions = rnd.on_hello("p1", Hello(STAGE, ROUND, 10, CODEC, True, True, ("p1", "p2")), 1.0)
    assert rnd.phase is Phase.LEFT_OUT and actions[-1].outcome.left_out
    assert actions[-1].outcome.group == ("p1", "p2") and rnd.status().members == ("p1", "p2")
    assert (rnd.status().ready, rnd.status().closed) == (False, True)


def test_after_a_replica_closed_alone_the_later_ones_still_meet():
    swarm = Swarm(PEERS[:3])
    swarm.start("p0")
    swarm.deliver_all()
    swarm.tick(GATHER_S)  # nobody else was ready: p0 goes on alone
    assert swarm.outcomes["p0"].group == ("p0",) and not swarm.outcomes["p0"].left_out
    swarm.start("p1"), swarm.start("p2")
    swarm.deliver_all()  # p0 answers "closed, (p0,)": it shuts out only itself
    assert_full_success(swarm, ["p1", "p2"])


def test_a_withdrawn_member_is_not_waited_for():
    rnd = Swarm(PEERS[:3]).rounds["p0"]
    rnd.start(0.0)
    rnd.on_hello("p1", Hello(STAGE, ROUND, 10, CODEC, True, False, ("p1",)), 0.5)
    rnd.on_hello("p2", Hello(STAGE, ROUND, 10, CODEC, True, False, ("p2",)), 0.5)
    assert rnd.phase is Phase.AGREE
    rnd.on_hello("p1", Hello(STAGE, ROUND, 10, CODEC, False, True, ()), 1.0)  # p1 withdrew
    _, actions = rnd.on_hello("p2", Hello(STAGE, ROUND, 10, CODEC, True, True, ("p0", "p1", "p2")), 1.0)
    assert rnd.group == ("p0", "p2") and isinstance(actions[0], NeedShards)


def test_send_failures_in_the_reduce_stop_the_waiting():
    swarm = Swarm(PEERS[:3])
    swarm.start_all()
    while not all(swarm.rounds[p].phase is Phase.REDUCE for p in PEERS[:3]):
        swarm.deliver(0)
    swarm.dead.add("p2")
    swarm.flights = [f for f in swarm.flights if f.src != "p2"]  # p2 died before sending anything
    swarm.deliver_all()  # p0 and p1 fail to reach p2: they combine without it, shard 2 is missing
    for peer in ("p0", "p1"):
        outcome = swarm.outcomes[peer]
        assert outcome.missing == (2,) and set(outcome.results) == {0, 1}
        assert contributors_of(outcome.results[0]) == {"p0", "p1"}
    assert swarm.now == 0.0  # no deadline was needed


def test_an_owner_combines_at_its_deadline_and_members_stop_at_theirs():
    swarm = Swarm(PEERS[:3])
    swarm.start_all()
    while not all(swarm.rounds[p].phase is Phase.REDUCE for p in PEERS[:3]):
        swarm.deliver(0)
    swarm.flights.clear()  # every part is lost, silently: only deadlines end the round
    assert swarm.rounds["p0"].next_deadline() == REDUCE_S
    swarm.tick(REDUCE_S - 0.01)
    assert not swarm.flights
    swarm.tick(0.01)  # each owner combines its own part alone and sends it to the two others
    assert sorted((f.src, f.dst, f.msg.contributors) for f in swarm.flights) == [
        ("p0", "p1", 1), ("p0", "p2", 1), ("p1", "p0", 1), ("p1", "p2", 1), ("p2", "p0", 1), ("p2", "p1", 1)]
    swarm.flights.clear()
    assert swarm.rounds["p0"].next_deadline() == 2 * REDUCE_S
    swarm.tick(REDUCE_S)
    for i, peer in enumerate(PEERS[:3]):
        outcome = swarm.outcomes[peer]
        assert set(outcome.results) == {i} and outcome.missing == tuple(s for s in range(3) if s != i)
        assert contributors_of(outcome.results[i]) == {peer}
        assert swarm.rounds[peer].counts["missing_shards"] == 2


def test_parts_arriving_while_agreeing_are_held_and_judged_later():
    rnd = Swarm(PEERS[:2]).rounds["p0"]
    rnd.start(0.0)
    rnd.on_hello("p1", Hello(STAGE, ROUND, 10, CODEC, True, False, ("p1",)), 0.0)
    assert rnd.phase is Phase.AGREE
    digest = group_digest(STAGE, ROUND, ["p0", "p1"])
    part = Part(STAGE, ROUND, digest, 0, 2, CODEC, 5)
    reply, _ = rnd.on_part("p1", part, pack([BIT["p1"]] * 5), 0.1)
    assert (reply.accepted, reply.reason) == (True, "early")
    reply, _ = rnd.on_part("p9", part, pack([BIT["p1"]] * 5), 0.1)  # not in our view
    assert not reply.accepted
    _, actions = rnd.on_hello("p1", Hello(STAGE, ROUND, 10, CODEC, True, True, ("p0", "p1")), 0.2)
    assert isinstance(actions[0], NeedShards)
    actions = answer_combines(rnd, rnd.provide_shards(own_shards("p0", actions[0].bounds), 0.3), 0.3)
    sent = [a for a in actions if isinstance(a, (SendPart, SendResult))]
    assert [type(a) for a in sent] == [SendPart, SendResult]  # the held part completed our shard
    assert sent[1].data == expected_result(["p0", "p1"], 5) and sent[1].result.contributors == 2


def test_held_parts_of_a_small_stage_all_fit_the_budget():
    rnd = Swarm(PEERS, numel=1).rounds["p0"]  # shard 0 holds the only element: every part is for p0
    rnd.start(0.0)
    for peer in PEERS[1:]:
        rnd.on_hello(peer, Hello(STAGE, ROUND, 1, CODEC, True, False, (peer,)), 0.0)
    digest = group_digest(STAGE, ROUND, PEERS)
    for peer in PEERS[1:]:
        reply, _ = rnd.on_part(peer, Part(STAGE, ROUND, digest, 0, 4, CODEC, 1), pack([BIT[peer]]), 0.1)
        assert (reply.accepted, reply.reason) == (True, "early")
    for peer in PEERS[1:]:
        rnd.on_hello(peer, Hello(STAGE, ROUND, 1, CODEC, True, True, tuple(PEERS)), 0.2)
    actions = answer_combines(rnd, rnd.provide_shards([pack([BIT["p0"]]), b"", b"", b""], 0.3), 0.3)
    results = [a for a in actions if isinstance(a, SendResult)]
    assert len(results) == 3 and results[0].data == expected_result(PEERS, 1)


def test_an_owner_asks_its_driver_to_combine_and_no_deadline_ends_the_round_before_the_answer():
    """The combine is O(shard) tensor work that the driver does in a worker thread: the round
    closes the shard's parts when it asks, and waits for the answer even past its deadlines."""
    swarm = Swarm(PEERS[:3], auto_combine=False)
    swarm.start_all()
    swarm.deliver_all()
    assert sorted(swarm.combining) == PEERS[:3] and not swarm.outcomes
    for i, peer in enumerate(PEERS[:3]):
        ask = swarm.combining[peer]
        assert (ask.shard, sorted(ask.parts)) == (i, PEERS[:3])
        assert ask.parts["p1"] == pack([BIT["p1"]] * ask.numel)
    rnd = swarm.rounds["p0"]
    late = Part(STAGE, ROUND, rnd.digest, 0, 3, CODEC, swarm.numel_of("p0", 0))
    reply, actions = rnd.on_part("p1", late, pack([BIT["p1"]] * late.numel), swarm.now)
    assert (reply.accepted, reply.reason, actions) == (False, "late", [])  # the parts went with the ask
    swarm.tick(REDUCE_S)  # past the owners' deadline: nothing more to do but wait for the answers
    assert not swarm.flights
    for peer in reversed(PEERS[:3]):
        swarm.answer_combine(peer)
    swarm.deliver_all()
    assert_full_success(swarm, PEERS[:3])

    swarm = Swarm(PEERS[:3], auto_combine=False)
    swarm.start_all()
    swarm.deliver_all()
    swarm.tick(2 * REDUCE_S + 1.0)  # past every deadline: still nobody finishes without its own shard
    assert not swarm.outcomes and not swarm.flights
    assert all(r.phase is Phase.REDUCE for r in swarm.rounds.values())
    swarm.answer_combine("p0")
    outcome = swarm.outcomes["p0"]  # at once: its own result is in, and its wait for the others is over
    assert set(outcome.results) == {0} and outcome.missing == (1, 2)
    assert contributors_of(outcome.results[0]) == set(PEERS[:3]) and outcome.contributors == {0: 3}


def test_a_combine_answered_after_the_round_ended_sends_nothing():
    swarm = Swarm(PEERS[:2], auto_combine=False)
    swarm.start_all()
    swarm.deliver_all()
    rnd = swarm.rounds["p0"]
    _, actions = rnd.on_hello("p1", Hello(STAGE, ROUND + 2, 10, CODEC, True, False, ()), swarm.now)
    swarm.act("p0", actions)  # p1 is two rounds ahead: we abandon ours
    assert rnd.phase is Phase.LEFT_OUT
    swarm.answer_combine("p0")
    assert not swarm.flights and swarm.outcomes["p0"].left_out


def test_a_wrong_answer_to_a_combine_is_the_drivers_fault():
    swarm = Swarm(PEERS[:2], auto_combine=False)
    rnd = swarm.rounds["p0"]
    with pytest.raises(ValueError):
        rnd.combined(pack([0] * 5), {}, 0.0)  # before the round reduces
    swarm.start_all()
    swarm.deliver_all()
    ask = swarm.combining.pop("p0")
    for result, refused in [(pack([0] * 4), {}), (bytearray(pack([0] * 5)), {}), (pack([0] * 5), {"p0": "own"})]:
        with pytest.raises(ValueError):
            rnd.combined(result, refused, 0.0)
    swarm.act("p0", rnd.combined(*combine(ask.parts, "p0"), 0.0))
    with pytest.raises(ValueError):
        rnd.combined(pack([0] * 5), {}, 0.0)  # answered twice


def test_an_idle_replica_answers_not_ready_and_remembers_who_is():
    rnd = Swarm(PEERS[:3]).rounds["p0"]
    reply, actions = rnd.on_hello("p1", Hello(STAGE, ROUND, 10, CODEC, True, False, ("p1",)), 0.0)
    assert (reply.ready, reply.closed, reply.members, actions) == (False, False, ("p1",), [])
    reply, _ = rnd.on_hello("x" * 65, Hello(STAGE, ROUND, 10, CODEC, True, False, ()), 0.0)  # not a peer id
    assert reply.members == ("p1",) and rnd.counts["mismatched"] == 1
    assert rnd.next_deadline() is None and rnd.tick(1e9) == []
    actions = rnd.start(5.0)
    assert [a.peer for a in actions] == ["p1", "p2"] and actions[0].hello.members == ("p0", "p1")


def test_late_messages_after_the_round_get_round_over():
    swarm = Swarm(PEERS[:2])
    swarm.start_all()
    swarm.deliver_all()
    rnd = swarm.rounds["p0"]
    part = Part(STAGE, ROUND, rnd.digest, 0, 2, CODEC, 5)
    reply, actions = rnd.on_part("p1", part, pack([1] * 5), 99.0)
    assert (reply.accepted, reply.reason, actions) == (False, "round over", [])
    assert rnd.counts["late"] == 1


def test_local_misuse_raises_value_error():
    swarm = Swarm(PEERS[:2], auto_provide=False)
    rnd = swarm.rounds["p0"]
    with pytest.raises(ValueError):
        rnd.provide_shards([], 0.0)  # before NeedShards
    swarm.start_all()
    with pytest.raises(ValueError):
        rnd.start(0.0)
    swarm.deliver_all()
    with pytest.raises(ValueError):
        rnd.provide_shards([b"\0" * 20], 0.0)  # one shard for a group of two
    with pytest.raises(ValueError):
        rnd.provide_shards([b"\0" * 20, b"\0" * 19], 0.0)  # a shard of the wrong size
    kwargs = dict(me="p0", stage=0, round=0, numel=4, codec=CODEC, expected=frozenset(), now=0.0,
                  expected_bytes=messages.expected_bytes)
    for bad in [dict(me=""), dict(stage=-1), dict(numel=0), dict(codec="fp8"), dict(expected=frozenset({""}))]:
        with pytest.raises(ValueError):
            OuterRound(**{**kwargs, **bad})
    with pytest.raises(ValueError):
        RoundTiming(gather_s=0.0)


def test_the_round_module_imports_neither_torch_nor_trio():
    import subprocess
    import sys
    code = "import p2pswarm.diloco.round, sys; assert not {'torch', 'trio'} & set(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True)


# --- every delivery order, nothing lost: everyone gets everything ------------------------------


@settings(max_examples=60)
@given(n=st.integers(2, 4), numel=st.integers(1, 12), order=st.randoms(use_true_random=False),
       starts=st.lists(st.integers(0, 30), min_size=4, max_size=4))
def test_in_any_delivery_order_all_ready_members_finish_with_the_full_group(n, numel, order, starts):
    swarm = Swarm(PEERS[:n], numel=numel)
    pending = sorted(range(n), key=lambda i: starts[i])
    while pending or swarm.flights:  # starts interleave with deliveries
        if pending and (not swarm.flights or order.random() < 0.3):
            swarm.start(PEERS[pending.pop(0)])
        else:
            swarm.deliver(order.randrange(len(swarm.flights)))
    assert_full_success(swarm, PEERS[:n])
    assert not swarm.rejected


# --- the swarm as a state machine --------------------------------------------------------------


class RoundMachine(RuleBasedStateMachine):
    """3-4 members; a network that reorders, duplicates and drops; a clock; garbage; deaths."""

    @initialize(n=st.integers(3, 4), numel=st.integers(1, 9), idle=st.sets(st.sampled_from(PEERS), max_size=1),
                auto=st.booleans(), garble=st.none() | st.tuples(st.sampled_from(PEERS[:3]),
                                                                 st.sampled_from(GARBAGE_KINDS), st.booleans()),
                blind=st.booleans(), auto_combine=st.booleans())
    def setup(self, n, numel, idle, auto, garble, blind, auto_combine):
        members = PEERS[:n]
        expected = {p: [q for q in members if not (blind and p == "p0" and q == members[-1])] for p in members}
        self.swarm = Swarm(members, numel=numel, auto_provide=auto, expected=expected, auto_combine=auto_combine)
        self.blind = blind  # p0 does not expect the last member: it may close without it
        if garble is not None:  # this member sends garbage parts and results, with or instead of its own
            self.swarm.garble[garble[0]] = garble[1:]
        self.clean = True  # no drops, garbage, kills or time: then everything must succeed
        self.far = False  # advance_far ran: every round is over, later steps add little
        self.steps = 0  # rules run so far (advance_far waits for a few, so that rounds get going)
        for peer in PEERS[:n]:
            if peer not in idle:
                self.swarm.start(peer)

    def live(self) -> list[str]:
        return [p for p in self.swarm.peers if p not in self.swarm.dead]

    @precondition(lambda self: self.swarm.flights)
    @rule(data=st.data(), count=st.integers(1, 20))
    def deliver(self, data, count):
        for _ in range(min(count, len(self.swarm.flights))):
            self.swarm.deliver(data.draw(st.integers(0, len(self.swarm.flights) - 1)))

    @precondition(lambda self: self.swarm.flights)
    @rule(data=st.data())
    def duplicate(self, data):
        f = self.swarm.flights[data.draw(st.integers(0, len(self.swarm.flights) - 1))]
        self.swarm.flights.append(Flight(f.kind, f.src, f.dst, f.msg, f.data))

    @precondition(lambda self: self.swarm.flights)
    @rule(data=st.data(), tell=st.booleans())
    def drop(self, data, tell):
        f = self.swarm.flights.pop(data.draw(st.integers(0, len(self.swarm.flights) - 1)))
        self.clean = False
        if tell and f.kind != "reply" and f.src not in self.swarm.dead:
            self.swarm.act(f.src, self.swarm.rounds[f.src].on_send_failed(f.dst, self.swarm.now))

    @rule(dt=st.one_of(*[st.floats(0.0, 3.0)] * 3, st.sampled_from([AGREE_S, GATHER_S / 2, REDUCE_S, 2 * REDUCE_S])))
    def advance(self, dt):
        self.clean = self.clean and dt == 0.0
        self.swarm.tick(dt)

    @precondition(lambda self: self.swarm.need)
    @rule(data=st.data())
    def provide(self, data):
        peer = data.draw(st.sampled_from(sorted(self.swarm.need)))
        if peer not in self.swarm.dead:
            self.swarm.provide(peer)

    @precondition(lambda self: self.swarm.combining)
    @rule(data=st.data())
    def combine_done(self, data):
        """An owner's worker thread finishes (in any order, at any time; a dead member's never does)."""
        peer = data.draw(st.sampled_from(sorted(self.swarm.combining)))
        if peer not in self.swarm.dead:
            self.swarm.answer_combine(peer)

    def answer_all(self) -> None:
        """Provide every asked shard and answer every combine of the live members (the driver always does)."""
        while any(p not in self.swarm.dead for p in [*self.swarm.need, *self.swarm.combining]):
            for peer in sorted(self.swarm.need):
                if peer not in self.swarm.dead:
                    self.swarm.provide(peer)
            for peer in sorted(self.swarm.combining):
                if peer not in self.swarm.dead:
                    self.swarm.answer_combine(peer)

    @precondition(lambda self: set(self.live()) - self.swarm.started)
    @rule(data=st.data())
    def start_late(self, data):
        self.swarm.start(data.draw(st.sampled_from(sorted(set(self.live()) - self.swarm.started))))

    @precondition(lambda self: not self.swarm.dead)
    @rule(data=st.data())
    def kill(self, data):
        self.swarm.dead.add(data.draw(st.sampled_from(self.live())))
        self.clean = False

    def reducing(self) -> list[str]:
        return [p for p in self.live() if self.swarm.rounds[p].digest is not None]

    @precondition(lambda self: self.reducing())
    @rule(data=st.data(), kind=st.sampled_from(GARBAGE_KINDS))
    def send_garbage(self, data, kind):
        """A stray garbage part, at any time (the round may be over for its target)."""
        src = data.draw(st.sampled_from(self.reducing()))
        rnd = self.swarm.rounds[src]
        dst = data.draw(st.sampled_from([p for p in rnd.group if p != src]))
        shard = rnd.group.index(dst)
        start, stop = shard_bounds(self.swarm.numel, len(rnd.group))[shard]
        part = Part(STAGE, ROUND, rnd.digest, shard, len(rnd.group), CODEC, stop - start)
        self.swarm.garbage_senders.add(src)
        self.clean = False
        self.swarm.send(src, dst, *forge(part, pack([BIT[src]] * (stop - start)), kind, src))

    @precondition(lambda self: not self.far and self.steps >= FAR_AFTER_STEPS)
    @rule()
    def advance_far(self):
        """Liveness: past every deadline (a few times over: each phase sets the next), all started live members end."""
        self.clean, self.far = False, True
        for _ in range(4):
            self.answer_all()
            self.swarm.tick(FAR)
        for peer in self.live():
            if peer in self.swarm.started:
                assert self.swarm.rounds[peer].phase in (Phase.DONE, Phase.LEFT_OUT), peer
                assert peer in self.swarm.outcomes

    @precondition(lambda self: self.clean and not self.blind and not self.swarm.garble
                  and self.swarm.started == set(self.swarm.peers))
    @rule(order=st.randoms(use_true_random=False))
    def settle(self, order):
        """No drops, garbage, kills or time, all ready: in any order, everyone gets everything."""
        while self.swarm.flights or self.swarm.need or self.swarm.combining:
            asked = sorted(self.swarm.need) + sorted(self.swarm.combining)
            if asked and (not self.swarm.flights or order.random() < 0.3):
                peer = order.choice(asked)
                self.swarm.provide(peer) if peer in self.swarm.need else self.swarm.answer_combine(peer)
            else:
                self.swarm.deliver(order.randrange(len(self.swarm.flights)))
        assert_full_success(self.swarm, self.swarm.peers)

    # --- invariants ------------------------------------------------------------------------

    @invariant()
    def count_steps(self):
        self.steps = getattr(self, "steps", -1) + 1

    @invariant()
    def same_group_same_results(self):
        done = [(p, o) for p, o in self.swarm.outcomes.items() if not o.left_out]
        for i, (p, a) in enumerate(done):
            for q, b in done[i + 1:]:
                if a.group == b.group:
                    for shard in set(a.results) & set(b.results):
                        assert a.results[shard] == b.results[shard], (p, q, shard)

    @invariant()
    def results_combine_only_members_and_never_garbage(self):
        for peer, outcome in self.swarm.outcomes.items():
            rnd = self.swarm.rounds[peer]
            assert outcome.left_out == (rnd.phase is Phase.LEFT_OUT)
            if outcome.left_out:
                assert peer not in outcome.group and not outcome.results
                continue
            assert peer in outcome.group and outcome.group == rnd.group
            shards = set(range(len(outcome.group))) if len(outcome.group) > 1 else set()  # alone: no exchange
            assert set(outcome.results) | set(outcome.missing) == shards
            assert not set(outcome.results) & set(outcome.missing)
            for shard, data in outcome.results.items():
                assert 1 <= outcome.contributors[shard] <= len(outcome.group)
                used = contributors_of(data)
                if used is not None:
                    assert used <= set(outcome.group) and outcome.group[shard] in used
                    assert len(used) == outcome.contributors[shard]

    @invariant()
    def a_group_lies_within_each_of_its_members_proposals(self):
        for peer, rnd in self.swarm.rounds.items():
            if rnd.phase in (Phase.REDUCE, Phase.DONE):
                for other in set(rnd.group) - {peer}:
                    assert set(rnd.group) <= self.swarm.rounds[other].book.view, (peer, other)

    @invariant()
    def only_garbage_senders_are_rejected(self):
        for by, peer, reason in self.swarm.rejected:
            assert peer in self.swarm.garbage_senders, (by, peer, reason)

    @invariant()
    def nobody_is_behind(self):
        assert not self.swarm.catch_ups

    @invariant()
    def status_is_always_a_valid_hello(self):
        for rnd in self.swarm.rounds.values():
            wire.encode_frame(rnd.status())
            deadline = rnd.next_deadline()
            assert (deadline is None) == (rnd.phase in (Phase.IDLE, Phase.DONE, Phase.LEFT_OUT))


RoundMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=60)
TestRoundMachine = RoundMachine.TestCase

"""DiLoCo beyond one frame: a stage's flat pseudo-gradient cut into pieces (``messages.shard_plan``).

A stage of billions of elements is split into |G| shards as before, and each shard into equal
pieces, each within ``MAX_NUMEL`` elements and ``wire.MAX_PAYLOAD_BYTES`` once encoded: the plan
is pure arithmetic (nothing allocated), a small stage keeps one piece a shard (the shards of
before, bit for bit), a vector past a decoder's limit is refused whole but goes through as its
planned pieces, and a whole outer round with several pieces a shard gives every member every
piece's exact sum.
"""

from __future__ import annotations

import struct

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from p2pswarm import wire
from p2pswarm.diloco import codec as codecs
from p2pswarm.diloco.messages import (
    CODECS,
    MAX_MEMBERS,
    MAX_NUMEL,
    MAX_PIECES,
    MAX_STAGE_NUMEL,
    Hello,
    Part,
    expected_bytes,
    piece_elements,
    shard_bounds,
    shard_plan,
)
from p2pswarm.diloco.round import (
    CombineShard,
    Finished,
    NeedShards,
    OuterRound,
    Rejected,
    SendHello,
    SendPart,
    SendResult,
)
from p2pswarm.errors import RemoteProtocolError


def admitted(plan, codec: str) -> bool:
    """Every piece within the decoder's element limit and, encoded (a Result of every member's entries
    too), within one frame."""
    return all(b - a <= MAX_NUMEL and expected_bytes(codec, b - a, plan.shards) <= wire.MAX_PAYLOAD_BYTES
               for a, b in plan.bounds)


def tiles(plan) -> bool:
    ends = [a for a, _ in plan.bounds[1:]] == [b for _, b in plan.bounds[:-1]]
    return ends and plan.bounds[0][0] == 0 and plan.bounds[-1][1] == plan.numel


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("members", [2, 8, MAX_MEMBERS])
def test_a_five_billion_element_stage_is_planned_in_admitted_pieces(codec, members):
    plan = shard_plan(5_000_000_000, members, codec)  # the xl tier's stage: arithmetic only
    assert plan.pieces > 1 and len(plan.bounds) == members * plan.pieces <= members * MAX_PIECES
    assert tiles(plan) and admitted(plan, codec)
    owners = shard_bounds(plan.numel, members)  # each member still owns its shard of before
    for shard, (start, stop) in enumerate(owners):
        pieces = plan.bounds[plan.index(shard, 0): plan.index(shard + 1, 0)]
        assert pieces[0][0] == start and pieces[-1][1] == stop
        assert {plan.owner(plan.index(shard, p)) for p in range(plan.pieces)} == {shard}


@given(st.integers(0, MAX_STAGE_NUMEL), st.integers(1, MAX_MEMBERS), st.sampled_from(CODECS))
def test_every_stage_size_is_planned_in_admitted_pieces(numel, members, codec):
    plan = shard_plan(numel, members, codec)
    assert tiles(plan) and admitted(plan, codec) and 1 <= plan.pieces <= MAX_PIECES
    sizes = [b - a for a, b in plan.bounds]
    assert max(sizes) - min(sizes) <= 1  # as even as shard_bounds makes them


@given(st.integers(0, 10**7), st.integers(1, MAX_MEMBERS), st.sampled_from(CODECS))
def test_a_stage_that_fits_keeps_one_piece_a_shard(numel, members, codec):
    plan = shard_plan(numel, members, codec)
    if -(-numel // members) <= piece_elements(codec):
        assert plan.pieces == 1 and list(plan.bounds) == shard_bounds(numel, members)


def test_piece_limits_follow_the_frame_and_the_decoder():
    assert piece_elements("float32") == wire.MAX_PAYLOAD_BYTES // 4
    assert piece_elements("bfloat16") == wire.MAX_PAYLOAD_BYTES // 2
    int8 = piece_elements("int8")
    assert expected_bytes("int8", int8) <= wire.MAX_PAYLOAD_BYTES < expected_bytes("int8", int8 + 1)
    assert piece_elements("float32", max_elements=1000) == 1000
    with pytest.raises(ValueError):
        shard_plan(MAX_STAGE_NUMEL + 1, 2, "int8")
    with pytest.raises(ValueError):
        piece_elements("float32", max_bytes=3)


def test_stage_sized_hellos_are_admitted():
    wire.encode_frame(Hello(0, 0, 5_000_000_000, "int8", True, False, ("a",)))


@pytest.mark.parametrize("codec", CODECS)
def test_just_over_two_to_the_26_is_refused_whole_and_planned_in_admitted_pieces(codec):
    numel = MAX_NUMEL + 1  # arithmetic only: 2**26 floats would be 256 MiB
    with pytest.raises(ValueError):
        codecs.encoded_size(codec, numel)
    with pytest.raises(RemoteProtocolError):  # refused before anything is allocated
        codecs.decode(b"", codec, numel)
    plan = shard_plan(numel, 1, codec)
    assert plan.pieces >= 2 and admitted(plan, codec)
    assert all(codecs.encoded_size(codec, b - a) == expected_bytes(codec, b - a) for a, b in plan.bounds)


@pytest.mark.parametrize("codec", CODECS)
def test_a_vector_past_the_limit_is_refused_whole_and_goes_through_in_pieces(codec):
    limit = 1000  # a lowered decoder limit stands in for MAX_ELEMENTS (2**26 floats would be 256 MiB)
    vector = torch.randn(2 * limit + 37)
    with pytest.raises(ValueError):
        codecs.encode(vector, codec, max_elements=limit)
    with pytest.raises(RemoteProtocolError):
        codecs.decode(b"\0" * expected_bytes(codec, vector.numel()), codec, vector.numel(), max_elements=limit)
    plan = shard_plan(vector.numel(), 2, codec, max_elements=limit)
    assert plan.pieces == 2 and admitted(plan, codec)
    pieces = [codecs.encode(vector[a:b], codec, max_elements=limit) for a, b in plan.bounds]
    decoded = torch.cat([codecs.decode(data, codec, b - a, max_elements=limit)
                         for data, (a, b) in zip(pieces, plan.bounds)])
    whole = codecs.decode(codecs.encode(vector, codec), codec, vector.numel())  # the default limit
    if codec == "int8":  # chunks start at each piece: scales differ, the error bound does not
        assert torch.allclose(decoded, vector, atol=float(vector.abs().max()) / 127)
    elif codec == "sparse":  # chunks start at each piece: each piece keeps its own top entries
        top = codecs.sparse.SPARSE_TOP
        assert all(int((decoded[a:b] != 0).sum()) == min(top, b - a) for a, b in plan.bounds)
    else:
        assert torch.equal(decoded, whole)


# --- a whole round with several pieces a shard --------------------------------------------------

PEERS = ("p0", "p1", "p2")
BIT = {peer: 1 << i for i, peer in enumerate(PEERS)}


def pack(values: list[int]) -> bytes:
    return struct.pack(f"<{len(values)}i", *values)


def unpack(data: bytes) -> list[int]:
    return list(struct.unpack(f"<{len(data) // 4}i", data))


class Net:
    """Members and the network between them; ``lifo`` delivers the newest message first (so parts
    reach members still agreeing); ``dies`` are members that die once their group is agreed;
    ``tamper(src, action)`` may replace a SendPart's data; ``combine`` answers CombineShard at once."""

    def __init__(self, numel: int, piece_limit: int, *, lifo=False, dies=(), tamper=None, combine=True) -> None:
        self.rounds = {p: OuterRound(me=p, stage=1, round=3, numel=numel, codec="float32",
                                     expected=frozenset(PEERS) - {p}, now=0.0, expected_bytes=expected_bytes,
                                     piece_elements=piece_limit) for p in PEERS}
        self.lifo, self.dies, self.tamper, self.combine = lifo, set(dies), tamper, combine
        self.dead: set[str] = set()
        self.outcomes, self.parts, self.combines, self.rejected = {}, [], [], []
        self.queue = [(p, a) for p in PEERS for a in self.rounds[p].start(0.0)]

    def run(self, now: float = 0.0) -> None:
        while self.queue:
            src, action = self.queue.pop(-1 if self.lifo else 0)
            if src not in self.dead:
                self.queue += [(who, a) for who, actions in self.handle(src, action, now) for a in actions]

    def handle(self, src: str, action, now: float):
        rnd = self.rounds[src]
        peer = getattr(action, "peer", None)
        if peer in self.dead:
            return [(src, rnd.on_send_failed(peer, now))]
        if isinstance(action, SendHello):
            reply, more = self.rounds[peer].on_hello(src, action.hello, now)
            return [(peer, more), (src, rnd.on_hello(peer, reply, now)[1])]
        if isinstance(action, NeedShards):
            if src in self.dies:
                self.dead.add(src)
                return []
            return [(src, rnd.provide_shards([pack([BIT[src]] * (b - a)) for a, b in action.bounds], now))]
        if isinstance(action, SendPart):
            self.parts.append(action.part)
            data = self.tamper(src, action) if self.tamper else action.data
            return [(peer, self.rounds[peer].on_part(src, action.part, data, now)[1])]
        if isinstance(action, SendResult):
            return [(peer, self.rounds[peer].on_result(src, action.result, action.data, now)[1])]
        if isinstance(action, CombineShard):
            if not self.combine:
                self.combines.append((src, action))
                return []
            total = [sum(v) for v in zip(*(unpack(d) for d in action.parts.values()))]
            return [(src, rnd.combined(pack(total), {}, now, action.shard))]
        if isinstance(action, Rejected):
            self.rejected.append((src, action.peer, action.reason))
        if isinstance(action, Finished):
            self.outcomes[src] = action.outcome
        return []


def sums(outcome, pieces: range) -> list[int]:
    return [v for i in pieces for v in unpack(outcome.results[i])]


@pytest.mark.parametrize("lifo", [False, True])
def test_a_round_with_several_pieces_a_shard_sums_every_piece(lifo):
    numel, limit = 23, 3  # shards of 8, 8, 7 elements in 3 pieces each
    net = Net(numel, limit, lifo=lifo)
    net.run()
    assert sorted(net.outcomes) == list(PEERS)
    for outcome in net.outcomes.values():
        assert outcome.pieces == 3 and not outcome.missing and not outcome.left_out
        assert sorted(outcome.results) == list(range(9))
        assert sums(outcome, range(9)) == [sum(BIT.values())] * numel  # every element: the sum over all members
        assert [outcome.owner(i) for i in range(9)] == [p for p in PEERS for _ in range(3)]
        assert all(count == 3 for count in outcome.contributors.values())
    assert len(net.parts) == 3 * 2 * 3 and {p.piece for p in net.parts} == {0, 1, 2}  # 3 members x 2 owners x 3
    assert all(isinstance(p, Part) and p.numel <= limit for p in net.parts)
    if lifo:  # parts of several pieces reached members still agreeing: each was held, none lost as a duplicate
        assert sum(r.counts["early"] for r in net.rounds.values()) > 1
        assert not any(r.counts["duplicates"] for r in net.rounds.values())


def test_a_member_gone_after_the_agreement_leaves_only_its_pieces_missing():
    net = Net(23, 3, dies={"p2"})
    net.run()
    for peer in ("p0", "p1"):
        outcome = net.outcomes[peer]
        assert outcome.missing == (6, 7, 8) and sorted(outcome.results) == list(range(6))
        assert sums(outcome, range(6)) == [BIT["p0"] + BIT["p1"]] * 16
        assert all(outcome.contributors[i] == 2 for i in range(6))


def test_a_bad_part_in_one_piece_refuses_its_sender_once_and_keeps_its_earlier_piece():
    def tamper(src, action):
        bad = src == "p1" and action.peer == "p0" and action.part.piece == 1
        return action.data + b"\0\0\0\0" if bad else action.data

    net = Net(23, 3, tamper=tamper)
    net.run()
    assert [(who, peer) for who, peer, _ in net.rejected] == [("p0", "p1")]
    outcome = net.outcomes["p0"]
    assert [outcome.contributors[i] for i in range(3)] == [3, 2, 2]  # p1's piece 0 came before its bad piece 1
    assert sums(outcome, range(1, 3)) == [BIT["p0"] + BIT["p2"]] * 5


def test_each_combine_is_answered_by_its_piece():
    net = Net(23, 3, combine=False)
    net.run()
    assert sorted((src, a.shard) for src, a in net.combines) == [(p, i) for p in PEERS for i in
                                                                  range(3 * PEERS.index(p), 3 * PEERS.index(p) + 3)]
    assert not net.outcomes  # no member is done while a combine of its own is out
    rnd, first = net.rounds["p0"], next(action for src, action in net.combines if src == "p0")
    with pytest.raises(ValueError):  # three are out: an answer must say which
        rnd.combined(pack([0] * first.numel), {}, 0.0)
    for src, action in reversed(net.combines):  # answered in any order
        total = [sum(v) for v in zip(*(unpack(d) for d in action.parts.values()))]
        net.queue += [(src, a) for a in net.rounds[src].combined(pack(total), {}, 0.0, action.shard)]
    with pytest.raises(ValueError):  # answered already
        rnd.combined(pack([0] * first.numel), {}, 0.0, first.shard)
    net.run()
    for outcome in net.outcomes.values():
        assert sums(outcome, range(9)) == [sum(BIT.values())] * 23


def test_early_parts_are_held_at_most_a_shards_pieces_per_peer():
    rnd = OuterRound(me="p0", stage=1, round=3, numel=23, codec="float32", expected=frozenset({"p1", "p2"}),
                     now=0.0, expected_bytes=expected_bytes, piece_elements=3)
    rnd.start(0.0)
    rnd.on_hello("p1", Hello(1, 3, 23, "float32", True, True, PEERS), 0.0)  # p1 closed with us: we close, agree
    assert rnd.phase.name == "AGREE"
    replies = [rnd.on_part("p1", Part(1, 3, b"g" * 32, 0, 3, "float32", 0, piece=i), b"", 0.0)[0] for i in range(50)]
    held = [r.reason for r in replies].count("early")
    assert held == shard_plan(23, 2, "float32", max_elements=3).pieces == 4  # empty parts cannot fill the book
    assert [r.reason for r in replies[held:]] == ["too early"] * (50 - held)

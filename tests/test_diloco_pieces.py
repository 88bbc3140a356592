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
from p2pswarm.diloco import compression
from p2pswarm.diloco.messages import (
    CODECS, MAX_MEMBERS, MAX_NUMEL, MAX_PIECES, MAX_STAGE_NUMEL, Hello, Part, expected_bytes, piece_elements,
    shard_bounds, shard_plan,
)
from p2pswarm.diloco.round import CombineShard, Finished, NeedShards, OuterRound, SendHello, SendPart, SendResult
from p2pswarm.errors import RemoteProtocolError


def admitted(plan, codec: str) -> bool:
    """Every piece within the decoder's element limit and, encoded, within one frame."""
    return all(b - a <= MAX_NUMEL and expected_bytes(codec, b - a) <= wire.MAX_PAYLOAD_BYTES for a, b in plan.bounds)


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
def test_a_vector_past_the_limit_is_refused_whole_and_goes_through_in_pieces(codec):
    limit = 1000  # a lowered decoder limit stands in for MAX_ELEMENTS (2**26 floats would be 256 MiB)
    vector = torch.randn(2 * limit + 37)
    with pytest.raises(ValueError):
        compression.encode(vector, codec, max_elements=limit)
    with pytest.raises(RemoteProtocolError):
        compression.decode(b"\0" * expected_bytes(codec, vector.numel()), codec, vector.numel(), max_elements=limit)
    plan = shard_plan(vector.numel(), 2, codec, max_elements=limit)
    assert plan.pieces == 2 and admitted(plan, codec)
    pieces = [compression.encode(vector[a:b], codec, max_elements=limit) for a, b in plan.bounds]
    decoded = torch.cat([compression.decode(data, codec, b - a, max_elements=limit)
                         for data, (a, b) in zip(pieces, plan.bounds)])
    whole = compression.decode(compression.encode(vector, codec), codec, vector.numel())  # the default limit
    if codec == "int8":  # chunks start at each piece: scales differ, the error bound does not
        assert torch.allclose(decoded, vector, atol=float(vector.abs().max()) / 127)
    else:
        assert torch.equal(decoded, whole)


# --- a whole round with several pieces a shard --------------------------------------------------

PEERS = ("p0", "p1", "p2")
BIT = {peer: 1 << i for i, peer in enumerate(PEERS)}


def pack(values: list[int]) -> bytes:
    return struct.pack(f"<{len(values)}i", *values)


def unpack(data: bytes) -> list[int]:
    return list(struct.unpack(f"<{len(data) // 4}i", data))


def run_round(numel: int, piece_limit: int) -> tuple[dict, list]:
    """Every member's outcome, and every Part sent: the network delivers at once, in order."""
    rounds = {p: OuterRound(me=p, stage=1, round=3, numel=numel, codec="float32", expected=frozenset(PEERS) - {p},
                            now=0.0, expected_bytes=expected_bytes, piece_elements=piece_limit) for p in PEERS}
    queue = [(p, a) for p in PEERS for a in rounds[p].start(0.0)]
    outcomes, parts = {}, []
    while queue:
        src, action = queue.pop(0)
        rnd = rounds[src]
        if isinstance(action, SendHello):
            reply, more = rounds[action.peer].on_hello(src, action.hello, 0.0)
            queue += [(action.peer, a) for a in more] + [(src, a) for a in rnd.on_hello(action.peer, reply, 0.0)[1]]
        elif isinstance(action, NeedShards):
            queue += [(src, a) for a in rnd.provide_shards([pack([BIT[src]] * (b - a)) for a, b in action.bounds], 0.0)]
        elif isinstance(action, SendPart):
            parts.append(action.part)
            queue += [(action.peer, a) for a in rounds[action.peer].on_part(src, action.part, action.data, 0.0)[1]]
        elif isinstance(action, SendResult):
            queue += [(action.peer, a) for a in rounds[action.peer].on_result(src, action.result, action.data, 0.0)[1]]
        elif isinstance(action, CombineShard):
            total = [sum(v) for v in zip(*(unpack(d) for d in action.parts.values()))]
            queue += [(src, a) for a in rnd.combined(pack(total), {}, 0.0, action.shard)]
        elif isinstance(action, Finished):
            outcomes[src] = action.outcome
    return outcomes, parts


def test_a_round_with_several_pieces_a_shard_sums_every_piece():
    numel, limit = 23, 3  # shards of 8, 8, 7 elements in 3 pieces each
    outcomes, parts = run_round(numel, limit)
    assert sorted(outcomes) == list(PEERS)
    for peer, outcome in outcomes.items():
        assert outcome.pieces == 3 and not outcome.missing and not outcome.left_out
        assert sorted(outcome.results) == list(range(9))
        values = [v for i in range(9) for v in unpack(outcome.results[i])]
        assert values == [sum(BIT.values())] * numel  # every element: the sum over all members
        assert [outcome.owner(i) for i in range(9)] == [p for p in PEERS for _ in range(3)]
        assert all(count == 3 for count in outcome.contributors.values())
    assert len(parts) == 3 * 2 * 3 and {p.piece for p in parts} == {0, 1, 2}  # 3 members x 2 owners x 3 pieces
    assert all(isinstance(p, Part) and p.numel <= limit for p in parts)

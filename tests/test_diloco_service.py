"""The DiLoCo driver's own judgement of peers: whom it believes is ahead, whom it stops meeting."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("torch")

from p2pswarm.dht.ranking import Standing
from p2pswarm.diloco.outer import OuterConfig, OuterOptimizer
from p2pswarm.diloco.policy import STRIKE_ROUNDS, STRIKES, result_check
from p2pswarm.diloco.service import DilocoService
from p2pswarm.model.catalog import get_model
from p2pswarm.run.diloco import DilocoSettings

ME, AHEAD, STRANGER = "12D3KooWme", "12D3KooWahead", "12D3KooWstranger"


def service(record_round: int = 5) -> DilocoService:
    record = SimpleNamespace(peer_id=AHEAD, capacity=SimpleNamespace(outer_round=record_round))
    stage_map = SimpleNamespace(stages={1: [record]}, workers=lambda: {1: {AHEAD}},  # AHEAD seen working
                                standings=lambda: lambda peer: Standing.WORKING)
    s = DilocoService(settings=DilocoSettings(), spec=get_model("tiny-lm/2"), stage=1, me=ME, pool=None,
                      stage_map=stage_map)
    s.outer = SimpleNamespace(rounds=3)
    return s


def test_a_later_round_is_believed_from_a_known_replica_up_to_its_record_plus_one():
    s = service(record_round=5)
    s._note_ahead(AHEAD, 6)
    assert s._behind == (AHEAD, 6)


@pytest.mark.parametrize("peer, claimed", [(AHEAD, 7), (AHEAD, 10**18), (AHEAD, 3), (STRANGER, 4)])
def test_a_claim_beyond_the_signed_record_or_from_a_stranger_is_ignored(peer, claimed):
    s = service(record_round=5)
    s._note_ahead(peer, claimed)
    assert s._behind is None


@pytest.mark.parametrize("model, met", [("tiny-lm/2", {AHEAD}), ("tiny-lm/1", {AHEAD, STRANGER})])
def test_a_replica_that_only_answered_is_met_only_where_no_work_crosses_a_boundary(model, met):
    """Answering costs nothing: 64 answering fakes must not be invited. Where stages exchange micro-batches,
    replicas are met once their work is seen (router exploration links disjoint chains); a run of one stage
    has no such work to see, so there they are met on probation."""
    records = [SimpleNamespace(peer_id=p, capacity=SimpleNamespace(outer_round=0)) for p in (AHEAD, STRANGER)]
    stage_map = SimpleNamespace(stages={0: records}, workers=lambda: {0: {AHEAD}},
                                standings=lambda: lambda peer: Standing.WORKING if peer == AHEAD else Standing.VOUCHED)
    s = DilocoService(settings=DilocoSettings(), spec=get_model(model), stage=0, me=ME, pool=None,
                      stage_map=stage_map)
    s.outer = SimpleNamespace(rounds=0)
    assert s._replicas() == met


def test_a_peer_refused_in_enough_recent_rounds_is_no_longer_met():
    s = service()
    outer = s.outer
    for round_ in range(STRIKES - 1):
        outer.rounds = round_
        s.strikes.refuse(AHEAD, outer.rounds, "cosine -1")
    assert not s.strikes.barred(AHEAD, outer.rounds) and AHEAD in s._replicas()
    outer.rounds = STRIKES - 1
    s.strikes.refuse(AHEAD, outer.rounds, "cosine -1")
    assert s.strikes.barred(AHEAD, outer.rounds) and AHEAD not in s._replicas()
    assert s.penalties[AHEAD] == STRIKES and s.counts["rejected_contributions"] == STRIKES
    s._note_ahead(AHEAD, outer.rounds + 1)
    assert s._behind is None  # a barred peer cannot make us load its state either
    outer.rounds += STRIKE_ROUNDS  # strikes age out: it is met again
    assert not s.strikes.barred(AHEAD, outer.rounds)


def test_an_owner_aggregate_check_admits_the_mean_of_orthogonal_honest_shards_and_refuses_lies():
    import torch

    from p2pswarm.diloco.aggregation import verify

    gen = torch.Generator().manual_seed(0)
    for members in (2, 4, 8, 16):
        shards = [torch.randn(50_000, generator=gen) for _ in range(members)]
        mean = torch.stack(shards).mean(0)
        check = result_check(members)
        assert verify(mean, shards[0], check).accepted
        assert not verify(-10 * shards[-1], shards[0], check).accepted
        assert not verify(-2 * shards[0], shards[0], check).accepted  # undoes more than our own step
        # noise as long as the honest mean passes: it is what the mean of orthogonal honest shards
        # looks like (and harms no more); with 2 members nothing can tell them apart


def test_a_hello_from_a_peer_not_announced_for_our_stage_never_reaches_the_round():
    import trio

    from p2pswarm.diloco.messages import Hello

    s = service()
    s.outer = SimpleNamespace(rounds=3, numel=10)
    seen = []
    s.round = SimpleNamespace(round=3, on_hello=lambda peer, hello, now: (seen.append(peer) or hello, []))
    hello = Hello(1, 3, 10, "int8", True, False, ())

    async def main():
        reply = await s._on_frame(STRANGER, hello, b"")
        assert not reply.ready and reply.round == 3  # our status, nothing more
        await s._on_frame(AHEAD, hello, b"")

    trio.run(main)
    assert seen == [AHEAD]


@pytest.mark.parametrize("codec", ["int8", "float32"])
def test_a_missing_or_refused_result_applies_nothing_and_carries_our_part(codec):
    """Members that all lack the same result stay equal: nothing is applied there, and our own
    part is sent again next round (in the residual) instead of being applied by us alone."""
    import torch
    import trio

    from p2pswarm.diloco import compression
    from p2pswarm.diloco.round_actions import Outcome

    s = service()
    s.settings = DilocoSettings(codec=codec)
    gen = torch.Generator().manual_seed(1)
    bounds = ((0, 1000), (1000, 2000), (2000, 3000))
    group = tuple(sorted([ME, AHEAD, STRANGER]))
    mine = group.index(ME)
    liar, gone = [i for i in range(3) if i != mine]
    pseudo = torch.randn(3000, generator=gen)
    own = pseudo.clone()
    honest = own[slice(*bounds[mine])]  # our own shard's aggregate: the group's result for it
    results = {mine: compression.encode(honest, codec),
               liar: compression.encode(-10 * own[slice(*bounds[liar])], codec)}
    outcome = Outcome(group, results, missing=(gone,))
    s.outer = OuterOptimizer({"w": torch.zeros(3000)})  # one fragment: the stage
    done = trio.run(s._assemble, outcome, {"pseudo": pseudo, "bounds": bounds})
    aggregated, missing, refused = done.aggregated, done.missing, list(done.refused)
    assert missing == [gone] and refused == [liar] and s.penalties[group[liar]] == 1
    for index in (liar, gone):
        a, b = bounds[index]
        assert bool((aggregated[a:b] == 0).all()) and torch.equal(s.residual[a:b], own[a:b])
    a, b = bounds[mine]
    assert torch.equal(aggregated[a:b], compression.decode(results[mine], codec, b - a))


def test_a_group_of_one_applies_its_own_pseudo_gradient():
    import torch
    import trio

    from p2pswarm.diloco.round_actions import Outcome

    s = service()
    pseudo = torch.arange(10, dtype=torch.float32)
    s.outer = OuterOptimizer({"w": torch.zeros(10)})
    done = trio.run(s._assemble, Outcome((ME,)), {"pseudo": pseudo.clone(), "bounds": ((0, 10),)})
    assert torch.equal(done.aggregated, pseudo) and done.missing == [] and done.refused == {}
    assert s.residual is None
    assert done.pseudo_norm == done.update_norm == float(pseudo.norm())


@pytest.mark.parametrize("codec", ["int8", "float32"])
def test_a_fragment_round_carries_into_its_piece_of_the_stage_residual(codec):
    """Streaming DiLoCo: a round of the second of two fragments carries a missing shard's part into that
    fragment's piece of the stage-sized residual, and leaves the other piece alone."""
    import torch
    import trio

    from p2pswarm.diloco.round_actions import Outcome

    s = service()
    s.settings = DilocoSettings(codec=codec, inner_steps=4, fragments=2)
    s.outer = OuterOptimizer({"w": torch.zeros(10)}, OuterConfig(inner_steps=4, fragments=2))
    s.outer.adopt(torch.zeros(5), step=2)  # round 0 was fragment 0: this round is fragment 1, [5, 10)
    before = torch.full((10,), 7.0) if codec == "int8" else None
    s.residual = None if before is None else before.clone()
    group = tuple(sorted([ME, AHEAD]))
    theirs = group.index(AHEAD)
    bounds = ((0, 3), (3, 5))
    pseudo = torch.arange(1.0, 6.0)
    trio.run(s._assemble, Outcome(group, {}, missing=(theirs,)), {"pseudo": pseudo.clone(), "bounds": bounds})
    a, b = bounds[theirs]
    assert s.residual is not None and s.residual.shape == (10,)
    assert torch.equal(s.residual[5 + a:5 + b], pseudo[a:b])  # our part there: sent again next time
    untouched = torch.zeros(5) if before is None else before[:5]
    assert torch.equal(s.residual[:5], untouched)


def test_an_owner_result_that_does_not_decode_is_refused_and_our_part_carried():
    """An int8 result holding -128 (which no encoder makes) is a lying owner's, not a crash of the round."""
    import torch
    import trio

    from p2pswarm.diloco import compression
    from p2pswarm.diloco.round_actions import Outcome

    s = service()
    group = tuple(sorted([ME, AHEAD]))
    mine, theirs = group.index(ME), group.index(AHEAD)
    bounds = ((0, 2048), (2048, 4096))
    pseudo = torch.randn(4096, generator=torch.Generator().manual_seed(2))
    own = pseudo.clone()
    bad = bytearray(compression.encode(own[slice(*bounds[theirs])], "int8"))
    bad[-1] = 0x80  # the int8 value -128
    results = {mine: compression.encode(own[slice(*bounds[mine])], "int8"), theirs: bytes(bad)}
    s.outer = OuterOptimizer({"w": torch.zeros(4096)})
    done = trio.run(s._assemble, Outcome(group, results), {"pseudo": pseudo, "bounds": bounds})
    assert list(done.refused) == [theirs] and "undecodable" in done.refused[theirs]
    assert s.penalties[AHEAD] == 1
    a, b = bounds[theirs]
    assert bool((done.aggregated[a:b] == 0).all()) and torch.equal(s.residual[a:b], own[a:b])


def test_a_hello_failing_after_the_group_was_agreed_does_not_make_its_peer_gone():
    """A proposal still in flight when the group is agreed may fail late (a stream that would not
    open, a slow answer): the reduction must not then stop sending to that member and waiting for
    it (the others would wait REDUCE_S for its part). Before the agreement, it does count."""
    import trio

    from p2pswarm.diloco.messages import Hello
    from p2pswarm.diloco.round import Phase
    from p2pswarm.errors import DialError

    class NoStream:
        def lease(self, peer, protocol, timeout=None):
            raise DialError(f"failed to open a stream to {peer}")

    for phase, reported in ((Phase.REDUCE, []), (Phase.AGREE, [AHEAD])):
        s = service()
        s._pool = NoStream()
        failed = []
        round_ = SimpleNamespace(phase=phase, on_send_failed=lambda peer, now, failed=failed: failed.append(peer) or [])
        trio.run(s._send_hello, round_, AHEAD, Hello(1, 3, 10, "int8", True, False, ()))
        assert failed == reported, phase


def test_only_our_own_snapshot_gives_us_its_error_feedback_residual():
    """A neighbour's residual is what it still has to send: taking it would send it twice."""
    import torch
    import trio

    from p2pswarm.diloco.loading import STATE_FORMAT, outer_config
    from p2pswarm.diloco.outer import OuterOptimizer
    from p2pswarm.swarm.engine import StageEngine

    spec = get_model("tiny-lm/2")
    engine = StageEngine(spec, 1)

    async def with_engine(fn):
        return fn(engine)

    s = service()
    s.swarm = SimpleNamespace(with_engine=with_engine)
    s.outer = OuterOptimizer(engine.params, outer_config(s.settings))
    theirs = torch.full((s.outer.numel,), 0.5)
    state = {"format": STATE_FORMAT, "model": spec.name, "stage": 1, "engine": engine.state_dict(),
             "diloco": s.outer.state_dict(), "feedback": {"residual": theirs}}
    trio.run(s.loader.load_state, state, False)
    assert s.residual is None  # from a neighbour
    trio.run(s.loader.load_state, state, True)
    assert torch.equal(s.residual, theirs)  # our own snapshot, from disk

"""A replica left out of one outer round keeps its own work: it takes the round's new start and
momentum, and its live weights move with the start (``StageLoader._rebase``), instead of being
replaced by the replica's it loaded from (which threw away the tokens it trained in that round)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
trio = pytest.importorskip("trio")

from p2pswarm.diloco.loading import STATE_FORMAT  # noqa: E402
from p2pswarm.diloco.outer import flatten  # noqa: E402
from p2pswarm.errors import RemoteProtocolError  # noqa: E402
from tests.test_diloco_offload import STAGE, replicas  # noqa: E402


def snapshot_of(service, rounds: int) -> dict:
    """A neighbour's snapshot state, its outer state ``rounds`` rounds on with another start and momentum."""
    outer = service.outer.state_dict()
    outer["start"] = outer["start"] + 0.5
    outer["momentum"] = outer["momentum"] + 0.25
    outer["rounds"], outer["round_started_step"] = rounds, 7
    return {"format": STATE_FORMAT, "model": service.spec.name, "stage": STAGE, "engine": {"not": "used"},
            "diloco": outer}


def test_a_replica_one_round_behind_rebases_and_keeps_its_progress():
    async def main():
        left_out, neighbour = replicas(2, 64)
        engine = left_out.swarm.engine
        engine.step = 40
        start, live = left_out.outer.start.clone(), flatten(engine.params).clone()
        state = snapshot_of(neighbour, rounds=1)
        assert await left_out.loader.load_state(state, ours=False, rebase=True)
        assert torch.equal(left_out.outer.start, state["diloco"]["start"])
        assert torch.equal(left_out.outer.momentum, state["diloco"]["momentum"])
        assert left_out.outer.rounds == 1 and left_out.outer.round_started_step == 40 == engine.step
        moved = flatten(engine.params)
        assert torch.allclose(moved - left_out.outer.start, live - start, atol=1e-6)  # our progress, kept
        assert engine.agreed[0] == 1 and torch.equal(engine.agreed[1], left_out.outer.start)
    trio.run(main)


def test_a_replica_further_behind_or_at_prepare_loads_the_whole_state():
    async def main():
        behind, neighbour = replicas(2, 64)
        before = behind.outer.start.clone()
        # the stand-in engine has no load_state_dict: a whole load reaches it and is refused, nothing changed
        for state, rebase in ((snapshot_of(neighbour, rounds=2), True), (snapshot_of(neighbour, rounds=1), False)):
            with pytest.raises(RemoteProtocolError):
                await behind.loader.load_state(state, ours=False, rebase=rebase)
            assert torch.equal(behind.outer.start, before) and behind.outer.rounds == 0
    trio.run(main)


def rejoin_setup(agreed_round: int | None, rounds: int = 1):
    """A replica left out of round 1 and the neighbour that finished it (serving that round's agreed
    backup); the left-out one's stage map shows the neighbour announcing ``agreed_round``'s backup."""
    from types import SimpleNamespace

    from p2pswarm import wire
    from p2pswarm.model.catalog import get_model, param_count

    left_out, neighbour = replicas(2, param_count(get_model("tiny-lm/2"), STAGE))  # a backup is checked whole
    asked = []

    async def serve(peer, message, payload):
        asked.append(message)
        if not message.digest:  # the hot snapshot (the stand-in engine cannot make one)
            return wire.ErrorReply("gone", "no hot snapshot here")
        return await neighbour.loader.server.on_frame(peer, message, payload)

    async def prepare():
        neighbour.outer.load_state_dict(snapshot_of(neighbour, rounds=rounds)["diloco"])
        await neighbour.loader.refresh_agreed()
        backup = neighbour.loader.agreed_backup
        agreed = None if agreed_round is None else (agreed_round, backup.digest)
        left_out.loader._pool.handlers[neighbour.me] = serve
        left_out.loader._stage_map.stages = {STAGE: [SimpleNamespace(peer_id=neighbour.me, agreed=agreed)]}
        return backup

    return left_out, neighbour, asked, prepare


@pytest.mark.parametrize("rounds", [1, 3])
def test_a_replica_behind_rejoins_from_the_agreed_backup_of_its_replicas_round(rounds):
    """On a thin line the hot snapshot (weights, AdamW's moments, start, momentum: 6 copies of the
    stage) never arrived before its version was replaced; the round's agreed backup (start and
    momentum) is what a rebase needs, a third of the bytes, and it stays served by digest. A fetch
    that outlasts rounds leaves the replica several behind: it rebases all the same."""
    async def main():
        left_out, neighbour, asked, prepare = rejoin_setup(agreed_round=rounds, rounds=rounds)
        backup = await prepare()
        engine = left_out.swarm.engine
        engine.step = 40
        start, live = left_out.outer.start.clone(), flatten(engine.params).clone()
        info = await left_out.loader.rejoin(neighbour.me)
        assert info["rebased"] and info["round"] == rounds and info["bytes"] == len(backup.data)
        assert asked and all(m.digest == backup.digest for m in asked)  # never the hot snapshot
        assert torch.equal(left_out.outer.start, neighbour.outer.start)
        assert torch.equal(left_out.outer.momentum, neighbour.outer.momentum)
        assert left_out.outer.rounds == rounds and left_out.outer.round_started_step == 40
        assert torch.allclose(flatten(engine.params) - left_out.outer.start, live - start, atol=1e-6)
        assert left_out.loader.agreed_backup.digest == backup.digest  # it now announces what the others do
    trio.run(main)


@pytest.mark.parametrize("agreed_round", [None, 0])
def test_without_a_later_rounds_backup_announced_a_rejoin_asks_for_the_hot_snapshot(agreed_round):
    async def main():
        left_out, neighbour, asked, prepare = rejoin_setup(agreed_round)
        await prepare()
        before = left_out.outer.start.clone()
        assert await left_out.loader.rejoin(neighbour.me) is None  # (the stand-in serves no hot snapshot)
        assert [m.digest for m in asked] == [b""] and torch.equal(left_out.outer.start, before)
    trio.run(main)

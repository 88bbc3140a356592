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

"""The API's fair shares of generations (``api/shares.py``), as a state machine against a model."""

from __future__ import annotations

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from p2pswarm.api.shares import MAX_COMPLETIONS, MAX_PER_CLIENT, ClientShares

CLIENTS = ["flood", "a", "b", "c"]


class SharesMachine(RuleBasedStateMachine):
    """Any order of requests and endings: never more than a client's share or the node's total, a request
    within both is always granted, and the flooder leaves the others at least total - share."""

    def __init__(self) -> None:
        super().__init__()
        self.shares, self.model = ClientShares(), dict.fromkeys(CLIENTS, 0)

    @rule(client=st.sampled_from(CLIENTS))
    def take(self, client):
        room = self.model[client] < MAX_PER_CLIENT and sum(self.model.values()) < MAX_COMPLETIONS
        assert (self.shares.take(client) is None) == room
        self.model[client] += room

    @precondition(lambda self: any(self.model.values()))
    @rule(data=st.data())
    def end(self, data):
        client = data.draw(st.sampled_from([c for c, n in self.model.items() if n]))
        self.shares.give_back(client)
        self.model[client] -= 1

    @invariant()
    def bounded(self):
        assert dict(self.shares.held) == {c: n for c, n in self.model.items() if n}
        assert sum(self.model.values()) <= MAX_COMPLETIONS
        assert MAX_COMPLETIONS - self.model["flood"] >= MAX_COMPLETIONS // 2  # what a flood leaves the others


TestShares = SharesMachine.TestCase


def test_bad_shares_are_refused():
    with pytest.raises(ValueError):
        ClientShares(total=4, per_client=5)
    with pytest.raises(ValueError):
        ClientShares(total=4, per_client=0)

"""The node's pure policies: reactions to reachability verdicts, what our stage record says."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from p2pswarm.dht.announce import capacity_flags, record_addrs, stage_record
from p2pswarm.dht.records import FLAG_RELAYED, FLAG_TRAINING, Capacity
from p2pswarm.model.catalog import MODELS, get_model
from p2pswarm.nat.policy import RelayAction, react
from p2pswarm.nat.reachability import Reachability
from p2pswarm.node.config import DhtMode, Role

addrs_st = st.lists(st.sampled_from(["/ip4/203.0.113.9/tcp/4001", "/ip4/10.0.0.2/tcp/4001",
                                     "/ip4/127.0.0.1/tcp/4001"]), unique=True)


@given(st.sampled_from(Reachability), st.sampled_from(Role), st.sampled_from(DhtMode), addrs_st, addrs_st)
def test_reactions_follow_the_rules(verdict, role, mode, confirmed, listening):
    reaction = react(verdict, role=role, dht_mode=mode, confirmed=confirmed, listening=listening)
    if verdict is Reachability.UNKNOWN or role is not Role.JOIN:
        assert reaction.relays is RelayAction.KEEP and reaction.dht_server is None  # nothing new to act on
    else:
        assert reaction.relays is (RelayAction.START if verdict is Reachability.PRIVATE else RelayAction.STOP)
        assert reaction.dht_server == (verdict is Reachability.PUBLIC if mode is DhtMode.AUTO else None)
    if verdict is Reachability.PUBLIC:
        assert reaction.public_addrs == tuple(a for a in confirmed if a not in listening)
    else:
        assert reaction.public_addrs == ()


def test_capacity_flags():
    assert capacity_flags(training=True, private=False) == FLAG_TRAINING
    assert capacity_flags(training=True, private=True) == FLAG_TRAINING | FLAG_RELAYED
    assert capacity_flags(training=False, private=False) == 0


@given(st.sampled_from(sorted(MODELS)), st.data())
def test_our_record_serves_exactly_one_stage(name, data):
    model = get_model(name)
    stage = data.draw(st.integers(0, model.n_stages - 1))
    record = stage_record("peer", ["/ip4/10.0.0.2/tcp/1/p2p/peer"], (), model, stage, Capacity(1, 2, 3), 5.0, 15.0)
    assert (record.start, record.end) == model.stage_range(stage) and record.stage == stage
    assert model.stage_of(record.start, record.end) == stage


def test_record_addrs_rank_confirmed_then_circuits_then_the_rest():
    listen = ["/ip4/10.0.0.2/tcp/1/p2p/me"]
    circuit = "/ip4/203.0.113.5/tcp/4001/p2p/relay/p2p-circuit/p2p/me"
    confirmed = "/ip4/203.0.113.9/tcp/1/p2p/me"
    assert record_addrs([*listen, circuit, confirmed], public=("/ip4/203.0.113.9/tcp/1",)) == (
        confirmed, circuit, *listen)

"""Stage backups between real hosts: a holder fetches, checks and serves a stage's agreed backup; a
mover loads the freshest verified one; forged and stale copies are refused. And DiLoCo's side: a
loaded backup becomes the engine's weights and outer state, and is announced with the same digest."""

from __future__ import annotations

import time
from contextlib import AsyncExitStack
from types import SimpleNamespace

import pytest
import torch
import trio

from p2pswarm.dht.records import BackupClaim, Capacity, StageRecord
from p2pswarm.diloco import snapshots
from p2pswarm.diloco.backup_service import BackupService, Held
from p2pswarm.diloco.backups import BACKUP_LINE_SHARE, check_backup, digest, encode_backup
from p2pswarm.diloco.service import DilocoService
from p2pswarm.errors import DialError
from p2pswarm.identity import generate_identity
from p2pswarm.model.catalog import MODELS, param_count
from p2pswarm.net.connect import Connector
from p2pswarm.net.host import connect, open_host, peer_info_from_multiaddr
from p2pswarm.net.pool import StreamPool
from p2pswarm.run.diloco import DilocoSettings

pytestmark = pytest.mark.timeout(120)

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
SPEC = MODELS["tiny-lm"]
RUN = SimpleNamespace(identity="fdd1f91421b0282a", run_bytes=bytes.fromhex("fdd1f91421b0282a"))
STAGE = 1
BUDGET = 64 * 1024 * 1024  # bytes: a few tiny-lm backups


def backup_bytes(round_: int, fill: float = 0.0) -> bytes:
    numel = param_count(SPEC, STAGE)
    return encode_backup(SPEC.name, STAGE, RUN.identity, round_, torch.full((numel,), fill), torch.zeros(numel))


def record(peer: str, stage: int, agreed=None, backups=()) -> StageRecord:
    start, end = SPEC.stage_range(stage)
    return StageRecord(peer, (), SPEC.name, stage, start, end, Capacity(0, 0), time.time(), 60.0, RUN.identity,
                       agreed, tuple(backups))


class FakeStageMap:
    """What BackupService reads of a StageMap: ``current``, ``stages`` and ``workers`` (every peer but those
    in ``idle``: records of peers that did no work)."""

    def __init__(self, records=(), idle=()) -> None:
        self.idle = set(idle)
        self.set(records)

    def workers(self) -> dict[int, set[str]]:
        return {stage: {r.peer_id for r in records if r.peer_id not in self.idle}
                for stage, records in self.stages.items()}

    def set(self, records) -> None:
        self.stages: dict[int, list[StageRecord]] = {}
        for r in records:
            self.stages.setdefault(r.stage, []).append(r)

    async def current(self, wait: float = 0.0) -> dict[int, list[StageRecord]]:
        return self.stages


def service(pool, me: str, stage_map, **kwargs) -> BackupService:
    """A holder that refreshes whenever a round is due (``line_share`` 1: these tests check what a
    refresh takes and refuses, not how often it may run: ``refresh_due``'s properties do that)."""
    kwargs.setdefault("line_share", 1.0)
    return BackupService(pool=pool, stage_map=stage_map, model=SPEC, run=RUN, me=me,
                         directory=kwargs.pop("directory", None), budget_bytes=kwargs.pop("budget_bytes", BUDGET),
                         **kwargs)


def swarm_of(count: int, test) -> None:
    """``test(pools, ids)``: ``count`` real hosts, each with a pool, all connected to one another."""

    async def main():
        async with AsyncExitStack() as stack:
            hosts = [await stack.enter_async_context(open_host(generate_identity(), LOOPBACK)) for _ in range(count)]
            async with trio.open_nursery() as nursery:
                pools = [StreamPool(host, nursery, Connector(host, nursery)) for host in hosts]
                for i, host in enumerate(hosts):
                    for other in hosts[i + 1:]:
                        await connect(host, peer_info_from_multiaddr(str(other.get_addrs()[0])))
                with trio.fail_after(90):
                    await test(pools, [str(host.get_id()) for host in hosts])
                nursery.cancel_scope.cancel()

    trio.run(main)


def replica_server(data: bytes, round_: int) -> snapshots.SnapshotServer:
    """A replica of STAGE serving its agreed backup ``data`` of ``round_`` by digest (as DilocoService does)."""
    async def make():
        raise AssertionError("a holder asks for the agreed backup by digest, never for a hot snapshot")

    server = snapshots.SnapshotServer(SPEC.name, STAGE, make, run=RUN.run_bytes)
    server.add_agreed(snapshots.Snapshot(data, round_, 0, 0.0))
    return server


def forged(claimed: bytes, data: bytes) -> snapshots.Snapshot:
    """A snapshot of ``data`` that says its digest is ``claimed``."""
    snapshot = snapshots.Snapshot(data, 9, 0, 0.0)
    snapshot.__dict__["digest"] = claimed  # the cached property, set to a lie
    return snapshot


def test_a_holder_fetches_checks_and_serves_a_backup_and_a_mover_loads_it(tmp_path):
    data = backup_bytes(3, fill=0.25)

    async def test(pools, ids):
        replica, holder, mover = ids
        replica_map = FakeStageMap()
        replica_side = service(pools[0], replica, replica_map)
        replica_side.stage = STAGE
        replica_side.attach_server(replica_server(data, 3))
        replica_side.register()
        holder_map = FakeStageMap([record(replica, STAGE, agreed=(3, digest(data))), record(holder, 0)])
        held_by = service(pools[1], holder, holder_map, directory=tmp_path)
        held_by.stage = 0
        held_by.register()
        await held_by.check_once()
        assert STAGE in held_by.duties and held_by.claims() == (BackupClaim(STAGE, 3, digest(data)),)
        assert held_by.bytes_fetched == len(data) and list(tmp_path.iterdir()) == [tmp_path / "stage1-round3.backup"]
        # the replica is gone; the mover saw its announcements, and the holder's claim
        mover_map = FakeStageMap([record(replica, STAGE, agreed=(3, digest(data)))])
        moving = service(pools[2], mover, mover_map)
        await moving.check_once()  # (it holds nothing itself: duties of another peer)
        mover_map.set([record(holder, 0, backups=held_by.claims())])
        assert await moving.fetch_freshest(STAGE, newer_than=3) is None and moving.bytes_fetched == 0
        state, info = await moving.fetch_freshest(STAGE, newer_than=0)  # what a loader asks: past round 0
        assert (info["holder"], info["round"], info["bytes"]) == (holder, 3, len(data))
        assert state["round"] == 3 and torch.equal(state["start"], torch.full((param_count(SPEC, STAGE),), 0.25))
        assert held_by.bytes_served == len(data) and moving.bytes_fetched == len(data)
        doc = held_by.doc()
        assert doc["held"][0]["stage"] == STAGE and doc["held"][0]["digest"] == digest(data).hex()
        # a restarted holder reads its copy back from disk
        again = service(pools[1], holder, FakeStageMap(), directory=tmp_path)
        await trio.to_thread.run_sync(again._read_directory)
        assert again.claims() == held_by.claims()

    swarm_of(3, test)


def test_a_forged_blob_is_refused_and_the_honest_holder_used():
    honest_data, forged_data = backup_bytes(4), backup_bytes(4, fill=9.0)
    true_digest = digest(honest_data)

    async def test(pools, ids):
        liar, honest, mover = ids
        liar_side = service(pools[0], liar, FakeStageMap())
        liar_side._held[STAGE] = Held(STAGE, forged(true_digest, forged_data), time.time(), "lie")
        honest_side = service(pools[1], honest, FakeStageMap())
        honest_side._held[STAGE] = Held(STAGE, snapshots.Snapshot(honest_data, 4, 0, 0.0), time.time(), "x")
        for side in (liar_side, honest_side):
            side.register()
        moving = service(pools[2], mover, FakeStageMap())
        moving.ledger.observe([record("gone-replica", STAGE, agreed=(4, true_digest))], time.time())
        claim = BackupClaim(STAGE, 4, true_digest)
        moving._stage_map.set([record(liar, 0, backups=(claim,))])
        assert await moving.fetch_freshest(STAGE) is None  # the liar's bytes do not hash to the trusted digest
        assert moving.refused["refused"] == 1 and "digest" in moving.recent_refusals[0]["detail"]
        moving._stage_map.set([record(liar, 0, backups=(claim,)), record(honest, 2, backups=(claim,))])
        state, info = await moving.fetch_freshest(STAGE)
        assert info["holder"] == honest and torch.equal(state["start"], torch.zeros(param_count(SPEC, STAGE)))
        # a digest no replica announced, claimed by one holder alone: not even tried
        moving._stage_map.set([record(liar, 0, backups=(BackupClaim(STAGE, 9, digest(forged_data)),))])
        liar_side._held[STAGE] = Held(STAGE, snapshots.Snapshot(forged_data, 9, 0, 0.0), time.time(), "lie")
        served = liar_side.bytes_served
        assert await moving.fetch_freshest(STAGE) is None and liar_side.bytes_served == served

    swarm_of(3, test)


def test_a_stale_copy_announced_as_a_newer_round_is_refused():
    old, new = backup_bytes(3), backup_bytes(5, fill=1.0)

    async def test(pools, ids):
        liar_a, liar_b, honest, _mover = ids
        sides = [service(pool, peer, FakeStageMap()) for pool, peer in zip(pools, ids)]
        for side in sides[:3]:
            side.register()
        for side in sides[:2]:  # two colluding holders: the stale round-3 bytes, announced as round 5
            side._held[STAGE] = Held(STAGE, snapshots.Snapshot(old, 5, 0, 0.0), time.time(), "lie")
        sides[2]._held[STAGE] = Held(STAGE, snapshots.Snapshot(old, 3, 0, 0.0), time.time(), "x")
        moving = sides[3]
        moving.ledger.observe([record("gone", STAGE, agreed=(3, digest(old)))], time.time())
        moving.ledger.observe([record("gone", STAGE, agreed=(5, digest(new)))], time.time())
        stale = BackupClaim(STAGE, 5, digest(old))
        moving._stage_map.set([record(liar_a, 0, backups=(stale,)), record(liar_b, 0, backups=(stale,)),
                               record(honest, 2, backups=(BackupClaim(STAGE, 3, digest(old)),))])
        state, info = await moving.fetch_freshest(STAGE)
        assert (info["holder"], info["round"], state["round"]) == (honest, 3, 3)
        assert moving.refused["refused"] == 0  # the honest, trusted claim comes first: the stale one is never used
        moving.ledger = type(moving.ledger)()  # a mover that never saw round 3 or 5 announced
        moving._stage_map.set([record(liar_a, 0, backups=(stale,)), record(liar_b, 0, backups=(stale,))])
        assert await moving.fetch_freshest(STAGE) is None  # two holders agree, but the bytes are round 3's
        assert moving.refused["refused"] == 2 and "round" in moving.recent_refusals[-1]["detail"]

    swarm_of(4, test)


def holder_owing(pools, ids, data: bytes, **kwargs) -> BackupService:
    """A replica of STAGE serving ``data`` as its round-2 backup, and the holder (of stage 0, made with
    ``kwargs``) that owes a backup of STAGE."""
    replica, holder = ids
    replica_side = service(pools[0], replica, FakeStageMap())
    replica_side.stage = STAGE
    replica_side.attach_server(replica_server(data, 2))
    replica_side.register()
    holder_side = service(pools[1], holder, FakeStageMap([record(replica, STAGE, agreed=(2, digest(data))),
                                                           record(holder, 0)]), **kwargs)
    holder_side.stage = 0
    return holder_side


def test_a_backup_over_the_budget_is_neither_held_nor_announced():
    data = backup_bytes(2)

    async def test(pools, ids):
        small = holder_owing(pools, ids, data, budget_bytes=len(data) - 1)
        await small.check_once()
        await small.check_once()
        assert small.claims() == () and small.refused["over_budget"] == 2 and small.doc()["held"] == []

    swarm_of(2, test)


def test_a_holder_does_not_fetch_a_stage_again_before_its_last_fetch_is_paid_for():
    """A fetch that took s seconds keeps that stage's next refresh off the line for s x 9 (BACKUP_LINE_SHARE
    0.1): here the second check, at once, fetches nothing even though the backup was not held."""
    data = backup_bytes(2)

    async def test(pools, ids):
        paced = holder_owing(pools, ids, data, budget_bytes=len(data) - 1, line_share=BACKUP_LINE_SHARE)
        await paced.check_once()
        fetched = paced.bytes_fetched
        await paced.check_once()
        assert fetched == len(data) and paced.bytes_fetched == fetched and paced.refused["over_budget"] == 1

    swarm_of(2, test)


def test_a_loaded_backup_is_our_weights_and_outer_state_and_announced_with_its_digest():
    from p2pswarm.diloco.checkpoint import decode_state
    from p2pswarm.diloco.loading import outer_config
    from p2pswarm.diloco.outer import OuterOptimizer, flatten
    from p2pswarm.swarm.engine import StageEngine

    engine = StageEngine(SPEC, STAGE)

    async def with_engine(fn):
        return fn(engine)

    s = DilocoService(settings=DilocoSettings(), spec=SPEC, stage=STAGE, me="me", pool=None,
                      stage_map=SimpleNamespace(stages={}), run=RUN)
    s.swarm = SimpleNamespace(with_engine=with_engine)
    s.outer = OuterOptimizer(engine.params, outer_config(s.settings))
    numel = s.outer.numel
    data = encode_backup(SPEC.name, STAGE, RUN.identity, 7, torch.linspace(-1, 1, numel), torch.full((numel,), 0.5))
    state = check_backup(decode_state(data), SPEC, STAGE, RUN.identity, 7)
    trio.run(s.loader.load_backup, state)
    assert torch.equal(flatten(engine.params), torch.linspace(-1, 1, numel)) and s.outer.rounds == 7
    assert torch.equal(s.outer.momentum, torch.full((numel,), 0.5))
    outer = s.outer
    assert engine.step == 7 * s.settings.inner_steps == outer.round_started_step and not engine.optimizer.state
    assert s.loader.agreed_claim() == (7, digest(data))  # every replica that loads it announces what the holders hold


def test_a_split_takes_only_the_backup_its_record_claims_never_the_snapshot_instead(monkeypatch):
    """A met replica claims our round with a smaller agreed digest but does not serve that backup: we take
    nothing this round (its hot snapshot is bound by no claim), and try again at the next."""
    peer = "12D3KooWsplit"
    stage_map = SimpleNamespace(stages={STAGE: [record(peer, STAGE, agreed=(3, b"\x00" * 32))]})
    s = DilocoService(settings=DilocoSettings(), spec=SPEC, stage=STAGE, me="me", pool=None, stage_map=stage_map,
                      run=RUN)
    s.loader.agreed_backup = snapshots.Snapshot(b"ours", 3, 0, 0.0)  # our claim: round 3, another digest
    asked, snapshots_loaded = [], []

    async def no_backup(pool, peer, *args, digest=b"", **kwargs):
        asked.append((peer, digest))
        raise DialError("not served")

    async def catch_up(peers, rebase=False):
        snapshots_loaded.append(peers)

    monkeypatch.setattr(snapshots, "fetch_snapshot", no_backup)
    monkeypatch.setattr(s.loader, "catch_up", catch_up)
    assert trio.run(s.loader.settle_split, frozenset({peer})) is None
    assert asked == [(peer, b"\x00" * 32)] and snapshots_loaded == [] and s.counts["splits"] == 1
    assert trio.run(s.loader.settle_split, frozenset()) is None and len(asked) == 1  # not met: no split


def test_a_backup_that_cannot_be_written_is_not_held(tmp_path):
    data = backup_bytes(2)
    blocked = tmp_path / "file"
    blocked.write_bytes(b"")  # a file where the backup directory should be: mkdir fails

    async def test(pools, ids):
        side = holder_owing(pools, ids, data, directory=blocked / "backups")
        await side.check_once()
        assert side.claims() == () and side.refused["disk"] == 1

    swarm_of(2, test)


def test_run_is_the_loop_not_the_run_spec():
    side = service(None, "me", FakeStageMap())
    assert side.run_spec is RUN and callable(side.run)


def test_a_held_copy_of_the_stage_we_move_into_is_kept_until_another_replica_serves_it():
    async def test():
        me, other = "me", "other"
        stage_map = FakeStageMap([record(me, STAGE)])  # we announce the stage we moved into: its only replica
        side = service(None, me, stage_map)
        side._held[STAGE] = Held(STAGE, snapshots.Snapshot(backup_bytes(3), 3, 0, 0.0), time.time(), "x")
        side.stage = STAGE
        await side.check_once()
        assert STAGE in side._held and side.claims() == ()  # kept (we may still load it), never announced
        state, info = await side.fetch_freshest(STAGE)  # (the ledger never saw it: a restart read it from disk)
        assert info["holder"] == me and state["round"] == 3
        stage_map.set([record(me, STAGE), record(other, STAGE)])
        await side.check_once()
        assert STAGE not in side._held  # another replica serves it: our copy is dropped

    trio.run(test)


def test_the_copy_a_refresh_replaced_is_still_served_until_the_next():
    first, second, third = backup_bytes(3), backup_bytes(4, fill=1.0), backup_bytes(5, fill=2.0)

    async def test():
        side = service(None, "me", FakeStageMap())
        side.stage = 0
        for round_, data in ((3, first), (4, second)):
            await side._hold(STAGE, data, round_, "x")
        assert side.held_snapshot(STAGE, digest(second)).data == second
        assert side.held_snapshot(STAGE, digest(first)).data == first  # a fetch of it in progress completes
        await side._hold(STAGE, third, 5, "x")
        assert side.held_snapshot(STAGE, digest(first)) is None and side.held_snapshot(STAGE, digest(second))
        assert side.claims() == (BackupClaim(STAGE, 5, digest(third)),)  # only the newest is announced

    trio.run(test)


class Unreachable:
    """A pool whose every peer is unreachable; it notes whom it was asked for."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    def lease(self, peer: str, protocol: str):
        self.asked.append(peer)
        raise DialError(f"{peer} is unreachable")


def test_a_held_backup_is_refreshed_only_every_rounds_rounds():
    held = backup_bytes(3)

    async def test():
        newer = (4, digest(backup_bytes(4, fill=1.0)))
        stage_map = FakeStageMap([record("replica", STAGE, agreed=newer), record("me", 0)])
        side = service(Unreachable(), "me", stage_map, every_rounds=2)
        side.stage = 0
        await side._hold(STAGE, held, 3, "x")
        await side.check_once()
        assert STAGE in side.duties and side.claims() == (BackupClaim(STAGE, 3, digest(held)),)
        assert side._pool.asked == []
        side.every_rounds = 1
        await side.check_once()  # now due: the fetch is tried (the replica is unreachable)
        assert side._pool.asked == ["replica"] and side.refused["unreachable"] == 1
        assert side.claims() == (BackupClaim(STAGE, 3, digest(held)),)  # the older copy is kept meanwhile

    trio.run(test)


def test_a_replica_announcing_a_false_agreed_digest_is_struck_within_the_round_and_the_true_state_kept():
    """A working replica of STAGE announces round 6 first, with a digest of weights nobody agreed (its
    blob is well-formed: only the replicas can tell). The holder takes it, as it must: one announcement
    is all there is. Once the two honest replicas announce round 6 with the agreed digest, the liar is
    outvoted: struck, none of its announcements trusted again, and the holder holds the true state; a
    peer that only claims the stage (no work) never makes a digest trusted at all."""
    true, false = backup_bytes(6, fill=0.5), backup_bytes(6, fill=9.0)

    async def test(pools, ids):
        liar, honest_a, honest_b, holder = ids
        for pool, peer, data in ((pools[0], liar, false), (pools[1], honest_a, true), (pools[2], honest_b, true)):
            side = service(pool, peer, FakeStageMap())
            side.stage = STAGE
            side.attach_server(replica_server(data, 6))
            side.register()
        holder_map = FakeStageMap([record("claimer", STAGE, agreed=(7, digest(false))), record(holder, 0)],
                                  idle={"claimer"})
        held_by = service(pools[3], holder, holder_map)
        held_by.stage = 0
        held_by.register()
        await held_by.check_once()
        assert held_by.claims() == () and held_by.ledger.newest(STAGE) is None  # a bare claim: nothing trusted
        holder_map.set([record(liar, STAGE, agreed=(6, digest(false))), record(holder, 0)])
        await held_by.check_once()
        assert held_by.claims() == (BackupClaim(STAGE, 6, digest(false)),)  # believed, for now
        holder_map.set([record(liar, STAGE, agreed=(6, digest(false))), record(holder, 0),
                        *(record(honest, STAGE, agreed=(6, digest(true))) for honest in (honest_a, honest_b))])
        await held_by.check_once()
        assert liar in held_by.ledger.struck and held_by.claims() == (BackupClaim(STAGE, 6, digest(true)),)
        assert not held_by.ledger.trusted(STAGE, 6, digest(false))

    swarm_of(4, test)

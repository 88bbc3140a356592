"""Nothing O(shard) of a DiLoCo round runs on the trio loop (issue 14, item 4).

Real ``DilocoService`` replicas meet in one process: a fake engine (a parameter dict that moved
away from a common start), a fake swarm whose ``with_engine`` does what the real one does (the
engine lock, a worker thread), and a pool that hands each frame to the other replica's ``_on_frame``. One
outer round runs as in a node: gather, agree, butterfly reduce, the owners' combines, assemble,
the outer step. The tests record the thread of every tensor step, probe the loop's latency while
4M-element owner combines run, and check the snapshot's hashing, on both sides of a fetch.
"""

from __future__ import annotations

import contextlib
import os
import threading
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
import trio  # noqa: E402

from p2pswarm.diloco import aggregation, compression, contribution, messages, offload, snapshots  # noqa: E402
from p2pswarm.diloco.loading import outer_config  # noqa: E402
from p2pswarm.diloco.outer import OuterOptimizer  # noqa: E402
from p2pswarm.diloco.service import DilocoService  # noqa: E402
from p2pswarm.model.catalog import get_model  # noqa: E402
from p2pswarm.run.diloco import DilocoSettings  # noqa: E402

pytestmark = pytest.mark.timeout(300)

STAGE = 1


class Engine:
    def __init__(self, numel: int) -> None:
        gen = torch.Generator().manual_seed(0)  # the same start weights on every replica
        self.params = {"a": torch.randn(numel // 2, generator=gen), "b": torch.randn(numel - numel // 2, generator=gen)}
        self.step = 0
        self.tokens = self.micro_batches = 0  # trained into the weights (a round's account records them)

    def weights_changed(self) -> None:
        pass

    def agree(self, round_: int, flat: torch.Tensor) -> None:
        """An outer round's agreed weights (the real engine keeps them for held-out evaluation)."""
        self.agreed = (round_, flat)


class Swarm:
    """What DilocoService uses of a SwarmService: the engine, behind its lock, in a worker thread."""

    def __init__(self, engine: Engine) -> None:
        self.engine, self.engine_lock = engine, trio.Lock()

    async def with_engine(self, fn):
        async with self.engine_lock:
            return await trio.to_thread.run_sync(fn, self.engine)


class Pool:
    """Streams to in-process handlers: a frame written is answered by ``handlers[peer](me, msg, data)``."""

    def __init__(self, handlers: dict, me: str) -> None:
        self.handlers, self.me = handlers, me

    def serve(self, *args, **kwargs) -> None:
        pass

    @contextlib.asynccontextmanager
    async def lease(self, peer: str, protocol: str, timeout=None):
        sent = []
        handler = self.handlers[peer]

        async def write_frame(msg, data=b""):
            sent.append((msg, data))

        async def read_frame(max_payload, timeout=None):
            reply = await handler(self.me, *sent.pop())
            return reply if isinstance(reply, tuple) else (reply, b"")

        yield SimpleNamespace(write_frame=write_frame, read_frame=read_frame)


class StageMap:
    """Every replica seen working (``StageMap.workers``)."""

    def __init__(self, ids) -> None:
        self.stages = {STAGE: [SimpleNamespace(peer_id=p, capacity=SimpleNamespace(outer_round=0)) for p in ids]}
        self.ids = set(ids)

    def workers(self) -> dict[int, set[str]]:
        return {STAGE: set(self.ids)}

    def saw(self, peer: str, stage: int, weight: float = 1.0) -> None:
        pass

    def standings(self):
        from p2pswarm.dht.ranking import Standing

        return lambda peer: Standing.WORKING

    async def refresh_stages(self, stages) -> None:
        pass


def replicas(n: int, numel: int, **settings) -> list[DilocoService]:
    """``n`` replicas of one stage, each moved from the common start by a shared direction plus its own noise."""
    ids = [f"12D3KooWreplica{i}" for i in range(n)]
    handlers: dict = {}
    common = torch.randn(numel, generator=torch.Generator().manual_seed(99))
    out = []
    for i, me in enumerate(ids):
        s = DilocoService(settings=DilocoSettings(inner_steps=1, gather_s=30.0, **settings),
                          spec=get_model("tiny-lm/2"), stage=STAGE, me=me, pool=Pool(handlers, me),
                          stage_map=StageMap(ids))
        engine = Engine(numel)
        s.swarm = Swarm(engine)
        s.outer = OuterOptimizer(engine.params, outer_config(s.settings))
        own = torch.randn(numel, generator=torch.Generator().manual_seed(i + 1))
        delta = -1e-2 * (common + 0.5 * own)
        engine.params["a"] += delta[:numel // 2]
        engine.params["b"] += delta[numel // 2:]
        engine.step = 1  # one inner step: a round is due
        handlers[me] = s._on_frame
        out.append(s)
    return out


async def one_round(services: list[DilocoService], *also) -> None:
    """Run the services until each has finished one outer round (and ``also`` beside them)."""
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            for task in also:
                nursery.start_soon(task)
            for s in services:
                nursery.start_soon(s.run, s.swarm)
            while not all(s.counts["rounds"] for s in services):
                await trio.sleep(0.01)
            nursery.cancel_scope.cancel()


def recording(calls: list, name: str, fn):
    def wrapper(*args, **kwargs):
        calls.append((name, threading.get_ident()))
        return fn(*args, **kwargs)
    return wrapper


def test_every_heavy_step_of_a_round_runs_in_a_worker_thread(monkeypatch):
    """Three replicas (so that owners verify the parts and members check the results): every
    decode, encode, verification, combine, norm, flatten and outer-step runs off the loop, and
    the replicas leave the round with the same start weights."""
    calls: list[tuple[str, int]] = []
    for module, names in ((compression, ("encode", "decode")), (aggregation, ("combine", "verify")),
                          (offload, ("combine_shard", "assemble")), (contribution, ("flatten",))):
        for name in names:
            monkeypatch.setattr(module, name, recording(calls, name, getattr(module, name)))
    for cls, name in ((OuterOptimizer, "pseudo_gradient"), (OuterOptimizer, "outer_step"), (torch.Tensor, "norm")):
        monkeypatch.setattr(cls, name, recording(calls, name, getattr(cls, name)))
    services = replicas(3, 30_000)
    loop = []

    async def main():
        loop.append(threading.get_ident())
        await one_round(services)

    trio.run(main)
    on_loop = sorted({name for name, thread in calls if thread == loop[0]})
    assert on_loop == [], f"on the trio thread: {on_loop}"
    assert {name for name, _ in calls} == {"encode", "decode", "combine", "verify", "combine_shard", "assemble",
                                          "flatten", "pseudo_gradient", "outer_step", "norm"}
    for s in services:
        last = s.history[-1]
        assert len(last["members"]) == 3 and last["missing_shards"] == last["refused_results"] == []
        assert torch.equal(s.outer.start, services[0].outer.start)
        assert not s.penalties and s.counts["rejected_contributions"] == 0


def test_the_loop_keeps_ticking_while_owners_combine_4m_element_shards(monkeypatch):
    """A probe task ticks every millisecond through a round of two replicas, each owning a
    4M-element shard: the loop ticks while each combine runs (counted, no clock read). That
    every heavy step runs off the loop is the thread test above."""
    ticks_during: list[tuple[int, int]] = []  # the probe's tick count when a combine began, ended
    ticks = [0]
    combine_shard = offload.combine_shard

    def counted(*args, **kwargs):
        began = ticks[0]
        try:
            return combine_shard(*args, **kwargs)
        finally:
            ticks_during.append((began, ticks[0]))

    monkeypatch.setattr(offload, "combine_shard", counted)
    services = replicas(2, 2 * 4 * 1024 * 1024)

    async def probe():
        while True:
            ticks[0] += 1
            await trio.sleep(0.001)

    trio.run(one_round, services, probe)
    assert len(ticks_during) == 2 and all(len(s.history[-1]["members"]) == 2 for s in services)
    for began, ended in ticks_during:
        assert ended - began >= 2, "the loop did not run while a combine did"


def test_an_owner_refuses_a_part_that_does_not_decode_and_combines_the_rest():
    """A part with an int8 value of -128 (no encoder makes it) is a refused contribution: before, it
    raised out of the round's driver. Parts that decode are combined as ``aggregation.combine`` does."""
    gen = torch.Generator().manual_seed(3)
    shards = {peer: torch.randn(3000, generator=gen) for peer in ("me", "p1", "p2")}
    parts = {peer: compression.encode(t, "int8") for peer, t in shards.items()}
    bad = bytearray(parts["p2"])
    bad[-1] = 0x80
    result, refused = offload.combine_shard({**parts, "p2": bytes(bad)}, "me", 3000, codec="int8",
                                            aggregator="trimmed_mean", verify=True)
    assert list(refused) == ["p2"] and "undecodable" in refused["p2"]
    decoded = {peer: compression.decode(parts[peer], "int8", 3000) for peer in ("me", "p1")}
    expected = aggregation.combine(decoded, "me", "trimmed_mean", aggregation.VerifyConfig()).result
    assert result == compression.encode(expected, "int8")
    with pytest.raises(ValueError):
        offload.combine_shard({"me": bytes(bad)}, "me", 3000, codec="int8", aggregator="mean", verify=False)


def test_a_sparse_round_sends_a_tenth_of_an_int8_rounds_bytes_and_agrees():
    """Four replicas with the sparse codec and the chunk-clipped mean (issue 27): every member leaves the round
    with the same start weights, moved along the replicas' own direction; a replica sends its three parts at
    width 1 and its own shard's aggregate at width 4 (the union of the members' entries), nothing else; what the
    codec left out of its parts stays in its residual."""
    numel = 40_000
    services = replicas(4, numel, codec="sparse", aggregator="chunk_clip")
    before = services[0].outer.start.clone()
    moved = sum(before - torch.cat([s.swarm.engine.params["a"], s.swarm.engine.params["b"]]) for s in services)
    trio.run(one_round, services)
    step = before - services[0].outer.start
    assert float(torch.nn.functional.cosine_similarity(step, moved, dim=0)) > 0.2
    plan = messages.shard_plan(numel, 4, "sparse")
    for index, s in enumerate(sorted(services, key=lambda s: s.me)):
        assert torch.equal(s.outer.start, services[0].outer.start)
        assert not s.penalties and s.history[-1]["missing_shards"] == s.history[-1]["refused_results"] == []
        parts = sum(messages.expected_bytes("sparse", b - a) for i, (a, b) in enumerate(plan.bounds) if i != index)
        a, b = plan.bounds[index]
        assert s.bytes_sent == parts + 3 * messages.expected_bytes("sparse", b - a, 4)
        assert s.bytes_sent <= messages.bytes_sent(numel, 4, "sparse")  # what the reduce's deadline counts on
        others = numel - (b - a)
        assert parts < 0.01 * messages.expected_bytes("float32", others)
        int8 = messages.expected_bytes("int8", others) + 3 * messages.expected_bytes("int8", b - a)
        assert s.bytes_sent < 0.1 * int8
        assert s.residual is not None and float(s.residual.norm()) > 0


def test_a_snapshot_is_hashed_once_per_version_and_never_on_the_loop(monkeypatch):
    """The server hashed a snapshot for every chunk request (three times for a digest lookup and
    its reply) on the loop; now once per version, in a worker thread. The client joins and hashes
    the whole snapshot in a worker thread too."""
    hashed: list[int] = []
    real = snapshots.hashlib.sha256
    monkeypatch.setattr(snapshots, "hashlib", SimpleNamespace(sha256=recording(hashed, "sha256", real)))
    data = os.urandom(2 * snapshots.CHUNK_BYTES + 123)

    async def make():
        return snapshots.Snapshot(data, 4, 40, trio.current_time())

    server = snapshots.SnapshotServer("m", STAGE, make)
    loop = []

    async def main():
        loop.append(threading.get_ident())
        pool = Pool({"server": server.on_frame}, "client")
        return await snapshots.fetch_snapshot(pool, "server", "m", STAGE)

    fetched = trio.run(main)
    assert fetched.data == data and (fetched.round, fetched.step) == (4, 40)
    assert server.requests > 1 and server.served == len(data)  # chunk by chunk (fetch_pace.py sizes them)
    assert len(hashed) == 2 and all(thread != loop[0] for _, thread in hashed)  # one per side

"""The snapshot protocol: its messages are total and bounded, and a fetch over real hosts is whole and checked."""

from __future__ import annotations

import dataclasses
import hashlib
import os
from contextlib import AsyncExitStack

import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from p2pswarm import wire
from p2pswarm.dht.records import UNNAMED_RUN_BYTES as UNNAMED
from p2pswarm.diloco import snapshots
from p2pswarm.diloco.snapshots import CHUNK_BYTES, DIGEST_BYTES, Get, Part, Snapshot, SnapshotServer, fetch_snapshot
from p2pswarm.errors import DialError, RemoteProtocolError
from p2pswarm.identity import generate_identity
from p2pswarm.net.connect import Connector
from p2pswarm.net.host import connect, open_host, peer_info_from_multiaddr
from p2pswarm.net.pool import StreamPool

pytestmark = pytest.mark.timeout(120)

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
DIGEST = b"\x01" * DIGEST_BYTES


@given(model=st.text(min_size=1, max_size=64), stage=st.integers(0, 4095),
       digest=st.sampled_from([b"", DIGEST]), offset=st.integers(0, 2**31 - 1), length=st.integers(0, CHUNK_BYTES))
def test_a_get_round_trips(model, stage, digest, offset, length):
    message = Get(model, stage, digest, offset, b"\0" * 8, length)
    assert wire.decode_frame(wire.encode_frame(message)) == (message, b"")


@given(total=st.integers(1, 3 * CHUNK_BYTES), data=st.data())
@settings(max_examples=50)
def test_a_part_round_trips_and_its_payload_must_fit(total, data):
    offset = data.draw(st.integers(0, total - 1))
    size = min(CHUNK_BYTES, total - offset)
    message = Part("tiny-lm/2", 1, 3, 40, DIGEST, total, offset)
    payload = b"x" * size
    assert wire.decode_frame(wire.encode_frame(message, payload)) == (message, payload)
    with pytest.raises(RemoteProtocolError):
        message.check(size + 1)
    with pytest.raises(RemoteProtocolError):
        message.check(0)


@pytest.mark.parametrize("message", [
    Get("", 0, b"", 0), Get("m", -1, b"", 0), Get("m", 4096, b"", 0), Get("m", 0, b"\x00" * 5, 0),
    Get("m", 0, b"", -1), Get("m", 0, b"", snapshots.MAX_SNAPSHOT_BYTES), Get("m", 0, b"", 0, b"\0" * 7),
    Get("m", 0, b"", 0, b"\0" * 8, -1), Get("m", 0, b"", 0, b"\0" * 8, CHUNK_BYTES + 1),
    Part("m", 0, 0, 0, b"", 10, 0), Part("m", 0, -1, 0, DIGEST, 10, 0), Part("m", 0, 0, 0, DIGEST, 0, 0),
    Part("m", 0, 0, 0, DIGEST, 10, 10), Part("m", 0, 0, 0, DIGEST, snapshots.MAX_SNAPSHOT_BYTES + 1, 0),
])
def test_out_of_bounds_fields_are_refused(message):
    with pytest.raises(RemoteProtocolError):
        message.check(1)


@given(st.binary(max_size=200))
def test_arbitrary_bytes_decode_or_raise_remote_protocol_error(data):
    try:
        wire.decode_frame(data)
    except RemoteProtocolError:
        pass


def with_server(test, make, server=SnapshotServer):
    """Run ``test(pool, server_id)`` with a real host serving ``server("m", 1, make)``."""

    async def main():
        async with AsyncExitStack() as stack:
            host, client = [await stack.enter_async_context(open_host(generate_identity(), LOOPBACK))
                            for _ in range(2)]
            async with trio.open_nursery() as nursery:
                StreamPool(host, nursery).serve(snapshots.PROTOCOL_ID, server("m", 1, make).on_frame)
                await connect(client, peer_info_from_multiaddr(str(host.get_addrs()[0])))
                pool = StreamPool(client, nursery, Connector(client, nursery))
                with trio.fail_after(60):
                    await test(pool, str(host.get_id()))
                nursery.cancel_scope.cancel()

    trio.run(main)


def test_a_snapshot_of_several_chunks_arrives_whole():
    data = os.urandom(2 * CHUNK_BYTES + 12345)
    made = []

    async def make():
        made.append(1)
        return Snapshot(data, 7, 900, trio.current_time())

    async def test(pool, server):
        fetched = await fetch_snapshot(pool, server, "m", 1)
        assert (fetched.data, fetched.round, fetched.step, fetched.peer) == (data, 7, 900, server)
        await fetch_snapshot(pool, server, "m", 1)
        assert len(made) == 1  # a second fetch within FRESH_S gets the same serialisation

    with_server(test, make)


def test_a_snapshot_bigger_than_the_askers_stage_is_refused_at_its_first_reply():
    data = os.urandom(2 * CHUNK_BYTES)

    async def make():
        return Snapshot(data, 0, 0, trio.current_time())

    async def test(pool, server):
        with pytest.raises(RemoteProtocolError, match="claims"):
            await fetch_snapshot(pool, server, "m", 1, max_bytes=CHUNK_BYTES)
        assert (await fetch_snapshot(pool, server, "m", 1, max_bytes=len(data))).data == data

    with_server(test, make)


def test_a_snapshot_that_does_not_match_its_digest_is_refused():
    class Tampered(SnapshotServer):
        async def on_frame(self, peer, message, payload):
            reply = await super().on_frame(peer, message, payload)
            part, chunk = reply
            return part, bytes([chunk[0] ^ 1]) + chunk[1:]

    async def make():
        return Snapshot(os.urandom(1000), 0, 0, trio.current_time())

    async def test(pool, server):
        with pytest.raises(RemoteProtocolError, match="digest"):
            await fetch_snapshot(pool, server, "m", 1)

    with_server(test, make, Tampered)


def test_a_peer_of_another_stage_says_so():
    async def make():
        return Snapshot(b"x", 0, 0, trio.current_time())

    async def test(pool, server):
        with pytest.raises(DialError, match="wrong-stage"):
            await fetch_snapshot(pool, server, "m", 2)

    with_server(test, make)


def test_the_digest_is_the_sha256_of_the_bytes():
    assert Snapshot(b"abc", 0, 0, 0.0).digest == hashlib.sha256(b"abc").digest()


def test_a_peer_of_another_run_serves_nothing():
    async def make():
        raise AssertionError("no snapshot is made for a peer of another run")

    async def test(pool, server):
        with pytest.raises(DialError, match="other-run"):
            await fetch_snapshot(pool, server, "m", 1, run=b"\x01" * 8)

    with_server(test, make)


def test_agreed_backups_are_served_by_digest_the_last_two_kept():
    agreed = [Snapshot(os.urandom(CHUNK_BYTES + 10), round_, 0, 0.0) for round_ in (3, 4, 5)]

    class WithAgreed(SnapshotServer):
        def __init__(self, *args):
            super().__init__(*args)
            for snapshot in agreed:
                self.add_agreed(snapshot)

    async def make():
        return Snapshot(b"hot", 9, 100, trio.current_time())

    async def test(pool, server):
        fetched = await fetch_snapshot(pool, server, "m", 1, digest=agreed[2].digest)
        assert (bytes(fetched.data), fetched.round, fetched.step) == (agreed[2].data, 5, 0)
        assert (await fetch_snapshot(pool, server, "m", 1, digest=agreed[1].digest)).round == 4
        with pytest.raises(DialError, match="gone"):  # only the last KEEP_AGREED are kept
            await fetch_snapshot(pool, server, "m", 1, digest=agreed[0].digest)
        assert bytes((await fetch_snapshot(pool, server, "m", 1)).data) == b"hot"  # no digest: the newest hot one

    with_server(test, make, WithAgreed)


def test_a_reply_with_another_digest_than_asked_is_refused():
    class Substitutes(SnapshotServer):
        async def on_frame(self, peer, message, payload):
            return await super().on_frame(peer, dataclasses.replace(message, digest=b""), payload)

    async def make():
        return Snapshot(b"stale", 1, 0, trio.current_time())

    async def test(pool, server):
        with pytest.raises(RemoteProtocolError, match="asked for version"):
            await fetch_snapshot(pool, server, "m", 1, digest=DIGEST)

    with_server(test, make, Substitutes)


def test_requests_for_other_stages_go_to_the_held_backups_by_digest_only():
    held = Snapshot(os.urandom(5000), 6, 0, 0.0)
    asked = []

    def others(stage, digest):
        asked.append((stage, digest))
        return held if (stage, digest) == (2, held.digest) else None

    def server(model, stage, make):
        return SnapshotServer(model, stage, make, others=others)

    async def make():
        return Snapshot(b"hot", 9, 100, trio.current_time())

    async def test(pool, server_id):
        fetched = await fetch_snapshot(pool, server_id, "m", 2, digest=held.digest)
        assert (bytes(fetched.data), fetched.round) == (held.data, 6)
        with pytest.raises(DialError, match="wrong-stage"):
            await fetch_snapshot(pool, server_id, "m", 3, digest=held.digest)
        with pytest.raises(DialError, match="wrong-stage"):  # no digest: another stage's newest is not ours to say
            await fetch_snapshot(pool, server_id, "m", 2)
        assert (3, held.digest) in asked and all(digest for _, digest in asked)

    with_server(test, make, server)


def cut_at_third_request(data: bytes, requests: list):
    """A server of ``data`` (round 2, step 50) whose handler fails at its third request (the stream is cut),
    noting every request in ``requests``; and its snapshot maker."""
    class CutsOnce(SnapshotServer):
        async def on_frame(self, peer, message, payload):
            requests.append(message)
            if len(requests) == 3:
                raise RuntimeError("the stream is cut")
            return await super().on_frame(peer, message, payload)

    async def make():
        return Snapshot(data, 2, 50, trio.current_time())
    return CutsOnce, make


def test_a_cut_fetch_resumes_where_it_stopped_and_no_byte_is_sent_twice():
    """A stream cut mid-fetch (here the server's handler fails at its third request) used to lose the
    bytes so far: the next try started at byte 0, and on a thin line never completed. Now the next try at
    that version goes on from the byte the cut one reached."""
    data = os.urandom(300_000)
    requests: list[Get] = []
    CutsOnce, make = cut_at_third_request(data, requests)

    async def test(pool, server):
        partials = snapshots.PartialFetches()
        with pytest.raises(DialError):
            await fetch_snapshot(pool, server, "m", 1, partials=partials)
        assert len(partials) == 1
        fetched = await fetch_snapshot(pool, server, "m", 1, partials=partials)
        assert bytes(fetched.data) == data and len(partials) == 0
        served = [m for i, m in enumerate(requests) if i != 2]
        assert fetched.resumed_at == served[2].offset > 0 and served[2].digest == Snapshot(data, 0, 0, 0).digest
        assert sum(m.length for m in served[:-1]) < len(data) <= sum(m.length for m in served)  # none twice
        assert all(0 < m.length <= CHUNK_BYTES for m in requests)

    with_server(test, make, CutsOnce)


def test_a_resumed_fetch_whose_version_is_gone_starts_over_at_the_newest():
    versions = [os.urandom(100_000), os.urandom(90_000)]
    cut = []

    class CutsThenMoves(SnapshotServer):
        async def on_frame(self, peer, message, payload):
            if message.offset and not cut:
                cut.append(message.offset)
                self._versions = []  # the version being fetched is no longer kept
                raise RuntimeError("the stream is cut")
            return await super().on_frame(peer, message, payload)

    async def make():
        return Snapshot(versions.pop(0), 3, 0, trio.current_time())

    async def test(pool, server):
        partials = snapshots.PartialFetches()
        with pytest.raises(DialError):
            await fetch_snapshot(pool, server, "m", 1, partials=partials)
        fetched = await fetch_snapshot(pool, server, "m", 1, partials=partials)
        assert len(fetched.data) == 90_000 and fetched.resumed_at == 0 and not versions

    with_server(test, make, CutsThenMoves)


def test_a_partial_is_resumed_only_for_its_own_stage_run_and_version():
    partials = snapshots.PartialFetches()
    first = Part("m", 1, 0, 0, DIGEST, 100, 0)
    partials.keep(snapshots.Partial("m", 1, b"\0" * 8, first, bytearray(b"x" * 10)))
    partials.keep(snapshots.Partial("m", 1, b"\0" * 8, None, bytearray()))  # nothing fetched: nothing kept
    assert len(partials) == 1
    assert partials.take("m", 2, b"\0" * 8, b"") is None
    assert partials.take("m", 1, b"\1" * 8, b"") is None
    assert partials.take("m", 1, b"\0" * 8, b"\2" * DIGEST_BYTES) is None
    assert partials.take("m", 1, b"\0" * 8, DIGEST).data == b"x" * 10 and len(partials) == 0
    for n in range(snapshots.MAX_PARTIALS + 2):
        partials.keep(snapshots.Partial("m", n, b"\0" * 8, first, bytearray(b"y")))
    assert len(partials) == snapshots.MAX_PARTIALS  # the oldest forgotten first


def test_a_reply_longer_than_asked_is_refused():
    class Ignores(SnapshotServer):
        async def on_frame(self, peer, message, payload):
            return await super().on_frame(peer, dataclasses.replace(message, length=0), payload)

    async def make():
        return Snapshot(os.urandom(200_000), 1, 0, trio.current_time())

    async def test(pool, server):
        with pytest.raises(RemoteProtocolError):
            await fetch_snapshot(pool, server, "m", 1)

    with_server(test, make, Ignores)


def test_a_version_in_use_outlives_newer_ones_until_no_transfer_asks_for_it():
    """On a 0.2 Mbit/s line a joiner's fetch takes minutes, while the disk loop makes a version every
    period: the version it fetches is kept while it keeps asking for it, and only then let go."""
    made = []

    async def make():
        made.append(Snapshot(os.urandom(100), len(made), 0, trio.current_time()))
        return made[-1]

    async def main():
        server = SnapshotServer("m", 1, make)
        first = await server.newest()
        for _ in range(4):  # newer versions, the first still being fetched
            await trio.sleep(snapshots.FRESH_S + 0.1)
            part, _ = await server.on_frame("p", Get("m", 1, first.digest, 10, UNNAMED, 10), b"")
            assert part.digest == first.digest
            await server.newest()
        await trio.sleep(snapshots.IN_USE_S)
        await server.newest()  # no transfer asked for it within IN_USE_S: let go
        reply = await server.on_frame("p", Get("m", 1, first.digest, 10, UNNAMED, 10), b"")
        assert isinstance(reply, wire.ErrorReply) and reply.code == "gone"
        assert len(server._versions) == snapshots.KEEP_VERSIONS

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_an_agreed_backup_in_use_outlives_newer_rounds():
    async def main():
        server = SnapshotServer("m", 1, None)
        agreed = [Snapshot(os.urandom(100), round_, 0, 0.0) for round_ in range(5)]
        server.add_agreed(agreed[0])
        for newer in agreed[1:]:
            part, _ = await server.on_frame("p", Get("m", 1, agreed[0].digest, 10, UNNAMED, 10), b"")
            assert part.digest == agreed[0].digest
            server.add_agreed(newer)
            await trio.sleep(1.0)
        assert [a.round for a in server._agreed] == [0, 3, 4]
        await trio.sleep(snapshots.IN_USE_S)
        server.add_agreed(Snapshot(os.urandom(100), 5, 0, 0.0))
        assert [a.round for a in server._agreed] == [4, 5]

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_resumed_fetch_that_fails_its_digest_starts_over_and_blames_no_peer():
    """The bytes before the cut may have come from another peer: the one that sent the rest is not called
    a liar (a DialError, not a RemoteProtocolError), nothing is kept, and the next try is from byte 0."""
    data = os.urandom(200_000)
    requests: list[Get] = []
    CutsOnce, make = cut_at_third_request(data, requests)

    async def test(pool, server):
        partials = snapshots.PartialFetches()
        with pytest.raises(DialError):
            await fetch_snapshot(pool, server, "m", 1, partials=partials)
        kept = partials.take("m", 1, snapshots.UNNAMED_RUN_BYTES, b"")
        kept.data[0] ^= 1  # a byte an earlier peer lied about (hashed as it came)
        kept.hasher = hashlib.sha256(kept.data)
        partials.keep(kept)
        with pytest.raises(DialError, match="resumed at byte"):
            await fetch_snapshot(pool, server, "m", 1, partials=partials)
        assert len(partials) == 0
        fetched = await fetch_snapshot(pool, server, "m", 1, partials=partials)
        assert bytes(fetched.data) == data and fetched.resumed_at == 0

    with_server(test, make, CutsOnce)

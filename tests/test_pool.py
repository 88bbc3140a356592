"""The bulk stream pool between real libp2p hosts on loopback: leases, whole frames, the inbound
byte budget under several senders of 8-16 MiB frames, and relayed connections (moving off them,
refusing frames a circuit could not carry)."""

from __future__ import annotations

import contextlib
import hashlib
import random
from contextlib import AsyncExitStack

import pytest
import trio
import trio.testing

import p2pswarm.net.budget as budget_module
import p2pswarm.net.pool as pool_module
import p2pswarm.net.pool_inbound as pool_inbound
from p2pswarm import wire
from p2pswarm.errors import CircuitExhausted, DialError
from p2pswarm.identity import generate_identity
from p2pswarm.nat.relay_client import RelayPicker, serve_relay_reservations
from p2pswarm.nat.relay_service import RelayConfig, serve_relay
from p2pswarm.net import write_pace
from p2pswarm.net.budget import BudgetConfig, CircuitLimit
from p2pswarm.net.connect import Connector, connections_to, has_direct, is_relayed
from p2pswarm.net.host import connect, open_host, peer_info_from_multiaddr, set_extra_addrs
from p2pswarm.net.pool import CIRCUIT_LIMIT_ATTR, StreamPool
from p2pswarm.net.streams import open_stream
from tests.test_control import trickle

pytestmark = pytest.mark.timeout(120)

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
BULK = "/p2pswarm/test-bulk/1.0.0"
MIB = 1024 * 1024


def chunk(tag: str, payload: bytes) -> wire.TensorFrame:
    """A data frame whose name carries the payload's digest, so the receiver can check it arrived intact."""
    return wire.TensorFrame(name=f"{tag}:{hashlib.sha256(payload).hexdigest()}", dtype="uint8", shape=(len(payload),))


def intact(message: wire.TensorFrame, payload: bytes) -> bool:
    return message.name.rsplit(":", 1)[1] == hashlib.sha256(payload).hexdigest()


class Receiver:
    """A server handler that checks every payload and acks with its size; peers in ``gated`` wait for ``gate``."""

    def __init__(self) -> None:
        self.frames: list[tuple[str, str, int, bool]] = []  # (peer, tag, size, intact)
        self.gated: set[str] = set()
        self.gate = trio.Event()

    async def __call__(self, peer: str, message: wire.Message, payload: bytes) -> wire.Message:
        if peer in self.gated:
            await self.gate.wait()
        self.frames.append((peer, message.name.rsplit(":", 1)[0], len(payload), intact(message, payload)))
        return wire.Pong(nonce=len(payload))


async def exchange(pool: StreamPool, peer, payload: bytes, tag: str = "x", **lease_args) -> bool:
    """One leased request/ack; True if the lease was relayed."""
    async with pool.lease(peer, BULK, **lease_args) as stream:
        await stream.write_frame(chunk(tag, payload), payload)
        ack, _ = await stream.read_frame(timeout=30)
        assert ack == wire.Pong(nonce=len(payload))
        return stream.relayed


def with_pools(test, n_clients: int = 1, budget: BudgetConfig | None = None, budget_wait: float = 2.0,
               **client_args):
    """Run ``test(server_host, server_pool, receiver, clients)``; each client is (host, pool), connected."""

    async def main():
        async with AsyncExitStack() as stack:
            server, *hosts = [await stack.enter_async_context(open_host(generate_identity(), LOOPBACK))
                              for _ in range(n_clients + 1)]
            async with trio.open_nursery() as nursery:
                server_pool = StreamPool(server, nursery, budget=budget, budget_wait=budget_wait)
                receiver = Receiver()
                server_pool.serve(BULK, receiver)
                clients = []
                for host in hosts:
                    await connect(host, peer_info_from_multiaddr(str(server.get_addrs()[0])))
                    clients.append((host, StreamPool(host, nursery, Connector(host, nursery), **client_args)))
                with trio.fail_after(90):
                    await test(server, server_pool, receiver, clients)
                nursery.cancel_scope.cancel()

    trio.run(main)


async def wait_until(condition, timeout: float = 10.0) -> None:
    with trio.fail_after(timeout):
        while not condition():
            await trio.sleep(0.01)


def test_a_protocol_served_anew_takes_the_next_frames_of_streams_already_open():
    """A move replaces a stage's handlers (node/running.py ``_stop_serving``): a stream opened before must
    not reach the old handler again (once seen: the old DiLoCo service's closed nursery, a traceback)."""
    async def test(server, server_pool, receiver, clients):
        _, pool = clients[0]
        await exchange(pool, server.get_id(), b"a" * 100)
        replacement = Receiver()
        server_pool.serve(BULK, replacement)
        await exchange(pool, server.get_id(), b"b" * 200)
        assert pool.stats.opened == 1 and pool.stats.reused == 1  # the same stream both times
        assert [f[2] for f in receiver.frames] == [100] and [f[2] for f in replacement.frames] == [200]

    with_pools(test)


def test_sequential_leases_use_one_stream_and_warm_opens_ahead():
    async def test(server, server_pool, receiver, clients):
        host, pool = clients[0]
        for n in range(20):
            await exchange(pool, server.get_id(), bytes([n]) * 1000)
        assert pool.stats.opened == 1 and pool.stats.reused == 19
        assert server_pool.budget.stats()["peers"][str(host.get_id())]["streams"] == 1
        assert await pool.warm(server.get_id(), BULK, 3) == 3
        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(exchange, pool, server.get_id(), b"w" * 100_000)
        assert pool.stats.opened == 3 and pool.stats.reused == 22  # the three were all warm
        assert [ok for *_, ok in receiver.frames] == [True] * 23 and server_pool.stats.frames_served == 23
        sent = 20 * 1000 + 3 * 100_000  # every payload, under its protocol
        assert pool.stats.payload_bytes == {BULK: {"sent": sent, "received": 0}}  # (the acks carry none)
        assert server_pool.stats.payload_bytes == {BULK: {"sent": 0, "received": sent}}

    with_pools(test)


def test_an_idle_warm_stream_is_closed_before_the_acceptors_idle_deadline(monkeypatch):
    monkeypatch.setattr(pool_module, "IDLE_RETIRE", 0.3)

    async def test(server, server_pool, receiver, clients):
        host, pool = clients[0]
        await exchange(pool, server.get_id(), b"a" * 1000)
        await exchange(pool, server.get_id(), b"b" * 1000)
        assert pool.stats.opened == 1
        await trio.sleep(0.5)  # the idle time itself is what is tested: no event to wait for
        await exchange(pool, server.get_id(), b"c" * 1000)
        assert pool.stats.opened == 2 and pool.stats.reset == 0  # closed cleanly, a fresh one opened
        await wait_until(lambda: server_pool.budget.stats()["peers"].get(str(host.get_id()), {}).get("streams") == 1)

    with_pools(test)


def test_at_the_cap_a_lease_waits_for_the_stream_and_a_broken_one_is_replaced():
    async def test(server, server_pool, receiver, clients):
        _host, pool = clients[0]
        order, release = [], trio.Event()

        async def breaks():
            with pytest.raises(ValueError):
                async with pool.lease(server.get_id(), BULK) as stream:
                    order.append("first")
                    await stream.write_frame(chunk("first", b"1" * 10), b"1" * 10)
                    await release.wait()
                    raise ValueError("the lessee failed: its stream must not be reused")

        async def waits():
            order.append("second waits")
            await exchange(pool, server.get_id(), b"2" * 10)
            order.append("second done")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(breaks)
            await wait_until(lambda: order == ["first"])
            nursery.start_soon(waits)
            await trio.testing.wait_all_tasks_blocked(cushion=0.05)
            assert order == ["first", "second waits"] and pool.stats.opened == 1  # queued behind the cap
            release.set()
        assert order == ["first", "second waits", "second done"]
        assert pool.stats.opened == 2 and pool.stats.reset == 1 and pool.idle_streams(server.get_id(), BULK) == 1
        async with pool.lease(server.get_id(), BULK):
            with pytest.raises(DialError, match=r"no .* stream"):
                async with pool.lease(server.get_id(), BULK, timeout=0.2):
                    pass

    with_pools(test, streams_per_key=1)


def test_a_stalled_write_retires_the_stream_and_the_receiver_never_sees_a_cut_frame():
    """The receiver holds the sender's whole budget, so it stops reading that sender's next frame;
    the write stalls past its deadline, the stream is reset and never leased again."""

    async def test(server, server_pool, receiver, clients):
        host, pool = clients[0]
        receiver.gated.add(str(host.get_id()))
        held = b"h" * (12 * MIB)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(exchange, pool, server.get_id(), held, "held")  # 12 of 16 MiB, held by the handler
            await wait_until(lambda: server_pool.budget.peer_in_use(str(host.get_id())) > 0)
            with pytest.raises(DialError, match="stalled"):
                async with pool.lease(server.get_id(), BULK) as stream:
                    await stream.write_frame(chunk("cut", held), held, timeout=0.5)
            assert pool.stats.reset == 1 and pool.idle_streams(server.get_id(), BULK) == 0
            receiver.gate.set()
        await wait_until(lambda: server_pool.stats.inbound_refused == 1)  # the cut frame: a reset, not a frame
        receiver.gated.clear()
        await exchange(pool, server.get_id(), b"after" * 1000)
        assert [(tag, ok) for _, tag, _, ok in receiver.frames] == [("held", True), ("x", True)]
        assert pool.stats.opened == 2 and pool.stats.reused == 1  # the held stream came back, the cut one did not

    with_pools(test, budget=BudgetConfig(peer_bytes=16 * MIB, max_peers=2), budget_wait=30.0)


def test_many_senders_of_big_frames_stay_within_the_budget_and_a_greedy_one_is_refused():
    budget = BudgetConfig(peer_bytes=40 * MIB, max_peers=4)
    honest_frames = 3  # per stream, two streams per honest peer: at most 2 x 16 MiB in flight each

    async def test(server, server_pool, receiver, clients):
        rng = random.Random(7)
        data = rng.randbytes(16 * MIB)
        *honest, (greedy_host, greedy_pool) = clients
        greedy = str(greedy_host.get_id())
        receiver.gated.add(greedy)
        refused = []

        async def honest_stream(pool, n):
            for k in range(honest_frames):
                size = rng.randint(8 * MIB, 16 * MIB)
                await exchange(pool, server.get_id(), data[:size], tag=f"{n}.{k}")

        async def flood(stream_no):  # writes 16 MiB frames without ever reading an ack
            try:
                async with greedy_pool.lease(server.get_id(), BULK) as stream:
                    for k in range(3):
                        await stream.write_frame(chunk(f"greedy.{stream_no}.{k}", data), data)
            except DialError as exc:
                refused.append(exc)

        async with trio.open_nursery() as nursery:
            for n, (_, pool) in enumerate(honest):
                nursery.start_soon(honest_stream, pool, n)
                nursery.start_soon(honest_stream, pool, n)
            for stream_no in range(3):
                nursery.start_soon(flood, stream_no)
            await wait_until(lambda: server_pool.budget.refused["timeout"] >= 1, timeout=60)
            receiver.gate.set()
        stats = server_pool.budget.stats()
        assert 2 * 16 * MIB <= stats["high_water"] <= budget.global_bytes
        honest_seen = [f for f in receiver.frames if f[0] != greedy]
        assert len(honest_seen) == len(honest) * 2 * honest_frames and all(ok for *_, ok in honest_seen)
        for host, _ in honest:  # never made to wait, never refused
            assert stats["peers"][str(host.get_id())]["waits"] == 0
            assert stats["peers"][str(host.get_id())]["refused"] == 0
        assert stats["waits"] >= 1 and server_pool.stats.inbound_refused >= 1
        assert refused and all(ok for peer, _, _, ok in receiver.frames if peer == greedy)
        await wait_until(lambda: server_pool.budget.in_use == 0)  # every reservation released

    with_pools(test, n_clients=4, budget=budget, budget_wait=1.0)


def test_a_header_trickled_a_byte_at_a_time_is_cut_at_the_header_deadline(monkeypatch):
    """Slowloris on the pool: a byte now and then held a sender slot for good; a header that began
    must now come whole within HEADER_DEADLINE (waiting for a frame stays idle time)."""
    monkeypatch.setattr(pool_inbound, "HEADER_DEADLINE", 1.0)

    async def test(server, server_pool, receiver, clients):
        host, pool = clients[0]
        header = wire.encode_frame(chunk("slow", b"x" * 10), b"x" * 10)[:-10]
        raw = await open_stream(host, server.get_id(), BULK)
        await trio.sleep(1.5)  # idle, not cut
        cut = await trickle(raw, header[:30], gap=0.1)  # 3 s of it, three header deadlines; never the whole header
        with trio.fail_after(5):
            assert await raw.read(100) == b""  # reset by the server
        assert cut  # cut before the trickle ended
        assert server_pool.stats.inbound_refused == 1
        await exchange(pool, server.get_id(), b"z" * 10)  # the node serves on
        assert [f[1:] for f in receiver.frames] == [("x", 10, True)]

    with_pools(test)


def test_a_payload_arriving_slowly_but_steadily_is_taken_a_stalled_or_trickled_one_is_cut(monkeypatch):
    """A thin line's frame (0.2 Mbit/s) took longer than a 1 MiB/s deadline and was cut: nothing trained. A
    payload now arrives while its bytes keep moving (no stall of STALL_DEADLINE) within the time at the
    slowest frame rate; a stalled one, and a byte-at-a-time trickle, are still cut. Scaled down 10x here."""
    monkeypatch.setattr(pool_inbound, "STALL_DEADLINE", 0.5)
    monkeypatch.setattr(budget_module, "READ_GRAIN", 10)
    monkeypatch.setattr(budget_module, "FRAME_DEADLINE_BASE", 0.5)
    monkeypatch.setattr(budget_module, "SLOWEST_FRAME_RATE", 100)  # B/s: 60 bytes within 1.1 s

    async def header(host, server, payload: bytes):
        """A stream with a frame's header written whole, its payload still to come."""
        frame = wire.encode_frame(chunk("paced", payload), payload)
        raw = await open_stream(host, server.get_id(), BULK)
        await raw.write(frame[:len(frame) - len(payload)])
        return raw

    async def send_paced(host, server, payload: bytes, pieces: list[tuple[int, float]]) -> bool:
        """The payload in (bytes, pause before them) pieces; whether the server reset the stream (its
        read returns EOF) rather than reply."""
        raw, at = await header(host, server, payload), 0
        for size, pause in pieces:
            await trio.sleep(pause)
            with contextlib.suppress(Exception):
                await raw.write(payload[at:at + size])
            at += size
        with trio.fail_after(3):
            return await raw.read(100) == b""

    async def test(server, server_pool, receiver, clients):
        host, _ = clients[0]
        assert not await send_paced(host, server, b"s" * 60, [(10, 0.15)] * 6)  # 0.9 s, steady: taken
        assert await send_paced(host, server, b"t" * 60, [(30, 0.0), (30, 1.0)])  # a 1 s stall: cut
        # a trickle at 20 B/s on a 100 kB claim: cut by its rate within a second, not after the claim's 1,000 s
        assert await trickle(await header(host, server, b"u" * 100_000), b"u" * 200, gap=0.05)
        assert [f[1:] for f in receiver.frames] == [("paced", 60, True)]
        assert server_pool.stats.inbound_refused == 2

    with_pools(test)


def test_identities_idling_on_every_sender_slot_give_way_to_a_peer_that_worked_with_us():
    """16 identities each holding one idle stream took every sender slot of a node, for good. Now a peer the
    node prefers (it worked with us) takes the slot of the least recently active idle one; a stranger is
    still refused while every slot is taken."""
    async def test(server, server_pool, receiver, clients):
        (idle_a, _), (idle_b, _), (worker, worker_pool), (_, stranger_pool) = clients
        server_pool.prefer = lambda peer: peer == str(worker.get_id())
        raws = [await open_stream(host, server.get_id(), BULK) for host in (idle_a, idle_b)]
        await wait_until(lambda: len(server_pool.budget.peers()) == 2)
        with pytest.raises(DialError):
            await exchange(stranger_pool, server.get_id(), b"s" * 10, timeout=5.0)
        await exchange(worker_pool, server.get_id(), b"w" * 10)
        with trio.fail_after(5):
            assert await raws[0].read(100) == b""  # the least recently active idle stream was ended
        assert server_pool.budget.stats()["evictions"] == 1
        assert str(idle_b.get_id()) in server_pool.budget.peers()  # the other keeps its slot
        assert [f[1:] for f in receiver.frames] == [("x", 10, True)]
        for _ in range(3):  # the worker past its own stream limit: refused, and no idle peer pays for it
            with contextlib.suppress(DialError):  # refused before its negotiation ended
                await open_stream(worker, server.get_id(), BULK)
        await wait_until(lambda: server_pool.budget.stats()["refused"].get("streams", 0) >= 1)
        assert server_pool.budget.stats()["evictions"] == 1 and str(idle_b.get_id()) in server_pool.budget.peers()

    with_pools(test, n_clients=4, budget=BudgetConfig(peer_bytes=1 * MIB, max_peers=2, streams_per_peer=2))


def test_oversized_garbage_and_failing_handlers_reset_only_their_stream():
    async def test(server, server_pool, receiver, clients):
        host, pool = clients[0]
        raw = await open_stream(host, server.get_id(), BULK)
        big = wire.TensorFrame(name="big", dtype="uint8", shape=(2 * MIB,))
        await raw.write(wire.encode_frame(big, b"\0" * (2 * MIB))[:1000])  # a header asking for more than a share
        with trio.fail_after(5):
            assert await raw.read(100) == b""  # reset before the payload was read
        assert server_pool.budget.stats()["refused"] == {"too_large": 1}
        raw = await open_stream(host, server.get_id(), BULK)
        await raw.write(b"\x00\x00\x00\x03abc")
        with trio.fail_after(5):
            assert await raw.read(100) == b""
        assert server_pool.stats.inbound_refused == 2

        async def broken(peer, message, payload):
            raise ValueError("bug")

        server_pool.serve(BULK, broken)
        with pytest.raises(DialError):
            await exchange(pool, server.get_id(), b"z" * 10)
        assert server_pool.stats.handler_failures == 1 and pool.stats.reset == 1
        server_pool.serve(BULK, receiver)
        await exchange(pool, server.get_id(), b"z" * 10)
        await wait_until(lambda: server_pool.budget.in_use == 0)

    with_pools(test, budget=BudgetConfig(peer_bytes=1 * MIB, max_peers=2))


# ---------------------------------------------------------------- relayed connections

async def _relay(config: RelayConfig, task_status=trio.TASK_STATUS_IGNORED):
    async with open_host(generate_identity(), LOOPBACK) as host, trio.open_nursery() as nursery:
        await nursery.start(serve_relay, host, config)
        task_status.started(str(host.get_addrs()[0]))
        await trio.sleep_forever()


async def _reserve(host, relay_addr: str, nursery) -> str:
    picker = RelayPicker(random.Random(1))
    picker.add_candidate(relay_addr.rsplit("/p2p/", 1)[1], [relay_addr])
    await nursery.start(lambda task_status: serve_relay_reservations(
        host, picker, lambda addrs: set_extra_addrs(host, addrs), tick=0.2, task_status=task_status))
    await wait_until(lambda: picker.held)
    return f"{relay_addr}/p2p-circuit"


async def dial_direct(a, b) -> None:
    """A direct connection next to the relayed one (``host.connect`` returns early: a connection exists)."""
    conn = await a.get_network()._dial_addr_single_attempt(b.get_addrs()[0], b.get_id())
    await conn.event_started.wait()


def with_relayed_pair(test, relay_config: RelayConfig = RelayConfig()):
    """Run ``test(a_host, a_pool, b_host, b_pool, receiver)`` with A connected to B only through a relay."""

    async def main():
        async with trio.open_nursery() as nursery:
            relay_addr = await nursery.start(_relay, relay_config)
            async with open_host(generate_identity(), LOOPBACK) as a, open_host(generate_identity(), LOOPBACK) as b:
                a_pool = StreamPool(a, nursery, Connector(a, nursery))
                b_pool = StreamPool(b, nursery, Connector(b, nursery))
                receiver = Receiver()
                b_pool.serve(BULK, receiver)
                circuit = await _reserve(b, relay_addr, nursery)
                assert await a_pool._connector.connect(str(b.get_id()), [circuit]) == "relay"
                with trio.fail_after(60):
                    await test(a, a_pool, b, b_pool, receiver)
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_leases_move_off_a_relayed_connection_once_a_direct_one_exists():
    async def test(a, a_pool, b, b_pool, receiver):
        assert await exchange(a_pool, b.get_id(), b"r" * 50_000) is True
        assert await exchange(a_pool, b.get_id(), b"r" * 50_000) is True  # the relayed stream is reused meanwhile
        assert a_pool.stats.opened == 1
        await dial_direct(a, b)  # as a hole punch would
        assert has_direct(a, b.get_id())
        assert await exchange(a_pool, b.get_id(), b"d" * 50_000) is False
        assert a_pool.stats.moved_to_direct == 1 and a_pool.stats.opened == 2
        assert await exchange(a_pool, b.get_id(), b"d" * 50_000) is False
        assert a_pool.stats.opened == 2
        assert sorted(is_relayed(c) for c in connections_to(a, b.get_id())) == [False, True]

    with_relayed_pair(test)


def test_a_frame_the_circuit_cannot_carry_is_refused_before_the_relay_would_cut_it():
    """The relay allows 3 MiB per circuit; frames go until the next would not fit, which is refused
    with CircuitExhausted (a DialError) while the circuit is still up, so it never cuts a frame."""
    limit = 3 * MIB

    async def test(a, a_pool, b, b_pool, receiver):
        for host, other in ((a, b), (b, a)):  # as the relayed dial (HOP) and accept (STOP) could, from the Limit
            [conn] = connections_to(host, other.get_id())
            setattr(conn, CIRCUIT_LIMIT_ATTR, CircuitLimit(seconds=120, bytes=limit))
        frame = b"c" * (256 * 1024)
        sent = 0
        with pytest.raises(CircuitExhausted) as refusal:
            while True:
                assert await exchange(a_pool, b.get_id(), frame) is True
                sent += 1
        assert isinstance(refusal.value, DialError)
        assert sent >= 6 and len(receiver.frames) == sent and all(ok for *_, ok in receiver.frames)
        [usage] = a_pool.status()["relay"]["circuits"]
        assert usage["sent"] > sent * len(frame) and usage["remaining_bytes"] < len(frame) + 16 * 1024
        assert a_pool.status()["relay"]["refused"] == {"bytes": 1} and a_pool.stats.circuit_refusals == 1
        [b_usage] = b_pool.status()["relay"]["circuits"]
        # the receiving side accounts the same connection (its pool serves the streams A opened)
        assert b_usage["received"] == usage["sent"] and b_usage["sent"] == usage["received"]
        # the used-up connection was closed once idle; the next lease reaches B anew and frames flow
        def recycled(count: int) -> bool:  # closed, and forgotten by the swarm
            return a_pool.stats.circuits_recycled == count and not any(
                is_relayed(c) for c in a.get_network().get_connections(b.get_id()))

        await wait_until(lambda: recycled(1))
        delivered = 0
        while delivered < 3 * sent:  # three more circuits' worth, retried as a router would
            try:
                await exchange(a_pool, b.get_id(), frame)
                delivered += 1
            except CircuitExhausted:
                count = a_pool.stats.circuits_recycled + 1
                await wait_until(lambda count=count: recycled(count))
        assert all(ok for *_, ok in receiver.frames) and len(receiver.frames) == 4 * sent

    with_relayed_pair(test, RelayConfig(circuit_bytes=limit))  # the pools' own default would be 16 MiB


@pytest.mark.parametrize("rate", [25_000, 100_000_000])  # bytes/s: a 0.2 Mbit/s line, loopback
def test_a_frame_is_written_in_pieces_so_the_connections_other_streams_get_turns(rate):
    """A bulk frame went to the connection in one write: a ping or a record on another stream of that
    connection waited for all of it (seconds on a thin line). It goes in pieces now, of WRITE_CHUNK on a
    thin line and growing on a fast one to what takes ~10 ms (``write_pace``): 16 KiB pieces cost a 64 MiB
    outer round on loopback a third of its time (on the trio clock, a write taking its bytes / ``rate``, but
    the first, which goes into an empty kernel buffer at once: one such piece grew a thin line's to 32 KiB)."""
    class Raw:
        muxed_conn = None

        def __init__(self) -> None:
            self.writes: list[bytes] = []

        async def write(self, data: bytes) -> None:
            if self.writes:  # the first write goes into an empty kernel buffer at once, whatever the line
                await trio.sleep(len(data) / rate)
            self.writes.append(bytes(data))

    async def main():
        raw = Raw()
        stream = pool_module.PoolStream(raw)
        data = bytes(range(256)) * (8 * 1024 * 1024 // 256)
        await stream.write(data)
        assert b"".join(raw.writes) == data
        longest = max(map(len, raw.writes))
        assert len(raw.writes[0]) == pool_module.WRITE_CHUNK
        if rate < 1e6:
            assert longest == pool_module.WRITE_CHUNK  # 0.65 s each already
        else:
            assert write_pace.PIECE_SECONDS / 4 <= longest / rate <= 2 * write_pace.PIECE_SECONDS
        await stream.write(b"ping")
        assert raw.writes[-1] == b"ping"

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))

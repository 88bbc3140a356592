"""The inference protocol: its messages (round trips, total decoding, bounds), the compute thread's
urgent lane, and the server's answers on a real engine (no network)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch
import trio
from hypothesis import given
from hypothesis import strategies as st

from p2pswarm import wire
from p2pswarm.errors import LocalProtocolError, RemoteProtocolError
from p2pswarm.model.catalog import ModelSpec
from p2pswarm.model.transformer import build_model
from p2pswarm.run.placement import Placement
from p2pswarm.run.training import TrainConfig
from p2pswarm.swarm import codec
from p2pswarm.swarm import engine as eng
from p2pswarm.swarm.activation import NO_ROUND, SESSION_BYTES, UNNAMED_RUN
from p2pswarm.swarm.compute_thread import open_compute_thread
from p2pswarm.swarm.inference import MAX_POSITIONS, InferClose, InferenceServer, InferOut, InferStep
from p2pswarm.swarm.sessions import Limits
from p2pswarm.testing.strategies import (
    SMALL_DIM,
    decodes_or_raises_remote_error,
    register_frames,
    run_bytes,
    unchecked_frame,
)


def trio_test(fn):
    """Run an async test under trio (no pytest plugin)."""
    def test():
        trio.run(fn)
    test.__name__ = fn.__name__
    return test


SESSIONS = st.binary(min_size=SESSION_BYTES, max_size=SESSION_BYTES)
ROUNDS = st.integers(NO_ROUND, wire.INT_MAX)
POSITIONS = st.integers(0, MAX_POSITIONS - SMALL_DIM - 1)


@st.composite
def _tensor(draw):
    dtype = draw(st.sampled_from(sorted(wire.DTYPE_SIZES)))
    shape = (1, draw(st.integers(1, SMALL_DIM)), *draw(st.lists(st.integers(0, SMALL_DIM), max_size=1)))
    count = 1
    for dim in shape:
        count *= dim
    size = count * wire.DTYPE_SIZES[dtype]
    return dtype, shape, draw(st.binary(min_size=size, max_size=size))


@st.composite
def steps(draw):
    dtype, shape, payload = draw(_tensor())
    return InferStep(draw(run_bytes), draw(st.text(min_size=1, max_size=20)), draw(st.integers(0, 63)),
                     draw(SESSIONS), draw(POSITIONS), draw(ROUNDS), dtype, shape), payload


@st.composite
def outs(draw):
    dtype, shape, payload = draw(_tensor())
    return InferOut(draw(SESSIONS), draw(POSITIONS), draw(ROUNDS), dtype, shape), payload


CLOSES = SESSIONS.map(lambda s: (InferClose(s), b""))
for _cls, _strategy in ((InferStep, steps()), (InferOut, outs()), (InferClose, CLOSES)):
    register_frames(_cls, _strategy)
FRAMES = st.one_of(steps(), outs(), CLOSES)


@given(FRAMES)
def test_round_trip(pair):
    assert wire.decode_frame(wire.encode_frame(*pair)) == pair


@given(FRAMES, st.data())
def test_every_truncation_is_refused(pair, data):
    frame = wire.encode_frame(*pair)
    with pytest.raises(RemoteProtocolError):
        wire.decode_frame(frame[:data.draw(st.integers(0, len(frame) - 1))])


@given(FRAMES, st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), min_size=1, max_size=3))
def test_corrupted_frames_decode_or_raise_remote_error(pair, flips):
    frame = bytearray(wire.encode_frame(*pair))
    for pos, byte in flips:
        frame[pos % len(frame)] = byte
    decodes_or_raises_remote_error(bytes(frame))


@given(FRAMES, st.sampled_from(["run", "model", "stage", "session", "position", "round", "dtype", "shape"]),
       st.none() | st.integers() | st.binary(max_size=40) | st.text(max_size=8)
       | st.lists(st.integers(-2, 2**40), max_size=10))
def test_mutated_fields_decode_or_raise_remote_error(pair, field, value):
    decodes_or_raises_remote_error(unchecked_frame(pair, fields={field: value}))


@given(st.one_of(steps(), outs()), st.integers(-16, 16).filter(bool))
def test_payload_not_matching_the_header_is_refused(pair, delta):
    msg, payload = pair
    wrong = payload + b"\0" * delta if delta > 0 else payload[:delta]
    if len(wrong) == len(payload):
        return
    with pytest.raises(RemoteProtocolError):
        wire.decode_frame(unchecked_frame(pair, wrong))
    with pytest.raises(LocalProtocolError):
        wire.encode_frame(msg, wrong)


@pytest.mark.parametrize("fields", [
    {"session": b"x" * 15}, {"position": -1}, {"position": MAX_POSITIONS}, {"round": -2},
    {"shape": (2, 1)}, {"shape": (1, 0)}, {"shape": (1,)}, {"shape": (1, 1, 1, 1)}, {"run": b"r"}, {"stage": -1},
    {"model": ""},
])
def test_out_of_bounds_steps_are_refused(fields):
    pair = (InferStep(UNNAMED_RUN, "m", 0, b"s" * SESSION_BYTES, 0, NO_ROUND, "int64", (1, 1)), bytes(8))
    with pytest.raises(RemoteProtocolError):
        wire.decode_frame(unchecked_frame(pair, fields=fields))


def test_a_close_carries_no_payload():
    with pytest.raises(RemoteProtocolError):
        wire.decode_frame(unchecked_frame((InferClose(b"s" * SESSION_BYTES), b""), b"x"))


# --- the compute thread's urgent lane ------------------------------------------------------------------


@trio_test
async def test_an_urgent_job_runs_before_the_ordinary_jobs_queued():
    order, gate, running = [], threading.Event(), threading.Event()

    def blocker():
        running.set()
        gate.wait()

    async with open_compute_thread("test-lanes") as thread:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(thread.run, blocker)
            while not running.is_set():  # (the waits here poll for the state, never for a time)
                await trio.sleep(0.001)
            for name, urgent in (("train-1", False), ("train-2", False), ("infer", True)):
                nursery.start_soon(lambda n=name, u=urgent: thread.run(order.append, n, urgent=u))
                while thread._jobs.qsize() < {"train-1": 1, "train-2": 2, "infer": 3}[name]:
                    await trio.sleep(0.001)
            gate.set()
    assert order == ["infer", "train-1", "train-2"]


# --- the server on a real engine --------------------------------------------------------------------------

SPEC = ModelSpec("infer-lm", n_layers=2, stage_size=1, width=32, heads=4, kv_heads=2, ffn=64, context=16)


def _service(stage, compute, config=TrainConfig()):
    engine = eng.StageEngine(SPEC, stage)
    return SimpleNamespace(spec=SPEC, stage=stage, config=config, placement=Placement(),
                           run_id=UNNAMED_RUN, engine=engine, compute=compute, is_last=stage == SPEC.last_stage)


def _step(stage, session, position, tensor, round_=NO_ROUND):
    dtype, shape, data = codec.to_wire(tensor)
    return InferStep(UNNAMED_RUN, SPEC.name, stage, session, position, round_, dtype, shape), data


async def _ask(server, pair):
    """Through the wire's encoder and decoder, as a peer's frame would come."""
    return await server.on_frame("peer", *wire.decode_frame(wire.encode_frame(*pair)))


@trio_test
async def test_steps_through_two_servers_equal_the_full_forward_and_say_their_round():
    ids = torch.randint(0, 256, (1, 10), generator=torch.Generator().manual_seed(0))
    stages = build_model(SPEC, seed=0)
    with torch.no_grad():
        full = stages[1](stages[0](ids))
    session, got = b"s" * SESSION_BYTES, []
    async with open_compute_thread("test-infer") as compute:
        servers = [InferenceServer(_service(s, compute)) for s in range(2)]
        for start, end in ((0, 6), (6, 7), (7, 8), (8, 10)):
            out, data = await _ask(servers[0], _step(0, session, start, ids[:, start:end]))
            assert (out.position, out.round, out.shape) == (start, NO_ROUND, (1, end - start, SPEC.width))
            hidden = codec.from_wire(out.dtype, out.shape, data)
            out, data = await _ask(servers[1], _step(1, session, start, hidden))
            assert out.shape == (1, SPEC.vocab) and out.dtype == "float32"
            got.append(codec.from_wire(out.dtype, out.shape, data))
        assert servers[0].table.sessions[session].length == 10
        assert await _ask(servers[0], (InferClose(session), b"")) is None
        assert not servers[0].table.sessions
    expected = full[0, [5, 6, 7, 9]]
    assert (torch.cat(got) - expected).abs().max().item() <= 1e-5


@trio_test
async def test_the_server_refuses_what_it_cannot_serve_with_its_code():
    session = b"t" * SESSION_BYTES
    one = torch.zeros(1, 1, dtype=torch.int64)
    async with open_compute_thread("test-infer-errors") as compute:
        server = InferenceServer(_service(0, compute), Limits(bytes_per_token=1, max_sessions=1, session_bytes=4))
        cases = [
            (_step(0, session, 3, one), "unknown-session"),
            (_step(0, session, 0, torch.zeros(1, SPEC.context + 1, dtype=torch.int64)), "too-long"),
            (_step(0, session, 0, torch.zeros(1, 1, 4)), "bad-input"),
            (_step(0, session, 0, torch.full((1, 1), SPEC.vocab, dtype=torch.int64)), "bad-input"),
            (_step(0, session, 0, torch.zeros(1, 5, dtype=torch.int64)), "overloaded"),  # past the session's 4 bytes
            ((InferStep(b"r" * 8, SPEC.name, 0, session, 0, NO_ROUND, "int64", (1, 1)), bytes(8)), "other-run"),
            (_step(1, session, 0, one), "wrong-stage"),
        ]
        for pair, code in cases:
            reply = await _ask(server, pair)
            assert isinstance(reply, wire.ErrorReply) and reply.code == code, (code, reply)
        assert isinstance((await _ask(server, _step(0, session, 0, one)))[0], InferOut)
        reply = await _ask(server, _step(0, session, 2, one))
        assert reply.code == "bad-position"
        reply = await _ask(server, _step(0, b"u" * SESSION_BYTES, 0, one))
        assert reply.code == "overloaded"  # one session at a time
        assert not [s for s in server.table.sessions.values() if s.pending]


@trio_test
async def test_a_session_decodes_with_the_agreed_weights_of_its_first_round():
    session = b"v" * SESSION_BYTES
    async with open_compute_thread("test-infer-rounds") as compute:
        service = _service(1, compute)
        engine = service.engine
        flat = torch.cat([p.detach().flatten() for p in engine.params.values()])
        await compute.run(engine.agree, 3, flat * 2)
        server = InferenceServer(service)
        hidden = torch.randn(1, 7, SPEC.width, generator=torch.Generator().manual_seed(1))
        out, data = await _ask(server, _step(1, session, 0, hidden[:, :5]))
        assert out.round == 3
        doubled = {n: p.detach() * 2 for n, p in engine.params.items()}
        with torch.no_grad():
            expected = torch.func.functional_call(engine.module, doubled, (hidden[:, :5],))[0, -1]
        assert (codec.from_wire(out.dtype, out.shape, data)[0] - expected).abs().max().item() <= 1e-5
        await compute.run(engine.agree, 4, flat)
        out, _ = await _ask(server, _step(1, session, 5, hidden[:, 5:6]))
        assert out.round == 3  # pinned while it is kept
        for later in range(5, 4 + eng.AGREED_MAX):  # a small stage keeps AGREED_MAX rounds: 3 is gone at 19
            await compute.run(engine.agree, later, flat)
        reply = await _ask(server, _step(1, session, 6, hidden[:, 6:]))
        assert reply.code == "unknown-session"  # round 3 is no longer kept: the client replays
        reply = await _ask(server, _step(1, b"w" * SESSION_BYTES, 0, hidden[:, :1], round_=4))
        assert reply[0].round == 4
        reply = await _ask(server, _step(1, b"w" * SESSION_BYTES, 1, hidden[:, 1:2]))
        assert reply[0].round == 4


# --- the client, against in-process servers (no network) --------------------------------------------------

from contextlib import asynccontextmanager  # noqa: E402

from p2pswarm.errors import ConfigError, DialError, NoCandidates  # noqa: E402
from p2pswarm.model.tokenizer import ByteTokenizer  # noqa: E402
from p2pswarm.swarm.completions import CompletionRequest  # noqa: E402
from p2pswarm.swarm.generation import SwarmCompleter  # noqa: E402


class _Stream:
    def __init__(self, pool, peer):
        self.pool, self.peer, self.replies = pool, peer, []

    async def write_frame(self, message, payload=b""):
        if self.peer in self.pool.dead:
            raise DialError(f"{self.peer} is dead")
        reply = await self.pool.servers[self.peer].on_frame("client", *wire.decode_frame(
            wire.encode_frame(message, payload)))
        self.pool.steps.append((self.peer, getattr(message, "position", None)))
        if reply is not None:
            self.replies.append(reply if isinstance(reply, tuple) else (reply, b""))

    async def read_frame(self, *, max_payload, timeout):
        return wire.decode_frame(wire.encode_frame(*self.replies.pop(0)))


class _Pool:
    """Leases that hand frames to in-process servers, by peer id; peers in ``dead`` fail to dial."""

    def __init__(self, servers):
        self.servers, self.dead, self.steps = servers, set(), []

    @asynccontextmanager
    async def lease(self, peer, protocol):
        yield _Stream(self, peer)


class _Map:
    def __init__(self, peers_by_stage):
        self.peers = peers_by_stage

    def candidates(self, stage):
        return [SimpleNamespace(peer_id=p) for p in self.peers[stage]]

    def pool(self, stage):
        return self.candidates(stage)


def _greedy_reference(prompt: bytes, new: int) -> list[int]:
    stages, ids = build_model(SPEC, seed=0), list(prompt)
    with torch.no_grad():
        for _ in range(new):
            logits = stages[1](stages[0](torch.tensor([ids])))
            ids.append(int(logits[0, -1].argmax()))
    return ids[len(prompt):]


async def _tokens_killing_a0_after_three_steps(completer, pool) -> list[int]:
    """A 6-token greedy generation of "hello" during which replica a0 dies after its third step."""
    tokens = []
    async for chunk in completer.stream(CompletionRequest("hello", max_new_tokens=6)):
        tokens += chunk.token_ids
        if len([p for p, _ in pool.steps if p == "a0"]) >= 3:
            pool.dead.add("a0")
    return tokens


async def _generate(completer, **kw):
    chunks = [c async for c in completer.stream(CompletionRequest(**kw))]
    return chunks, [t for c in chunks for t in c.token_ids]


@trio_test
async def test_greedy_generation_through_servers_equals_the_full_model_and_survives_a_dead_replica():
    prompt = b"hello"
    expected = _greedy_reference(prompt, 6)
    async with open_compute_thread("test-client") as compute:
        servers = {"a0": InferenceServer(_service(0, compute)), "b0": InferenceServer(_service(0, compute)),
                   "a1": InferenceServer(_service(1, compute))}
        pool = _Pool(servers)
        completer = SwarmCompleter(pool, _Map({0: ["a0", "b0"], 1: ["a1"]}), SPEC, None, ByteTokenizer())
        chunks, tokens = await _generate(completer, prompt="hello", max_new_tokens=6)
        assert tokens == expected
        assert chunks[-1].finish_reason == "length" and all(c.finish_reason is None for c in chunks[:-1])
        assert chunks[0].rounds == (NO_ROUND, NO_ROUND) and chunks[0].prompt_tokens == 5
        assert not servers["a0"].table.sessions and not servers["a1"].table.sessions  # closed at the end

        pool.steps.clear()
        tokens = await _tokens_killing_a0_after_three_steps(completer, pool)
        assert tokens == expected
        replay = [pos for peer, pos in pool.steps if peer == "b0"]
        assert replay and replay[0] == 0  # b0 was sent the whole prefix at position 0
        pool.dead.add("b0")
        with pytest.raises(NoCandidates):
            await _generate(completer, prompt="hello", max_new_tokens=2)


@trio_test
async def test_generation_through_a_q8_boundary_replays_a_prefix_sliced_by_positions():
    """A run whose activations travel as q8: hidden states cross in 8 bits a number, a dense one is
    refused, and a replica's death replays the prefix from the quantized replies, sliced by positions."""
    q8 = TrainConfig(activation_codec="q8")
    async with open_compute_thread("test-client") as compute:
        servers = {p: InferenceServer(_service(int(p[1]), compute, q8)) for p in ("a0", "b0", "a1")}
        pool = _Pool(servers)
        completer = SwarmCompleter(pool, _Map({0: ["a0", "b0"], 1: ["a1"]}), SPEC, None, ByteTokenizer())
        _, tokens = await _generate(completer, prompt="hello", max_new_tokens=6)
        assert len(tokens) == 6
        refused = await _ask(servers["a1"], _step(1, b"d" * SESSION_BYTES, 0, torch.randn(1, 2, SPEC.width)))
        assert isinstance(refused, wire.ErrorReply) and refused.code == "bad-input"
        pool.steps.clear()
        assert await _tokens_killing_a0_after_three_steps(completer, pool) == tokens
        assert next(pos for peer, pos in pool.steps if peer == "b0") == 0  # the replay, from the start


@trio_test
async def test_an_expired_session_is_replayed_on_the_same_replica_and_limits_are_clear_errors():
    async with open_compute_thread("test-client-expiry") as compute:
        servers = {"a0": InferenceServer(_service(0, compute)), "a1": InferenceServer(_service(1, compute))}
        pool = _Pool(servers)
        completer = SwarmCompleter(pool, _Map({0: ["a0"], 1: ["a1"]}), SPEC, None, ByteTokenizer())
        got = []
        async for chunk in completer.stream(CompletionRequest("hi", max_new_tokens=5)):
            got.extend(chunk.token_ids)
            if len(got) == 2:
                servers["a1"].table.sessions.clear()  # as if it expired
        assert got == _greedy_reference(b"hi", 5)
        with pytest.raises(ConfigError):
            await _generate(completer, prompt="x" * SPEC.context, max_new_tokens=1)
        chunks, tokens = await _generate(completer, prompt="x" * (SPEC.context - 3), max_new_tokens=10)
        assert len(tokens) == 3 and chunks[-1].finish_reason == "length"  # stopped at the context


@trio_test
async def test_sampling_with_a_seed_is_repeatable_and_text_waits_for_whole_characters():
    async with open_compute_thread("test-client-sampling") as compute:
        servers = {"a0": InferenceServer(_service(0, compute)), "a1": InferenceServer(_service(1, compute))}
        completer = SwarmCompleter(_Pool(servers), _Map({0: ["a0"], 1: ["a1"]}), SPEC, None, ByteTokenizer())
        kw = dict(prompt="abc", max_new_tokens=12, temperature=1.5, top_p=0.9)
        first = (await _generate(completer, seed=7, **kw))[1]
        assert (await _generate(completer, seed=7, **kw))[1] == first
        others = [(await _generate(completer, seed=s, **kw))[1] for s in (8, 9, 10)]
        assert any(o != first for o in others)
    from p2pswarm.swarm.generation import _TextTail

    tail, euro = _TextTail(ByteTokenizer()), list("a€".encode())
    pieces = [tail.add(euro[:i], final=False) for i in range(1, len(euro) + 1)]
    assert pieces == ["a", "", "", "€"]

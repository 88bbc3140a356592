"""Text generation through the swarm: the ``Completer`` the HTTP API serves (``p2pswarm/swarm/completions.py``).

``SwarmCompleter.stream(request)`` tokenizes the prompt (longer than the context: ``ConfigError``)
and runs one inference session (``swarm/inference.py``) per request. For each new token the
client sends the step to a replica of stage 0, then the reply to a replica of stage 1, and so on
(a star from the client: no stage talks to another for generation). It keeps every stage's input
for the whole sequence so far (bounded by the context), samples the next token from the last
stage's logits (temperature 0: argmax; else temperature and top-p from a ``torch.Generator``
seeded by the request's seed, so the same seed gives the same text), and yields the new text as
soon as it is whole UTF-8 (an incomplete character waits for the next token). It stops with
``finish_reason`` "length" at ``max_new_tokens`` or at the model's context.

**Replicas.** Per stage, the candidates of the stage map (``StageMap.candidates``: peers that
answered us recently), then the rest of its records; ourselves first where we serve the stage
(our own server, no stream), then a replica that answered before (in any session); the choice is
sticky for the session.

**Replay.** When a replica fails (``DialError``, ``Stalled``, no reply within the step deadline,
or an ``unknown-session`` / ``bad-position`` / ``busy`` / ``overloaded`` reply), the client picks the next
replica of that stage (the same one again at once only for ``unknown-session``: it is alive, it
lost the session; after another failure it is tried again only after the others, a pause later,
``TRIES_PER_REPLICA`` times at most) and sends it the stage's whole stored input (positions 0..t) at position 0, which
rebuilds its cache, and goes on. It asks for the round the stage's earlier replies named, so
the replay decodes with the same agreed weights while replicas keep them. No replica of a stage
left: ``NoCandidates`` (``Overloaded`` if the last refusal was one). Sessions are closed at the
end, best effort.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import trio

from p2pswarm import wire
from p2pswarm.errors import ConfigError, DialError, NoCandidates, Overloaded, P2PSwarmError, RemoteProtocolError
from p2pswarm.net.budget import frame_deadline
from p2pswarm.swarm.activation import NO_ROUND, SESSION_BYTES, UNNAMED_RUN
from p2pswarm.swarm.completions import CompletionChunk, CompletionRequest
from p2pswarm.swarm.inference import IDS_DTYPE, PROTOCOL_ID, InferClose, InferOut, InferStep, max_step_bytes

log = logging.getLogger(__name__)

STEP_COMPUTE_S = 5.0  # one step's compute at a replica: an urgent job after the training job running there
#                      (tenths of a second on a CPU stage); beyond, the replica counts as failed
CLOSE_TIMEOUT = 2.0  # a best-effort close of a session at each replica at the end
MAP_WAIT = 5.0  # how long a request waits for a stage map rebuild in progress before using the map it has
REMEMBERED = 256  # replicas remembered as having answered (preferred first)
RETRY_CODES = {"unknown-session", "bad-position", "busy", "overloaded"}  # replies after which we replay
TRIES_PER_REPLICA = 3  # a replica that failed gets more tries once the others were tried (a dropped connection)
RETRY_PAUSE_S = 1.0  # x its failures, before a replica that failed is tried again: a dropped connection is redialled


@dataclass
class _Stage:
    """One stage's part of a session: its input so far and the replica holding its cache."""

    chunks: list[bytes] = field(default_factory=list)  # the input of positions 0..t, in step order
    dtype: str = IDS_DTYPE
    tail: tuple[int, ...] = ()  # the input's shape after the positions axis ((), or (width,))
    replica: str | None = None
    held: int = 0  # positions the replica's cache holds
    round: int = NO_ROUND  # the outer round its replies named (asked for again on a replay)
    tried: Counter = field(default_factory=Counter)  # replica -> its failures in this session


class SwarmCompleter:
    """Generation through the swarm's stages (module docstring)."""

    def __init__(self, pool, stage_map, spec, run, tokenizer, *, me: str | None = None, local=None) -> None:
        """``me``: our peer id; ``local()``: our own ``InferenceServer`` (or None), which serves our own
        stage without a stream (a peer cannot dial itself)."""
        self.pool, self.stage_map, self.spec, self.tokenizer = pool, stage_map, spec, tokenizer
        self.me, self._local = me, local
        self.run_id = getattr(run, "run_bytes", None) or (run if isinstance(run, bytes) else UNNAMED_RUN)
        self.model_name = spec.name  # the model as cut into stages (the id /v1/models lists)
        self._answered: dict[str, None] = {}  # replicas that answered a step, most recent last
        self._reply_bytes = max_step_bytes(spec)

    async def stream(self, request: CompletionRequest) -> AsyncIterator[CompletionChunk]:
        request.check()
        prompt = self.tokenizer.encode(request.prompt)
        if not prompt:
            raise ConfigError("the prompt tokenizes to nothing")
        if len(prompt) >= self.spec.context:
            raise ConfigError(f"the prompt is {len(prompt)} tokens; {self.spec.name} reads {self.spec.context} "
                              f"at most, and one more is needed to generate")
        session, stages = os.urandom(SESSION_BYTES), [_Stage() for _ in range(self.spec.n_stages)]
        sampler = _Sampler(request, self.spec.vocab, getattr(self.tokenizer, "vocab_size", self.spec.vocab))
        generated: list[int] = []
        text = _TextTail(self.tokenizer)
        try:
            new = prompt
            while True:
                logits, rounds = await self._token(session, stages, new)
                token = sampler.next(logits)
                generated.append(token)
                done = len(generated) >= request.max_new_tokens or len(prompt) + len(generated) >= self.spec.context
                yield CompletionChunk(text.add(generated, final=done), (token,), "length" if done else None,
                                      rounds, len(prompt))
                if done:
                    return
                new = [token]
        finally:
            with trio.CancelScope(shield=True):
                await self._close(session, stages)

    async def _token(self, session: bytes, stages: list[_Stage], ids: list[int]) -> tuple[list[float], tuple]:
        """The new positions ``ids`` through every stage: the last stage's logits and each stage's round."""
        import numpy as np

        shape: tuple[int, ...]
        payload, shape, dtype = np.asarray(ids, dtype="<i8").tobytes(), (1, len(ids)), IDS_DTYPE
        for index, stage in enumerate(stages):
            stage.chunks.append(payload)
            stage.dtype, stage.tail = dtype, shape[2:]
            reply, payload = await self._step(session, index, stage, len(ids))
            dtype, shape = reply.dtype, reply.shape
        logits = np.frombuffer(payload, dtype="<f4").astype(np.float64)
        return logits.tolist(), tuple(s.round for s in stages)

    async def _step(self, session: bytes, index: int, stage: _Stage, n: int) -> tuple[InferOut, bytes]:
        """Positions held..held+n-1 at stage ``index``, replaying on another replica when one fails."""
        last_refusal = None
        total = sum(self._positions(stage, c) for c in stage.chunks)
        while True:
            replay = stage.replica is None or stage.held != total - n
            if stage.replica is None:
                stage.replica = await self._choose(index, stage)
                if stage.replica is None:
                    if last_refusal == "overloaded":
                        raise Overloaded(f"every replica of stage {index} is overloaded; try again later")
                    raise NoCandidates(f"no replica of stage {index} of {self.spec.name} could be reached")
            position = 0 if replay else stage.held
            chunks = stage.chunks if replay else stage.chunks[-1:]
            count = total if replay else n
            data = b"".join(chunks)
            step = InferStep(self.run_id, self.spec.name, index, session, position, stage.round, stage.dtype,
                             (1, count, *stage.tail))
            try:
                reply, payload = await self._ask(stage.replica, step, data)
            except (DialError, RemoteProtocolError) as exc:
                log.info("stage %d replica %s failed (%s): replaying on another", index, stage.replica, exc)
                stage.tried[stage.replica] += 1
                stage.replica, stage.held = None, 0
                continue
            if isinstance(reply, wire.ErrorReply):
                if reply.code == "too-long":
                    raise ConfigError(f"stage {index}: {reply.detail}")
                last_refusal = reply.code
                if reply.code != "unknown-session" or replay:
                    stage.tried[stage.replica] += 1
                    stage.replica = None
                stage.held = 0
                if reply.code not in RETRY_CODES:
                    log.warning("stage %d replica refused a step: %s: %s", index, reply.code, reply.detail)
                continue
            self._answered.pop(stage.replica, None)
            self._answered[stage.replica] = None
            while len(self._answered) > REMEMBERED:
                del self._answered[next(iter(self._answered))]
            stage.held, stage.round = total, reply.round
            return reply, self._new_part(reply, payload, count, n)

    def _positions(self, stage: _Stage, chunk: bytes) -> int:
        width = stage.tail[0] if stage.tail else 1
        bits = wire.QUANTIZED_BITS.get(stage.dtype)
        per = wire.quantized_row_bytes(bits, width) if bits else \
            (8 if stage.dtype == IDS_DTYPE else wire.DTYPE_SIZES[stage.dtype]) * width
        return len(chunk) // per

    def _new_part(self, reply: InferOut, payload: bytes, count: int, n: int) -> bytes:
        """The reply's part for the new positions: hidden states of the last n of ``count``, or the logits."""
        if len(reply.shape) == 2:  # the last stage's logits [1, vocab]
            if reply.dtype != "float32" or reply.shape[1] != self.spec.vocab:
                raise RemoteProtocolError(f"logits of {reply.dtype} {reply.shape} for a vocabulary of "
                                          f"{self.spec.vocab}")
            return payload
        if reply.shape[:2] != (1, count) or reply.shape[2] != self.spec.width:
            raise RemoteProtocolError(f"hidden states of shape {reply.shape} for {count} positions")
        per = len(payload) // count
        return payload[(count - n) * per:]

    async def _ask(self, peer: str, step: InferStep, data: bytes) -> tuple[InferOut | wire.ErrorReply, bytes]:
        deadline = STEP_COMPUTE_S + frame_deadline(len(data)) + frame_deadline(self._reply_bytes)
        server = self._local() if self._local is not None and peer == self.me else None
        with trio.move_on_after(deadline) as scope:
            if server is not None:  # our own stage: straight to our server
                answer = await server.on_frame(peer, step, data)
                reply, payload = answer if isinstance(answer, tuple) else (answer, b"")
            else:
                async with self.pool.lease(peer, PROTOCOL_ID) as stream:
                    await stream.write_frame(step, data)
                    reply, payload = await stream.read_frame(max_payload=self._reply_bytes, timeout=deadline)
        if scope.cancelled_caught:
            raise DialError(f"no inference reply from {peer} within {deadline:.0f} s")
        if isinstance(reply, InferOut) and (reply.session, reply.position) != (step.session, step.position):
            raise RemoteProtocolError(f"a reply for another step from {peer}")
        if not isinstance(reply, (InferOut, wire.ErrorReply)):
            raise RemoteProtocolError(f"a {reply.TYPE} in answer to an inference step")
        return reply, payload

    async def _choose(self, index: int, stage: _Stage) -> str | None:
        """A replica of stage ``index`` not tried in this session: one that answered us before first."""
        current = getattr(self.stage_map, "current", None)
        if current is not None:
            with trio.move_on_after(MAP_WAIT):
                await current(MAP_WAIT)
        checked = [r.peer_id for r in self.stage_map.candidates(index)]
        others = [r.peer_id for r in self.stage_map.pool(index) if r.peer_id not in checked]
        order = [p for p in checked + others if stage.tried[p] < TRIES_PER_REPLICA]
        # fewest failures first; then ourselves, then a replica that answered before
        order.sort(key=lambda p: (stage.tried[p], p != self.me, p not in self._answered))
        if order and stage.tried[order[0]]:
            await trio.sleep(RETRY_PAUSE_S * stage.tried[order[0]])  # every replica failed: give it time to come back
        return order[0] if order else None

    async def _close(self, session: bytes, stages: list[_Stage]) -> None:
        async def close(peer: str) -> None:
            server = self._local() if self._local is not None and peer == self.me else None
            if server is not None:
                server.table.close(session, self.me)  # our own steps went in as ours
                return
            with trio.move_on_after(CLOSE_TIMEOUT):
                try:
                    async with self.pool.lease(peer, PROTOCOL_ID) as stream:
                        await stream.write_frame(InferClose(session))
                except P2PSwarmError:
                    pass

        async with trio.open_nursery() as nursery:
            for stage in stages:
                if stage.replica is not None:
                    nursery.start_soon(close, stage.replica)


class _Sampler:
    """The next token from logits: argmax at temperature 0, else temperature + top-p with a seeded generator."""

    def __init__(self, request: CompletionRequest, vocab: int, usable: int) -> None:
        import torch

        self.temperature, self.top_p, self.usable = request.temperature, request.top_p, min(vocab, usable)
        seed = request.seed if request.seed is not None else int.from_bytes(os.urandom(8), "big") >> 1
        self.generator = torch.Generator().manual_seed(seed)

    def next(self, logits: list[float]) -> int:
        import torch

        scores = torch.tensor(logits[:self.usable], dtype=torch.float64)  # ids past the tokenizer's never decode
        if self.temperature == 0:
            return int(scores.argmax())
        probs = torch.softmax(scores / self.temperature, dim=-1)
        ordered, ids = probs.sort(descending=True)
        keep = int((ordered.cumsum(0) < self.top_p).sum()) + 1  # the smallest head whose mass reaches top_p
        ordered = ordered[:keep] / ordered[:keep].sum()
        return int(ids[torch.multinomial(ordered, 1, generator=self.generator)])


class _TextTail:
    """The text of the generated tokens, handed out piece by piece; an incomplete character waits."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.sent = tokenizer, 0

    def add(self, generated: list[int], final: bool) -> str:
        text = self.tokenizer.decode(generated)
        whole = text if final else text.rstrip("\ufffd")  # a replacement character at the end: a character in progress
        piece, self.sent = whole[self.sent:], max(self.sent, len(whole))
        return piece

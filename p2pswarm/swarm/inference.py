"""Inference sessions, ``/p2pswarm/infer/1.0.0``: a generation client runs a sequence through a stage.

Request and reply frames on a pooled stream (as the snapshot protocol):

- ``infer.step`` (payload: the new positions' input: token ids as int64 ``[1, n]`` at stage 0,
  hidden states ``[1, n, width]`` as the run's [wire] activations travel otherwise): ``run``, ``model``,
  ``stage``, ``session`` (16 random bytes), ``position`` (of the first new position), ``round``
  (the DiLoCo outer round whose agreed weights the client wants; ``NO_ROUND``: the replica's
  latest), ``dtype``, ``shape``;
- reply ``infer.out`` (payload: the new positions' hidden states, as activations travel,
  or at the last stage the last position's logits ``[1, vocab]`` as float32): ``session``,
  ``position``, ``round`` (the round whose agreed weights the replica used, ``NO_ROUND``: its live
  weights, none agreed yet), ``dtype``, ``shape``; or ``wire.ErrorReply`` with a code:
  ``unknown-session`` (expired, closed, never here, or its round no longer held: replay from 0),
  ``bad-position``, ``busy``, ``overloaded`` (too many sessions or past a KV budget),
  ``too-long`` (past the model's context), ``bad-input``, ``wrong-stage``, ``other-run``;
- ``infer.close`` (no payload, no reply): ``session``; the replica drops its cache.

A session pins the round of its first step: later steps decode with the same agreed weights
(bit-equal on every replica of the stage) while the replica keeps that round (``engine.agree``: 2 to
16 rounds, as fit in 256 MiB), so a replay on another replica gives the same output. Steps never wait
in the training buffers (``Priority.INFERENCE_URGENT``). Once the stage has agreed weights, a
step runs on the replica's own inference thread, beside the training job in progress: the agreed
weights are host vectors training never writes in place. (An urgent job of the compute thread
alone, the first design, waited for the running training job: a tiny-lm/2 stage's takes about
0.3 s on a loaded 2-core machine, and generation ran at 1.3 tokens/s.) With live weights only
(no round agreed yet: no DiLoCo) a step is an urgent job of the compute thread
(``compute_thread``: after the job running, ahead of every queued training job).
The KV caches live on the engine's device; ``sessions.SessionTable`` checks the budgets before a
step allocates. ``docs/protocols.md`` ("Inference sessions") is the normative description.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import trio

from p2pswarm import wire
from p2pswarm.dht.records import MAX_MODEL_CHARS, MAX_STAGES, RUN_BYTES
from p2pswarm.errors import RemoteProtocolError
from p2pswarm.swarm.activation import NO_ROUND, SESSION_BYTES, Forward
from p2pswarm.swarm.compute_thread import ComputeThread
from p2pswarm.swarm.sessions import Limits, SessionRefused, SessionTable

if TYPE_CHECKING:  # torch is imported when the first step is computed
    from p2pswarm.model.transformer import StageModule

log = logging.getLogger(__name__)

PROTOCOL_ID = "/p2pswarm/infer/1.0.0"
MAX_POSITIONS = 1 << 20  # far past any catalog context (1024); the spec's context is checked by the server
IDS_DTYPE = "int64"  # token ids on the wire
LOGITS_DTYPE = "float32"  # the last stage's reply


def _check_head(kind: str, session: bytes, position: int, round_: int) -> None:
    if len(session) != SESSION_BYTES:
        raise RemoteProtocolError(f"{kind}: session id of {len(session)} bytes, not {SESSION_BYTES}")
    if not 0 <= position < MAX_POSITIONS:
        raise RemoteProtocolError(f"{kind}: position {position} out of range")
    if not NO_ROUND <= round_ <= wire.INT_MAX:
        raise RemoteProtocolError(f"{kind}: round {round_} out of range")


def _check_shape(kind: str, dtype: str, shape: tuple[int, ...], position: int, payload_len: int) -> None:
    if len(shape) not in (2, 3) or shape[0] != 1 or not 0 < shape[1] <= MAX_POSITIONS - position:
        raise RemoteProtocolError(f"{kind}: shape {shape} is not one sequence [1, n(, width)] of new positions")
    wire.check_tensor(dtype, shape, payload_len)


@wire.message("infer.step")
class InferStep(wire.Message):
    """The input of positions ``position .. position + n - 1`` of ``session`` at ``stage``."""

    run: bytes
    model: str
    stage: int
    session: bytes
    position: int
    round: int  # wanted; NO_ROUND: the replica's latest
    dtype: str
    shape: tuple[int, ...]

    def check(self, payload_len: int) -> None:
        if len(self.run) != RUN_BYTES:
            raise RemoteProtocolError(f"{self.TYPE}: run identity of {len(self.run)} bytes, not {RUN_BYTES}")
        if not 0 < len(self.model) <= MAX_MODEL_CHARS or not 0 <= self.stage < MAX_STAGES:
            raise RemoteProtocolError(f"{self.TYPE}: model of {len(self.model)} chars or stage {self.stage}")
        _check_head(self.TYPE, self.session, self.position, self.round)
        _check_shape(self.TYPE, self.dtype, self.shape, self.position, payload_len)


@wire.message("infer.out")
class InferOut(wire.Message):
    """What ``stage`` made of a step: hidden states, or the last position's logits."""

    session: bytes
    position: int
    round: int  # used; NO_ROUND: live weights
    dtype: str
    shape: tuple[int, ...]

    def check(self, payload_len: int) -> None:
        _check_head(self.TYPE, self.session, self.position, self.round)
        _check_shape(self.TYPE, self.dtype, self.shape, self.position, payload_len)


@wire.message("infer.close")
class InferClose(wire.Message):
    """The client is done with ``session``."""

    session: bytes

    def check(self, payload_len: int) -> None:
        if payload_len:
            raise RemoteProtocolError(f"{self.TYPE} carries no payload, got {payload_len} bytes")
        if len(self.session) != SESSION_BYTES:
            raise RemoteProtocolError(f"{self.TYPE}: session id of {len(self.session)} bytes")


def max_step_bytes(spec, itemsize: int = 4) -> int:
    """The largest step or reply payload for ``spec``: a whole context of hidden states (a replay),
    or of token ids, or one position's logits."""
    return max(spec.context * spec.width * itemsize, spec.context * 8, spec.vocab * 4)


class RoundGone(Exception):
    """The round a session pinned is no longer held: the session must be replayed."""


class InferenceServer:
    """Answers inference steps for our stage with the engine's agreed weights (module docstring)."""

    def __init__(self, service, limits: Limits | None = None) -> None:
        from p2pswarm.model.transformer import kv_bytes  # lazy: torch, loaded on a node's first session
        from p2pswarm.swarm import codec  # lazy: torch

        self.service, self.spec, self.stage = service, service.spec, service.stage
        layout = codec.Layout.of(self.spec, self.stage, service.config, service.run_id, "")  # as training's frames
        self.wire_dtype = layout.dtype  # what hidden states decode to
        self.encoding = layout.activations  # how they travel: dense (wire_dtype) or quantized
        self.hidden = layout.encoding(Forward)  # the dtype of a hidden-state frame
        itemsize = 2 if service.placement.autocast_dtype else 4  # the cache's dtype follows the forward's
        self.table = SessionTable(limits or Limits(kv_bytes(self.spec, self.stage, 1, itemsize)))
        self.steps = 0
        self.refused = 0
        self.thread = ComputeThread(f"p2pswarm-infer{self.stage}")  # decodes on agreed weights beside training
        self.thread.start()  # a daemon: it ends with the process (or ``close``)
        self._agreed_weights: dict[int, dict] = {}  # outer round -> its agreed weights as params, on the device
        self._module: StageModule | None = None  # the inference thread's own StageModule (``_own_module``)

    def close(self) -> None:
        self.thread.stop()

    async def on_frame(self, peer: str, message, payload: bytes):
        if isinstance(message, InferClose):
            self.table.close(message.session, peer)
            return None
        if not isinstance(message, InferStep):
            raise RemoteProtocolError(f"{message.TYPE} is not an inference request")
        error = self._refusal(message)
        if error is not None:
            self.refused += 1
            return error
        now = trio.current_time()
        try:
            entry = self.table.begin(message.session, message.position, message.shape[1], now, peer)
        except SessionRefused as exc:
            self.refused += 1
            return wire.ErrorReply(exc.code, str(exc))
        try:
            if self.service.engine.agreed_round != NO_ROUND:  # agreed weights: never touched by training
                round_, cache, reply = await self.thread.run(self._decode_agreed, entry, message, payload)
            else:  # live weights only: between two training jobs, ahead of the queued ones
                round_, cache, reply = await self.service.compute.run(self._decode, entry, message, payload,
                                                                      urgent=True)
        except RoundGone:
            self.table.abandon(message.session)
            return wire.ErrorReply("unknown-session", f"round {entry.round} is no longer held here: replay")
        except (ValueError, RuntimeError) as exc:  # a token id past the vocabulary, or a bad tensor
            self.table.abandon(message.session)
            return wire.ErrorReply("bad-input", str(exc)[:wire.MAX_STR_BYTES // 4])
        except BaseException:
            self.table.abandon(message.session)
            raise
        entry.round = round_
        self.table.finish(message.session, cache, trio.current_time())
        self.steps += 1
        dtype, shape, data = reply
        return InferOut(message.session, message.position, round_, dtype, shape), data

    def _refusal(self, m: InferStep) -> wire.ErrorReply | None:
        if m.run != self.service.run_id:
            return wire.ErrorReply("other-run", f"this peer serves run {self.service.run_id.hex()}")
        if (m.model, m.stage) != (self.spec.name, self.stage):
            return wire.ErrorReply("wrong-stage", f"this peer serves stage {self.stage} of {self.spec.name}")
        n = m.shape[1]
        if m.position + n > self.spec.context:
            return wire.ErrorReply("too-long", f"positions up to {m.position + n} pass the context of "
                                               f"{self.spec.context}")
        want = (IDS_DTYPE, (1, n)) if self.stage == 0 else (self.hidden, (1, n, self.spec.width))
        if (m.dtype, m.shape) != want:
            return wire.ErrorReply("bad-input", f"stage {self.stage} takes {want[0]} {list(want[1])}, "
                                                f"not {m.dtype} {list(m.shape)}")
        return None

    def _decode(self, entry, message: InferStep, payload: bytes):
        """Compute thread: one step of the session on the pinned (or wanted) round's weights."""
        import torch
        from torch.func import functional_call

        from p2pswarm.model.transformer import KVCache  # lazy: torch, loaded on a node's first session
        from p2pswarm.swarm import codec  # lazy: torch

        engine = self.service.engine
        wanted = entry.round if entry.round is not None else message.round
        round_, weights = engine._eval_weights(engine.agreed_round if wanted == NO_ROUND else wanted)
        if entry.round is not None and round_ != entry.round:
            raise RoundGone()
        cache = entry.cache if entry.cache is not None else KVCache()
        x = engine._input(codec.from_wire(message.dtype, message.shape, payload, self.wire_dtype))
        if self.stage == 0 and (int(x.min()) < 0 or int(x.max()) >= self.spec.vocab):
            raise ValueError(f"a token id outside the vocabulary of {self.spec.vocab}")
        with torch.no_grad(), engine._autocast():
            y = engine.module(x, cache=cache) if weights is None else \
                functional_call(engine.module, weights, (x,), {"cache": cache})
        if self.service.is_last:
            return round_, cache, codec.to_wire(y.float().cpu())
        return round_, cache, codec.to_wire(engine.host_out(y), self.encoding)

    def _decode_agreed(self, entry, message: InferStep, payload: bytes):
        """Inference thread: one step on the agreed weights of the pinned (or wanted) round. Reads only
        what training never writes in place: ``engine._agreed``'s flat host vectors (``agree`` replaces
        them whole) and the parameters' names and shapes; no staging buffer of the engine."""
        import torch
        from torch.func import functional_call

        from p2pswarm.model.transformer import KVCache  # lazy: torch, loaded on a node's first session
        from p2pswarm.swarm import codec  # lazy: torch

        engine, held = self.service.engine, dict(self.service.engine._agreed)
        if entry.round is not None and entry.round not in held:
            raise RoundGone()
        round_ = entry.round if entry.round is not None else message.round if message.round in held else max(held)
        weights = self._weights_of(engine, round_, held)
        cache = entry.cache if entry.cache is not None else KVCache()
        x = codec.from_wire(message.dtype, message.shape, payload, self.wire_dtype)
        if self.stage == 0 and (int(x.min()) < 0 or int(x.max()) >= self.spec.vocab):
            raise ValueError(f"a token id outside the vocabulary of {self.spec.vocab}")
        x = x.to(engine.device) if self.stage == 0 else x.to(engine.device, torch.float32)
        with torch.no_grad(), engine._autocast():  # our own module: functional_call swaps a module's parameters
            y = functional_call(self._own_module(engine), weights, (x,), {"cache": cache})
        if self.service.is_last:
            return round_, cache, codec.to_wire(y.float().cpu())
        return round_, cache, codec.to_wire(y.to("cpu", engine.wire_dtype), self.encoding)

    def _own_module(self, engine):
        """The stage's module for this thread alone (its own weights are never used: every call
        passes the agreed ones). ``functional_call`` puts the weights it is given into the module
        for the call: on the engine's module, concurrent with a training forward, each would see
        the other's."""
        if self._module is None:
            from p2pswarm.model.transformer import StageModule  # lazy: torch

            self._module = StageModule(self.spec, self.stage, engine.module.fixed_parts()).to(engine.device)
        return self._module

    def _weights_of(self, engine, round_: int, held: dict) -> dict:
        """Round ``round_``'s agreed weights as parameters on the engine's device (kept per held round)."""
        import torch

        if engine.device.type == "cuda":
            torch.cuda.set_device(engine.device)  # this thread's current device
        self._agreed_weights = {r: w for r, w in self._agreed_weights.items() if r in held}
        if round_ not in self._agreed_weights:
            self._agreed_weights[round_] = engine.params_from_flat(held[round_])  # reads params' shapes only
        return self._agreed_weights[round_]

    def expire(self, now: float) -> int:
        return self.table.expire(now)

    def doc(self) -> dict:
        return {**self.table.doc(), "steps": self.steps, "refused": self.refused}


"""Properties of the activation protocol's messages: round trips, total decoding, header/payload checks."""

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from p2pswarm import wire
from p2pswarm.errors import LocalProtocolError, RemoteProtocolError
from p2pswarm.swarm.activation import (
    MAX_PEER_ID_CHARS,
    MAX_QUEUE_DEPTH,
    MAX_RETRY_AFTER_MS,
    NO_ROUND,
    SESSION_BYTES,
    Ack,
    Backward,
    Busy,
    Forward,
    Priority,
)
from p2pswarm.testing.strategies import (
    SMALL_DIM,
    decodes_or_raises_remote_error,
    register_frames,
    run_bytes,
    unchecked_frame,
)

TYPES = (Forward, Backward, Ack, Busy)
IDS = st.integers(0, wire.INT_MAX)
DEPTHS = st.integers(0, MAX_QUEUE_DEPTH)


@st.composite
def tensor_frames(draw, cls):
    dtype = draw(st.sampled_from(sorted(wire.DTYPE_SIZES)))
    shape = tuple(draw(st.lists(st.integers(0, SMALL_DIM), max_size=3)))
    count = 1
    for dim in shape:
        count *= dim
    size = count * wire.DTYPE_SIZES[dtype]
    targets = 0 if cls is Backward else draw(st.integers(0, 64))
    payload = draw(st.binary(min_size=size + targets, max_size=size + targets))
    stage = draw(st.integers(0, 63))
    msg = cls(draw(st.binary(min_size=SESSION_BYTES, max_size=SESSION_BYTES)), draw(IDS),
              stage, int(draw(st.sampled_from(Priority))), draw(IDS), dtype, shape, targets,
              draw(run_bytes))
    if cls is Forward:  # an evaluation's chain: one outer round and one peer per stage before this one
        n = draw(st.integers(0, min(stage, 3)))
        rounds = tuple(draw(st.lists(st.integers(NO_ROUND, wire.INT_MAX), min_size=n, max_size=n)))
        path = tuple(draw(st.lists(st.text(min_size=1, max_size=60), min_size=n, max_size=n)))
        msg = dataclasses.replace(msg, rounds=rounds, path=path)
    return msg, payload


ACKS = st.builds(Ack, IDS, DEPTHS).map(lambda m: (m, b""))
BUSIES = st.builds(Busy, IDS, DEPTHS, st.integers(0, MAX_RETRY_AFTER_MS)).map(lambda m: (m, b""))
STRATEGIES = {Forward: tensor_frames(Forward), Backward: tensor_frames(Backward), Ack: ACKS, Busy: BUSIES}
for _cls, _strategy in STRATEGIES.items():  # tests/test_wire.py then covers these types too
    register_frames(_cls, _strategy)
FRAMES = st.one_of(*STRATEGIES.values())


@given(FRAMES)
def test_round_trip(pair):
    msg, payload = pair
    assert wire.decode_frame(wire.encode_frame(msg, payload)) == (msg, payload)


@given(FRAMES, st.data())
def test_every_truncation_is_refused(pair, data):
    frame = wire.encode_frame(*pair)
    cut = data.draw(st.integers(0, len(frame) - 1))
    with pytest.raises(RemoteProtocolError):
        wire.decode_frame(frame[:cut])


@given(FRAMES, st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), min_size=1, max_size=3))
def test_corrupted_frames_decode_or_raise_remote_error(pair, flips):
    frame = bytearray(wire.encode_frame(*pair))
    for pos, byte in flips:
        frame[pos % len(frame)] = byte
    decodes_or_raises_remote_error(bytes(frame))


@given(st.binary(max_size=300))
def test_arbitrary_bytes_decode_or_raise_remote_error(data):
    decodes_or_raises_remote_error(data)


@given(FRAMES, st.sampled_from(["session", "micro_batch", "stage", "priority", "step", "dtype", "shape",
                                "targets", "queue_depth", "retry_after_ms"]),
       st.none() | st.integers() | st.binary(max_size=40) | st.text(max_size=8)
       | st.lists(st.integers(-2, 2**40), max_size=10))
def test_mutated_fields_decode_or_raise_remote_error(pair, field, value):
    decodes_or_raises_remote_error(unchecked_frame(pair, fields={field: value}))


@given(st.sampled_from([Forward, Backward]).flatmap(tensor_frames), st.integers(-64, 64).filter(bool))
def test_payload_not_matching_the_header_is_refused(pair, delta):
    msg, payload = pair
    wrong = payload + b"\0" * delta if delta > 0 else payload[:delta]
    if len(wrong) == len(payload):  # cutting an empty payload leaves it as it was
        return
    with pytest.raises(RemoteProtocolError, match=r"tensor|targets"):
        wire.decode_frame(unchecked_frame(pair, wrong))
    with pytest.raises(LocalProtocolError):
        wire.encode_frame(msg, wrong)


GOOD = dict(session=b"s" * SESSION_BYTES, micro_batch=1, stage=0, priority=2, step=0, dtype="float32",
            shape=(1,), targets=0)
BAD_TENSOR_FIELDS = {
    "short session": dict(session=b"s"), "long session": dict(session=b"s" * 17),
    "negative id": dict(micro_batch=-1), "negative stage": dict(stage=-1), "huge stage": dict(stage=4096),
    "priority": dict(priority=4), "negative priority": dict(priority=-1), "negative step": dict(step=-1),
    "dtype": dict(dtype="float128"), "negative dim": dict(shape=(-1,)), "too many dims": dict(shape=(1,) * 9),
    "too large": dict(shape=(2**20, 2**20)), "negative targets": dict(targets=-1),
    "targets past the payload": dict(targets=5), "targets leave the tensor short": dict(targets=1),
}


@pytest.mark.parametrize("cls", [Forward, Backward])
@pytest.mark.parametrize("name", sorted(BAD_TENSOR_FIELDS))
def test_out_of_bounds_tensor_headers_are_refused(cls, name):
    msg = cls(**dict(GOOD, **BAD_TENSOR_FIELDS[name]))
    with pytest.raises(RemoteProtocolError):
        msg.check(4)
    with pytest.raises(LocalProtocolError):
        wire.encode_frame(msg, b"\0" * 4)


@pytest.mark.parametrize("msg", [
    Ack(-1, 0), Ack(0, -1), Ack(0, MAX_QUEUE_DEPTH + 1),
    Busy(-1, 0, 0), Busy(0, -1, 0), Busy(0, 0, -1), Busy(0, 0, MAX_RETRY_AFTER_MS + 1),
])
def test_out_of_bounds_replies_are_refused(msg):
    with pytest.raises(LocalProtocolError):
        wire.encode_frame(msg)


@pytest.mark.parametrize("msg", [Ack(1, 2), Busy(1, 2, 3)])
def test_replies_carry_no_payload(msg):
    with pytest.raises(LocalProtocolError, match="no payload"):
        wire.encode_frame(msg, b"x")


def test_registered_and_tensor_free():
    assert {cls.TYPE for cls in TYPES} <= set(wire.registered_types())
    import subprocess
    import sys
    code = "import p2pswarm.swarm.activation, sys; assert not {'torch', 'trio'} & set(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_tensor_round_trip_through_a_forward():
    torch = pytest.importorskip("torch")
    tensor = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    from p2pswarm.swarm import codec

    frame, payload = codec.tensor_to_frame("x", tensor)
    msg = Forward(b"s" * SESSION_BYTES, 7, 1, int(Priority.TRAINING_FORWARD), 3, frame.dtype, frame.shape, 0)
    got, body = wire.decode_frame(wire.encode_frame(msg, payload))
    back = codec.frame_to_tensor(wire.TensorFrame("x", got.dtype, got.shape), body)
    assert torch.equal(back, tensor)


def test_forward_targets_follow_the_tensor():
    msg = Forward(**dict(GOOD, targets=3))
    tensor, targets = msg.split(b"\0" * 4 + b"abc")
    assert (tensor, targets) == (b"\0" * 4, b"abc")
    assert wire.decode_frame(wire.encode_frame(msg, tensor + targets)) == (msg, tensor + targets)
    with pytest.raises(RemoteProtocolError):
        Backward(**dict(GOOD, targets=3)).check(7)


@pytest.mark.parametrize("cls", [Forward, Backward])
@pytest.mark.parametrize("run", [b"", b"\0" * 7, b"\0" * 9])
def test_a_run_identity_of_another_size_is_refused(cls, run):
    priority = Priority.TRAINING_BACKWARD if cls is Backward else Priority.TRAINING_FORWARD
    good = cls(b"s" * SESSION_BYTES, 0, 1, int(priority), 0, "float32", (1,), 0)
    with pytest.raises(LocalProtocolError):
        wire.encode_frame(dataclasses.replace(good, run=run), b"\0" * 4)
    with pytest.raises(RemoteProtocolError, match="run identity"):
        wire.decode_frame(unchecked_frame((good, b"\0" * 4), fields={"run": run}))


@pytest.mark.parametrize("fields", [
    {"rounds": [1], "path": []},  # a round without its peer
    {"rounds": [1, 1], "path": ["a", "b"]},  # more stages before stage 1 than there are
    {"rounds": [-2], "path": ["a"]},  # below NO_ROUND
    {"rounds": [0], "path": [""]},  # an empty peer id
    {"rounds": [0], "path": ["x" * (MAX_PEER_ID_CHARS + 1)]},
])
def test_an_evaluations_chain_that_does_not_fit_its_stage_is_refused(fields):
    good = Forward(b"s" * SESSION_BYTES, 0, 1, int(Priority.INFERENCE), 0, "float32", (1,), 0,
                   rounds=(0,), path=("a",))
    assert wire.decode_frame(wire.encode_frame(good, b"\0" * 4))[0] == good
    with pytest.raises(RemoteProtocolError):
        wire.decode_frame(unchecked_frame((good, b"\0" * 4), fields=fields))

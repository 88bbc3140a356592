"""Hot snapshots: round trips of real and random states, totality of the decoder on garbage and on
crafted headers with a valid digest, the store's rotation and fallback, and SIGKILL mid-write."""

from __future__ import annotations

import hashlib
import logging
import math
import os
import signal
import subprocess
import sys
import time

import cbor2
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from p2pswarm.checkpoint import (
    DTYPES, INT_MAX, INT_MIN, KEEP, MAX_DEPTH, MAX_TENSORS, SNAPSHOT_MAGIC, SnapshotStore, decode_state,
    digest, encode_state,
)
from p2pswarm.diloco.outer import OuterOptimizer
from p2pswarm.errors import RemoteProtocolError
from p2pswarm.model.catalog import get_model
from p2pswarm.model.transformer import build_stage

FAST = settings(max_examples=60)
SLOW = settings(max_examples=25)

# --- helpers ------------------------------------------------------------------------------------


def same(a, b) -> bool:
    """Deep equality that also requires equal types, dict order, dtypes, tensor bytes and float signs.

    ``a`` is the original, ``b`` the decoded: an OrderedDict comes back as a dict.
    """
    if isinstance(a, dict) and type(b) is dict:
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return (a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) == math.copysign(1, b))
    return a == b


def wrap(header: bytes, data: bytes = b"", *, length: int | None = None, pad: bytes | None = None) -> bytes:
    """A snapshot around ``header`` and ``data``, with a valid digest: only the structure is wrong."""
    body = SNAPSHOT_MAGIC + (len(header) if length is None else length).to_bytes(8, "little") + header
    body += pad if pad is not None else bytes(-len(body) % 8)
    body += data
    return body + hashlib.sha256(body).digest()


def header(tree, table=(), **extra) -> bytes:
    return cbor2.dumps({"tree": tree, "tensors": [list(e) for e in table], **extra}, canonical=True)


def tensors_in(tree) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    items = tree.values() if isinstance(tree, dict) else tree if isinstance(tree, (list, tuple)) else ()
    return [t for item in items for t in tensors_in(item)]


# --- a real replica's state ---------------------------------------------------------------------


def replica_state():
    torch.manual_seed(0)
    module = build_stage(get_model("tiny-lm/2"), 0, 0)
    optimizer = torch.optim.AdamW(module.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.01)
    module(torch.randint(0, 256, (2, 16))).float().pow(2).mean().backward()
    optimizer.step()
    outer = OuterOptimizer(dict(module.named_parameters()))
    engine = {"module": module.state_dict(), "optimizer": optimizer.state_dict(), "step": 1,
              "micro_batches": 1, "tokens": 32}
    state = {"format": 1, "model": "tiny-lm/2", "stage": 0, "engine": engine, "diloco": outer.state_dict(),
             "feedback": {"loss": [3.5, float("nan"), -0.0], "peers": {"12D3KooW": (1, None, b"\x00\x01")}},
             "meta": {"created": 1712345678.25, "ok": True, "note": "ünïcode"}}
    return module, optimizer, state


def test_a_real_replica_state_round_trips_and_loads():
    module, optimizer, state = replica_state()
    optim_state = state["engine"]["optimizer"]
    assert isinstance(optim_state["state"][0]["step"], torch.Tensor)  # what torch's AdamW keeps
    assert type(optim_state["param_groups"][0]["betas"]) is tuple
    data = encode_state(state)
    decoded = decode_state(data)
    assert same(state, decoded)
    assert len(tensors_in(decoded)) == len(tensors_in(state)) > 20

    twin = build_stage(get_model("tiny-lm/2"), 0, 1)  # other seed: other weights until loaded
    twin_optimizer = torch.optim.AdamW(twin.parameters(), lr=1.0, betas=(0.5, 0.5))
    twin.load_state_dict(decoded["engine"]["module"])
    twin_optimizer.load_state_dict(decoded["engine"]["optimizer"])
    assert twin_optimizer.param_groups[0]["betas"] == (0.9, 0.95)
    ids = torch.randint(0, 256, (2, 16))
    for m, opt in ((module, optimizer), (twin, twin_optimizer)):  # the same next step on both
        opt.zero_grad()
        m(ids).float().pow(2).mean().backward()
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(module.state_dict().values(), twin.state_dict().values()))


def test_encoding_is_canonical_and_digest_is_the_trailing_sha256():
    _, _, state = replica_state()
    data = encode_state(state)
    assert encode_state(decode_state(data)) == data == encode_state(state)
    assert digest(data) == hashlib.sha256(data[:-32]).digest() == data[-32:]
    with pytest.raises(ValueError):
        digest(b"not a snapshot")


def test_decoded_tensors_are_independent_writable_copies():
    source = {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(4, dtype=torch.int64)}
    buffer = bytearray(encode_state(source))
    decoded = decode_state(buffer)
    buffer[:] = bytes(len(buffer))  # the caller's buffer is reused: the tensors must not change
    assert same(source, decoded)
    decoded["a"].add_(1.0)
    decoded["b"].zero_()
    again = decode_state(encode_state(source))
    assert same(source, again) and not same(source, decoded)


def test_views_non_contiguous_tensors_and_parameters_encode_as_plain_tensors():
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    state = {"t": base.t(), "slice": base[1:3, 2:], "param": torch.nn.Parameter(torch.ones(2)),
             "scalar": torch.tensor(7, dtype=torch.int16), "empty": torch.zeros(0, 5, dtype=torch.bfloat16)}
    decoded = decode_state(encode_state(state))
    for name in state:
        assert type(decoded[name]) is torch.Tensor and decoded[name].dtype == state[name].dtype
        assert torch.equal(decoded[name], state[name].detach())
    assert decoded["t"].is_contiguous() and not decoded["param"].requires_grad


# --- random states ------------------------------------------------------------------------------

KEYS = st.text(max_size=6) | st.integers(INT_MIN, INT_MAX)
SCALARS = (st.none() | st.booleans() | st.integers(INT_MIN, INT_MAX) | st.floats()
           | st.text(max_size=12) | st.binary(max_size=12))


@st.composite
def tensors(draw):
    dtype = DTYPES[draw(st.sampled_from(sorted(DTYPES)))]
    shape = draw(st.lists(st.integers(0, 3), max_size=3))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
    if dtype is torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    raw = torch.randint(0, 256, (math.prod(shape) * dtype.itemsize,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(shape)  # any bit pattern: NaNs, infinities, subnormals


trees = st.recursive(
    SCALARS | tensors(),
    lambda children: (st.lists(children, max_size=4) | st.lists(children, max_size=4).map(tuple)
                      | st.dictionaries(KEYS, children, max_size=4)),
    max_leaves=24,
)
states = st.dictionaries(KEYS, trees, max_size=5)


@FAST
@given(state=states)
def test_random_states_round_trip(state):
    data = encode_state(state)
    decoded = decode_state(data)
    assert same(state, decoded)
    assert encode_state(decoded) == data


def test_depth_limit_is_exact():
    def nested(containers):
        node = torch.ones(1)
        for _ in range(containers - 1):
            node = [node]
        return {"x": node}

    assert same(nested(MAX_DEPTH), decode_state(encode_state(nested(MAX_DEPTH))))
    with pytest.raises(ValueError):
        encode_state(nested(MAX_DEPTH + 1))
    cyclic: list = []
    cyclic.append(cyclic)
    with pytest.raises(ValueError):
        encode_state({"cycle": cyclic})


@pytest.mark.parametrize("bad", [
    [1, 2], {"s": {1, 2}}, {"o": object()}, {True: 1}, {1.5: 1}, {b"k": 1}, {None: 1}, {"i": 2**63},
    {"i": -(2**63) - 1}, {"c": torch.zeros(2, dtype=torch.complex64)}, {"s": torch.eye(2).to_sparse()},
    {"m": torch.empty(2, device="meta")}, {"u": "\ud800"}, {"n": torch.zeros(1).numpy()},
])
def test_encode_refuses_what_a_snapshot_cannot_hold(bad):
    with pytest.raises(ValueError):
        encode_state(bad)


def test_encode_refuses_more_than_max_tensors():
    with pytest.raises(ValueError):
        encode_state({"many": [torch.zeros(0)] * (MAX_TENSORS + 1)})


# --- totality -----------------------------------------------------------------------------------


@FAST
@given(blob=st.binary(max_size=300) | st.binary(max_size=300).map(lambda b: SNAPSHOT_MAGIC + b))
def test_arbitrary_bytes_raise_remote_protocol_error(blob):
    with pytest.raises(RemoteProtocolError):
        decode_state(blob)


@FAST
@given(state=states, change=st.data())
def test_a_flipped_byte_a_truncation_or_an_extension_is_refused(state, change):
    data = encode_state(state)
    how = change.draw(st.sampled_from(["flip", "truncate", "extend"]))
    if how == "flip":
        index = change.draw(st.integers(0, len(data) - 1))
        bad = bytearray(data)
        bad[index] ^= change.draw(st.integers(1, 255))
        with pytest.raises(RemoteProtocolError) as err:
            decode_state(bytes(bad))
        if index >= len(SNAPSHOT_MAGIC):
            assert "digest" in str(err.value)  # caught by the hash, before anything is parsed
    elif how == "truncate":
        with pytest.raises(RemoteProtocolError):
            decode_state(data[:change.draw(st.integers(0, len(data) - 1))])
    else:
        with pytest.raises(RemoteProtocolError):
            decode_state(data + change.draw(st.binary(min_size=1, max_size=40)))


cbor_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**64), 2**64 - 1) | st.floats() | st.text(max_size=4)
    | st.binary(max_size=4),
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.integers(-2, 2) | st.text(max_size=2), c, max_size=3),
    max_leaves=12,
)
node_like = st.recursive(
    cbor_values,
    lambda c: st.builds(lambda kind, rest: [kind, *rest], st.integers(-1, 4), st.lists(c, max_size=4)),
    max_leaves=12,
)
entries = st.tuples(st.sampled_from([*DTYPES, "float8", 3, None]), st.lists(st.integers(-1, 2**33), max_size=3),
                    st.integers(-8, 72), st.integers(-8, 72)).map(list)


@SLOW
@given(tree=node_like, table=st.lists(entries, max_size=3), data=st.binary(max_size=72),
       raw=st.binary(max_size=64), use_raw=st.booleans())
def test_headers_with_a_valid_digest_decode_or_raise_remote_protocol_error(tree, table, data, raw, use_raw):
    """Past the digest, arbitrary CBOR and format-shaped junk: a dict or RemoteProtocolError, nothing else."""
    blob = wrap(raw if use_raw else header(tree, table), data)
    try:
        state = decode_state(blob)
    except RemoteProtocolError:
        return
    assert type(state) is dict


F32 = ["float32", [3], 0, 12]
I64 = ["int64", [1], 16, 8]
DATA = bytes(range(12)) + bytes(4) + bytes(range(8))
TREE = [2, "a", [3, 0], "b", [3, 1]]


def deep(n):
    """A header tree of ``n`` containers: a dict holding n - 1 nested lists."""
    node = [0]
    for _ in range(n - 2):
        node = [0, node]
    return [2, "x", node]


CRAFTED = {  # name: the blob; each breaks exactly one rule
    "unknown dtype": wrap(header(TREE, [["float8", [3], 0, 12], I64]), DATA),
    "dtype not a str": wrap(header(TREE, [[4, [3], 0, 12], I64]), DATA),
    "negative dim": wrap(header(TREE, [["float32", [-3], 0, 12], I64]), DATA),
    "bool dim": wrap(header(TREE, [["float32", [True], 0, 4], I64]), DATA),
    "too many dims": wrap(header(TREE, [["float32", [1] * 17 + [3], 0, 12], I64]), DATA),
    "overlap": wrap(header(TREE, [F32, ["int64", [1], 0, 8]]), DATA),
    "gap": wrap(header(TREE, [F32, ["int64", [1], 24, 8]]), DATA + bytes(8)),
    "unaligned": wrap(header(TREE, [F32, ["int64", [1], 12, 8]]), DATA[:12] + bytes(12)),
    "nbytes not the shape's": wrap(header(TREE, [["float32", [3], 0, 11], I64]), DATA),
    "data short": wrap(header(TREE, [F32, I64]), DATA[:-1]),
    "data long": wrap(header(TREE, [F32, I64]), DATA + bytes(8)),
    "nonzero tensor padding": wrap(header(TREE, [F32, I64]), DATA[:12] + b"\x01" + DATA[13:]),
    "nonzero header padding": wrap(header(TREE, [F32, I64]), DATA, pad=b"\x01" + bytes(6)),
    "huge tensor": wrap(header([2, "a", [3, 0]], [["float32", [2**20, 2**20], 0, 2**42]])),
    "huge empty tensor": wrap(header([2, "a", [3, 0]], [["float32", [0, 2**40, 2**40], 0, 0]])),
    "too many tensors": wrap(header([2], [["uint8", [0], 0, 0]] * (MAX_TENSORS + 1))),
    "bool byte 2": wrap(header([2, "a", [3, 0]], [["bool", [2], 0, 2]]), b"\x01\x02" + bytes(6)),
    "references out of order": wrap(header([2, "a", [3, 1], "b", [3, 0]], [F32, I64]), DATA),
    "reference twice": wrap(header([2, "a", [3, 0], "b", [3, 0]], [F32, I64]), DATA),
    "reference missing": wrap(header([2, "a", [3, 0]], [F32, I64]), DATA),
    "reference past the table": wrap(header([2, "a", [3, 0], "b", [3, 2]], [F32, I64]), DATA),
    "reference not an int": wrap(header([2, "a", [3, "0"]], [F32]), DATA[:16]),
    "top level not a dict": wrap(header([0, 1, 2])),
    "top level a tensor": wrap(header([3, 0], [F32]), DATA[:16]),
    "unknown kind": wrap(header([2, "a", [7, 1]])),
    "kind not an int": wrap(header([2, "a", ["list", 1]])),
    "empty node": wrap(header([2, "a", []])),
    "odd dict": wrap(header([2, "a"])),
    "duplicate key": wrap(header([2, "a", 1, "a", 2])),
    "bool key": wrap(header([2, True, 1])),
    "float key": wrap(header([2, 1.5, 1])),
    "bytes key": wrap(header([2, b"k", 1])),
    "map in the tree": wrap(header([2, "a", {"b": 1}])),
    "int past 64 bits": wrap(header([2, "a", 2**63])),
    "int below 64 bits": wrap(header([2, "a", -(2**63) - 1])),
    "key past 64 bits": wrap(header([2, 2**63, 1])),
    "too deep": wrap(header(deep(MAX_DEPTH + 1))),
    "undefined": wrap(header([2, "a", cbor2.undefined])),
    "simple value": wrap(header([2, "a", cbor2.CBORSimpleValue(99)])),
    "tag": wrap(header([2, "a", cbor2.CBORTag(2, b"\x01")])),
    "extra root key": wrap(header([2], extra=1)),
    "table not a list": wrap(cbor2.dumps({"tree": [2], "tensors": {}}, canonical=True)),
    "entry of 3": wrap(header([2, "a", [3, 0]], [["float32", [3], 0]]), DATA[:16]),
    "not canonical": wrap(cbor2.dumps({"tensors": [], "tree": [2]})),  # canonical order puts "tree" first
    "long int form": wrap(header([2, "a", 1])[:-1] + b"\x18\x01"),
    "trailing byte": wrap(header([2]) + b"\x00"),
    "indefinite array": wrap(b"\xa2\x64tree\x9f\x02\xff\x67tensors\x80"),
    "not CBOR": wrap(b"\xff\xff\xff"),
    "header length past the end": wrap(header([2]), length=2**63),
    "header length one past": wrap(header([2]), length=len(header([2])) + 1),
    "empty": wrap(b""),
}


def test_the_crafted_baseline_decodes():
    state = decode_state(wrap(header(TREE, [F32, I64]), DATA))
    assert torch.equal(state["a"], torch.frombuffer(bytearray(DATA[:12]), dtype=torch.float32))
    assert state["b"].tolist() == [int.from_bytes(DATA[16:], "little")]
    lists = []
    for _ in range(MAX_DEPTH - 2):
        lists = [lists]
    assert same({"x": lists}, decode_state(wrap(header(deep(MAX_DEPTH)))))


@pytest.mark.parametrize("name", sorted(CRAFTED))
def test_crafted_snapshots_with_a_valid_digest_are_refused(name):
    with pytest.raises(RemoteProtocolError):
        decode_state(CRAFTED[name])


def test_the_size_limit_is_checked_before_anything_else():
    data = encode_state({"w": torch.zeros(100)})
    with pytest.raises(RemoteProtocolError, match="exceeds"):
        decode_state(data, max_bytes=len(data) - 1)
    assert decode_state(data, max_bytes=len(data))["w"].shape == (100,)


# --- the store ----------------------------------------------------------------------------------


def snapshot(round_: int) -> bytes:
    return encode_state({"round": round_, "w": torch.full((4,), float(round_))})


def test_the_store_keeps_the_newest_and_loads_the_newest(tmp_path):
    directory = tmp_path / "a" / "snapshots"
    store = SnapshotStore(directory)
    assert store.latest() is None and store.paths() == []
    assert directory.stat().st_mode & 0o777 == 0o700
    saved = [store.save(snapshot(r), round=r, step=10 * r) for r in range(8)]
    assert store.paths() == saved[-KEEP:]
    assert [p.name for p in store.paths()][0] == "snapshot-00000004-r3-s30.p2ps"
    assert saved[-1].read_bytes() == snapshot(7) and not [p for p in directory.iterdir() if p.suffix == ".tmp"]
    path, state = store.latest()
    assert path == saved[-1] and state["round"] == 7
    assert SnapshotStore(directory, keep=2).save(snapshot(8), round=8, step=80).name.startswith("snapshot-00000009")
    assert len(store.paths()) == 2


def test_newest_is_by_sequence_not_mtime_and_numeric(tmp_path):
    store = SnapshotStore(tmp_path)
    older = store.save(snapshot(1), round=1, step=1)
    newer = store.save(snapshot(2), round=2, step=2)
    future = time.time() + 3600
    os.utime(older, (future, future))
    assert store.paths() == [older, newer] and store.latest()[1]["round"] == 2
    (tmp_path / "snapshot-100000000-r9-s9.p2ps").write_bytes(snapshot(9))  # 9 digits sorts after 8
    (tmp_path / "snapshot-99999999-r8-s8.p2ps").write_bytes(snapshot(8))
    (tmp_path / "README").write_text("not a snapshot")
    assert [p.name for p in store.paths()][-2:] == ["snapshot-99999999-r8-s8.p2ps", "snapshot-100000000-r9-s9.p2ps"]
    assert store.latest()[1]["round"] == 9
    assert store.save(snapshot(10), round=10, step=10).name == "snapshot-100000001-r10-s10.p2ps"


def test_a_corrupt_newest_falls_back_to_the_previous(tmp_path, caplog):
    store = SnapshotStore(tmp_path)
    paths = [store.save(snapshot(r), round=r, step=r) for r in range(3)]
    flipped = bytearray(paths[2].read_bytes())
    flipped[len(flipped) // 2] ^= 0x40
    paths[2].write_bytes(bytes(flipped))
    paths[1].write_bytes(paths[1].read_bytes()[:-5])
    with caplog.at_level(logging.WARNING, logger="p2pswarm.checkpoint"):
        path, state = store.latest()
    assert path == paths[0] and state["round"] == 0
    assert sum(paths[i].name in r.getMessage() for r in caplog.records for i in (1, 2)) == 2
    paths[0].write_bytes(b"")
    assert store.latest() is None


def test_temp_files_are_never_loaded_and_are_removed(tmp_path):
    store = SnapshotStore(tmp_path)
    store.save(snapshot(1), round=1, step=1)
    stray = tmp_path / ".snapshot-abc123.tmp"
    stray.write_bytes(snapshot(2))  # complete and valid, but never renamed: not a snapshot yet
    assert store.latest()[1]["round"] == 1 and not stray.exists()
    stray.write_bytes(snapshot(2)[:100])
    store.save(snapshot(3), round=3, step=3)
    assert not stray.exists() and [p.name for p in tmp_path.iterdir()] != []


def test_save_refuses_misuse(tmp_path):
    store = SnapshotStore(tmp_path)
    with pytest.raises(ValueError):
        store.save(b"hello", round=1, step=1)
    with pytest.raises(ValueError):
        store.save(snapshot(1), round=-1, step=1)
    with pytest.raises(ValueError):
        SnapshotStore(tmp_path, keep=0)
    assert store.paths() == []


# --- SIGKILL while a snapshot is being written ------------------------------------------------

WRITER = """
import sys, torch
from p2pswarm.checkpoint import SnapshotStore, encode_state
store, round_ = SnapshotStore(sys.argv[1]), int(sys.argv[2])
weights = torch.empty(5_000_000)  # 20 MB
while True:
    weights.fill_(float(round_))
    store.save(encode_state({"round": round_, "weights": weights}), round=round_, step=10 * round_)
    round_ += 1
"""
KILL_DEADLINE = 60.0  # seconds: a bound for a broken run only; a passing run takes a few
POLL = 0.002  # seconds between looks at the directory while waiting for a condition


def rounds_on_disk(directory) -> list[int]:
    return [int(p.name.split("-r")[1].split("-")[0]) for p in SnapshotStore(directory).paths()]


def temps_in(directory) -> dict[str, int]:
    return {e.name: e.stat().st_size for e in os.scandir(directory) if e.name.endswith(".tmp")}


def stop_mid_write(process, directory, first_round, completed, deadline):
    """SIGSTOP the writer at a moment when ``completed`` of its snapshots exist and a temp file is
    being written (checked while it is stopped); return the temp files then."""
    while time.monotonic() < deadline:
        assert process.poll() is None, "the writer died on its own"
        if len([r for r in rounds_on_disk(directory) if r >= first_round]) >= completed and temps_in(directory):
            os.kill(process.pid, signal.SIGSTOP)
            _, status = os.waitpid(process.pid, os.WUNTRACED)  # returns once it is stopped
            assert os.WIFSTOPPED(status)
            temps = temps_in(directory)
            if temps:
                return temps
            os.kill(process.pid, signal.SIGCONT)  # it renamed in between: try the next one
        time.sleep(POLL)
    raise AssertionError("the writer never got to the moment to kill it")


def test_sigkill_while_writing_leaves_the_previous_snapshot_loadable(tmp_path):
    directory, script = tmp_path / "snapshots", tmp_path / "writer.py"
    script.write_text(WRITER)
    deadline = time.monotonic() + KILL_DEADLINE
    for iteration in range(3):  # each kill after a different number of this writer's snapshots
        first_round = 1000 * (iteration + 1)
        with open(tmp_path / f"writer{iteration}.log", "w") as log:
            process = subprocess.Popen([sys.executable, str(script), str(directory), str(first_round)],
                                       stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        try:
            temps = stop_mid_write(process, directory, first_round, 2 + iteration, deadline)
            os.kill(process.pid, signal.SIGKILL)
            process.wait(timeout=10)
        finally:
            if process.poll() is None:
                os.kill(process.pid, signal.SIGKILL)
                process.wait(timeout=10)
        assert temps and temps_in(directory) == temps  # it died mid-write, leaving its temp file
        rounds = rounds_on_disk(directory)
        highest = max(rounds)
        assert highest >= first_round + 1 + iteration and len(rounds) <= KEEP
        path, state = SnapshotStore(directory).latest()
        assert state["round"] == highest and f"-r{highest}-" in path.name
        assert torch.equal(state["weights"], torch.full((5_000_000,), float(highest)))
        assert temps_in(directory) == {}  # removed, never loaded

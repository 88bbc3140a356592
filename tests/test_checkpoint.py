"""Hot snapshots: round trips of real and random states, the files as the safetensors library reads
them, the store's rotation and fallback, and SIGKILL mid-write. The decoder's totality on garbage and
on forged headers is in ``test_checkpoint_fuzz.py``."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest
import safetensors
import safetensors.torch
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from p2pswarm.diloco.checkpoint import (
    DTYPES,
    FORMAT,
    INT_MAX,
    INT_MIN,
    KEEP,
    MAX_DEPTH,
    MAX_TENSORS,
    SnapshotStore,
    decode_state,
    digest,
    encode_state,
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


def metadata_of(data: bytes) -> dict:
    length = int.from_bytes(data[:8], "little")
    return json.loads(data[8:8 + length])["__metadata__"]


def test_encoding_is_canonical_and_digest_is_the_sha256_with_its_own_digits_zeroed():
    _, _, state = replica_state()
    data = encode_state(state)
    assert encode_state(decode_state(data)) == data == encode_state(state)
    recorded = metadata_of(data)["sha256"]
    zeroed = data.replace(recorded.encode(), b"0" * 64)
    assert data.count(recorded.encode()) == 1 and digest(data) == hashlib.sha256(zeroed).digest()
    assert digest(data).hex() == recorded
    with pytest.raises(ValueError):
        digest(b"not a snapshot")


def test_a_snapshot_is_a_safetensors_file_with_readable_names(tmp_path):
    module, _, state = replica_state()
    data = encode_state(state)
    path = tmp_path / "snapshot-00000001-r0-s1.p2ps"
    path.write_bytes(data)
    with safetensors.safe_open(str(path), "pt") as f:
        names = set(f.keys())
        assert f.metadata()["format"] == FORMAT and json.loads(f.metadata()["tree"])[0] == 2
        for name, param in module.state_dict().items():
            assert torch.equal(f.get_tensor(f"engine/module/{name}"), param)
        assert torch.equal(f.get_tensor("engine/optimizer/state/0/exp_avg"),
                           state["engine"]["optimizer"]["state"][0]["exp_avg"])
    assert "engine/module/layers.0.mlp.up_proj.weight" in names and len(names) == len(tensors_in(state))
    loaded = safetensors.torch.load(data)  # the library's reader of bytes agrees
    assert loaded.keys() == names


def test_tensor_names_are_paths_and_keys_that_would_collide_are_escaped():
    state = {"a/b": torch.ones(1), "a": {"b": torch.zeros(1)}, 5: torch.ones(2), "5": torch.zeros(2),
             "": torch.ones(3), "%": torch.zeros(3), "__metadata__": torch.ones(4), "l": [torch.ones(5)],
             "-1": (torch.zeros(5),)}
    data = encode_state(state)
    assert same(state, decode_state(data))
    assert set(safetensors.torch.load(data)) == {"a%2Fb", "a/b", "5", "%35", "%", "%25", "%5F_metadata__",
                                                  "l/0", "%2D1/0"}


@FAST
@given(state=st.deferred(lambda: states))
def test_the_safetensors_library_reads_what_we_write(state):
    data = encode_state(state)
    loaded = safetensors.torch.load(data)
    tree = json.loads(metadata_of(data)["tree"])
    names = []

    def refs(node):
        if isinstance(node, list) and node and node[0] == 3 and len(node) == 2 and isinstance(node[1], str):
            names.append(node[1])
        elif isinstance(node, list):
            for item in node[1:]:
                refs(item)
    refs(tree)
    assert sorted(names) == sorted(loaded) and len(names) == len(tensors_in(state))
    decoded = decode_state(data)
    assert all(same(t, loaded[name]) for name, t in zip(names, tensors_in(decoded)))


def test_an_older_snapshot_format_is_refused_with_a_clear_message():
    old = b"P2PSNAP1" + (9).to_bytes(8, "little") + bytes(80)
    with pytest.raises(RemoteProtocolError, match="an older snapshot format"):
        decode_state(old)


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
    assert next(p.name for p in store.paths()) == "snapshot-00000004-r3-s30.p2ps"
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
    with caplog.at_level(logging.WARNING, logger="p2pswarm.diloco.checkpoint"):
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
from p2pswarm.diloco.checkpoint import SnapshotStore, encode_state
store, round_ = SnapshotStore(sys.argv[1]), int(sys.argv[2])
weights = torch.empty(5_000_000)  # 20 MB
while True:
    weights.fill_(float(round_))
    store.save(encode_state({"round": round_, "weights": weights}), round=round_, step=10 * round_)
    round_ += 1
"""
WRITER_ENV = {**os.environ,  # this checkout's p2pswarm
              "PYTHONPATH": os.pathsep.join([str(pathlib.Path(__file__).resolve().parents[1]),
                                            os.environ.get("PYTHONPATH", "")])}
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
                                       stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=WRITER_ENV)
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

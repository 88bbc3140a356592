"""The sparse 2-bit outer codec (``diloco/sparse.py``): what it keeps, its error bound, error feedback,
its size, and a total, canonical decoder."""

from __future__ import annotations

import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from p2pswarm.diloco import compression, sparse
from p2pswarm.diloco.sparse import SPARSE_CHUNK, SPARSE_TOP, decode, encode, encoded_size, kept
from p2pswarm.errors import RemoteProtocolError

sizes = st.sampled_from([0, 1, 2, 3, 63, 64, 65, 100, SPARSE_CHUNK - 1, SPARSE_CHUNK, SPARSE_CHUNK + 1,
                         2 * SPARSE_CHUNK + 65, 3 * SPARSE_CHUNK + 7])


@st.composite
def vectors(draw):
    n = draw(sizes)
    seed = draw(st.integers(0, 2**31 - 1))
    scale = draw(st.sampled_from([0.0, 1e-30, 1e-6, 1.0, 1e6, 1e30]))
    g = torch.Generator().manual_seed(seed)
    vector = torch.randn(n, generator=g) * scale
    if n and draw(st.booleans()):  # ties, zeros and a lone outlier
        vector[torch.randint(0, n, (n // 3,), generator=g)] = 0.0
        vector[draw(st.integers(0, n - 1))] = draw(st.sampled_from([-3e38, 3e38, 1e-38, -7.0]))
    return vector


def chunks(n: int):
    for start in range(0, n, SPARSE_CHUNK):
        yield start, min(n, start + SPARSE_CHUNK)


@given(vectors(), st.sampled_from([SPARSE_TOP, 1, 3, 4 * SPARSE_TOP, SPARSE_CHUNK]))
@settings(max_examples=120, deadline=None)
def test_round_trip_keeps_the_top_entries_of_each_chunk_within_half_their_range(vector, top):
    error = torch.empty_like(vector)
    data = encode(vector, error_out=error, top=top)
    assert len(data) == encoded_size(vector.numel(), top=top)
    decoded = decode(data, vector.numel(), top=top)
    assert decoded.dtype == torch.float32 and decoded.shape == vector.shape
    assert torch.equal(vector - decoded, error)  # error feedback gets exactly what was left out
    for start, end in chunks(vector.numel()):
        chunk, got = vector[start:end], decoded[start:end]
        sent = got != 0
        assert int(sent.sum()) <= min(top, end - start)
        if not bool(sent.any()):
            continue
        largest = chunk.abs().topk(min(top, end - start)).values
        least, most = float(largest.min()), float(largest.max())
        assert bool((got.abs() <= most * (1 + 1e-6)).all())
        assert torch.equal(got[sent].sign(), chunk[sent].sign())  # never the wrong sign; a 0 is never sent
        assert bool(((got - chunk)[sent].abs() <= (most - least) / 2 + 1e-6 * most).all())
        assert bool((chunk[~sent].abs() <= least).all())  # what was left out is never larger than what was kept


def test_a_full_chunk_costs_under_one_percent_of_float32():
    n = 1024 * SPARSE_CHUNK
    assert kept(n) == 1024 * SPARSE_TOP
    assert encoded_size(n) / (4 * n) < 0.0075  # 120 bytes a 4,096-element chunk: 0.73 %


def test_error_feedback_sends_the_sum_of_the_inputs_less_one_residual():
    """Rounds of a fixed direction: the sum of what was sent tracks the sum of the inputs to within the
    residual, which stays bounded (nothing is lost, only delayed)."""
    g = torch.Generator().manual_seed(7)
    residual, sent, total = torch.zeros(3 * SPARSE_CHUNK), torch.zeros(3 * SPARSE_CHUNK), torch.zeros(3 * SPARSE_CHUNK)
    for _ in range(200):
        update = torch.randn(3 * SPARSE_CHUNK, generator=g) * 0.01 + 0.001
        target = update + residual
        data = encode(target, error_out=residual)
        sent += decode(data, target.numel())
        total += update
    assert torch.allclose(sent + residual, total, atol=1e-4)
    assert float(residual.abs().max()) < float(total.abs().max())  # delayed, not piling up


@given(st.binary(max_size=400), st.sampled_from([0, 1, 5, 64, 65, 200]))
@settings(max_examples=300, deadline=None)
def test_decode_is_total(data, numel):
    try:
        out = decode(data, numel)
    except RemoteProtocolError:
        return
    assert out.shape == (numel,) and compression.all_finite(out)


@given(vectors(), st.data())
@settings(max_examples=100, deadline=None)
def test_a_flipped_byte_decodes_canonically_or_is_refused(vector, data):
    encoded = bytearray(encode(vector))
    if not encoded:
        return
    at = data.draw(st.integers(0, len(encoded) - 1))
    encoded[at] ^= data.draw(st.integers(1, 255))
    try:
        out = decode(bytes(encoded), vector.numel())
    except RemoteProtocolError:
        return
    assert out.shape == vector.shape and compression.all_finite(out)


def test_refused_messages():
    vector = torch.randn(70)
    data = encode(vector)
    with pytest.raises(RemoteProtocolError):
        decode(data[:-1], 70)
    with pytest.raises(RemoteProtocolError):
        decode(data, SPARSE_CHUNK + 1)  # another size: more chunks
    with pytest.raises(RemoteProtocolError):
        decode(data, -1)
    with pytest.raises(RemoteProtocolError):
        decode(data, compression.MAX_ELEMENTS + 1)  # refused before anything is allocated
    with pytest.raises(RemoteProtocolError):
        decode(struct.pack("<ff", 2.0, 1.0) + data[8:], 70)  # low above high
    with pytest.raises(RemoteProtocolError):
        decode(struct.pack("<ff", 0.0, float("nan")) + data[8:], 70)
    with pytest.raises(RemoteProtocolError):
        decode(data[:8] + b"\x01" * (len(data) - 8), 70)  # indices repeated, codes not 0: not padding


def _chunk_bytes(indices: list[int], codes: list[int]) -> bytes:
    """One chunk of ``len(indices)`` kept entries, scales (0.5, 2), in the codec's layout."""
    return struct.pack("<ff", 0.5, 2.0) + sparse._pack_indices(torch.tensor(indices)) + \
        sparse._pack_codes(torch.tensor(codes, dtype=torch.uint8))


def test_a_chunk_with_fewer_non_zero_entries_ends_in_padding_that_decodes_to_nothing():
    vector = torch.zeros(70)
    vector[[3, 9, 40]] = torch.tensor([1.0, -2.0, 0.5])
    decoded = decode(encode(vector), 70)
    assert decoded.nonzero().flatten().tolist() == [3, 9, 40] and float(decoded[9]) == -2.0
    pad = [40] * (SPARSE_TOP - 3)
    built = decode(_chunk_bytes([3, 9, 40, *pad], [0, 3, 0] + [0] * len(pad)), 70)
    assert built.nonzero().flatten().tolist() == [3, 9, 40] and built[[3, 9, 40]].tolist() == [0.5, -2.0, 0.5]
    with pytest.raises(RemoteProtocolError):  # padding with a code
        decode(_chunk_bytes([3, 9, 40, *pad], [0, 3, 0, 1] + [0] * (len(pad) - 1)), 70)
    with pytest.raises(RemoteProtocolError):  # a real entry after padding
        decode(_chunk_bytes([3, 9, 40, 40, 41, *pad[2:]], [0] * SPARSE_TOP), 70)
    assert decode(encode(torch.zeros(70)), 70).count_nonzero() == 0


def test_the_union_of_members_entries_travels_at_members_times_top_with_its_support():
    """An owner's mean of n members' sparse parts has at most n * top entries a chunk: encoded at that
    ``top``, every one of them comes back (its value within half its chunk's range), and nothing else."""
    g = torch.Generator().manual_seed(3)
    members = [decode(encode(torch.randn(2 * SPARSE_CHUNK + 100, generator=g)), 2 * SPARSE_CHUNK + 100)
               for _ in range(4)]
    mean = torch.stack(members).mean(dim=0)
    decoded = decode(encode(mean, top=4 * SPARSE_TOP), mean.numel(), top=4 * SPARSE_TOP)
    assert torch.equal(decoded != 0, mean != 0)


def test_local_faults_are_value_errors():
    with pytest.raises(ValueError):
        encode(torch.tensor([1.0, float("inf")]))
    with pytest.raises(ValueError):
        encode(torch.zeros(3, dtype=torch.float64))
    with pytest.raises(ValueError):
        encode(torch.zeros(3), error_out=torch.zeros(4))

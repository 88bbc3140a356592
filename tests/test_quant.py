"""Quantized stage boundaries (``swarm/quant.py``): the stated error, total decoders, the run file's
``[wire]`` table, the codec's checks, and two stages that still learn through 8 and 4 bits."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

torch = pytest.importorskip("torch")

from p2pswarm import wire  # noqa: E402
from p2pswarm.errors import ConfigError, LocalProtocolError, RemoteProtocolError  # noqa: E402
from p2pswarm.model.catalog import get_model  # noqa: E402
from p2pswarm.run.spec import load_run, parse_run  # noqa: E402
from p2pswarm.run.training import train_config  # noqa: E402
from p2pswarm.swarm import codec, quant  # noqa: E402
from p2pswarm.swarm.activation import Backward, Forward  # noqa: E402

ENCODINGS = sorted(wire.QUANTIZED_BITS)
shapes = hnp.array_shapes(min_dims=1, max_dims=3, min_side=1, max_side=9)
finite = st.floats(-2.0**100, 2.0**100, allow_nan=False, width=32)


@given(encoding=st.sampled_from(ENCODINGS), values=hnp.arrays(np.float32, shapes, elements=finite))
@settings(max_examples=200)
def test_a_round_trip_is_off_by_at_most_half_a_vector_s_scale(encoding, values):
    tensor = torch.from_numpy(values)
    payload = quant.encode(tensor, encoding)
    wire.check_tensor(encoding, tuple(tensor.shape), len(payload))  # the size the header promises
    back = quant.decode(encoding, tuple(tensor.shape), payload)
    assert back.dtype == torch.float32 and back.shape == tensor.shape
    width = tensor.shape[-1]
    error = (back - tensor).reshape(-1, width).abs().amax(dim=1)
    bound = quant.max_error(tensor, encoding)
    assert bool((error <= bound * (1 + 1e-5) + 1e-30).all()), (error, bound)
    signs_kept = (torch.sign(back) * torch.sign(tensor) >= 0)  # never flips a sign
    assert bool(signs_kept.all())


def test_zero_vectors_come_back_exact_and_bytes_per_token_are_as_stated():
    tensor = torch.zeros(2, 3, 128)
    tensor[1, 2] = torch.linspace(-1, 1, 128)
    for encoding, per_token in (("q8", 4 + 128), ("q4", 4 + 64)):
        payload = quant.encode(tensor, encoding)
        assert len(payload) == 6 * per_token  # 512 B a token in float32: 3.9x and 7.5x fewer
        back = quant.decode(encoding, (2, 3, 128), payload)
        assert bool((back[0] == 0).all()) and bool((back[1, :2] == 0).all())
        assert float(back[1, 2].abs().max()) == pytest.approx(1.0)


@given(encoding=st.sampled_from(ENCODINGS), shape=shapes, data=st.data())
@settings(max_examples=200)
def test_decoding_is_total(encoding, shape, data):
    """Arbitrary bytes decode to finite numbers or raise RemoteProtocolError, of any length."""
    size = math.prod(shape[:-1]) * wire.quantized_row_bytes(wire.QUANTIZED_BITS[encoding], shape[-1])
    length = data.draw(st.sampled_from([size, size, max(size - 1, 0), size + 1]))
    payload = data.draw(st.binary(min_size=length, max_size=length))
    try:
        back = quant.decode(encoding, tuple(shape), payload)
    except RemoteProtocolError:
        return
    assert length == size and back.shape == tuple(shape) and bool(torch.isfinite(back).all())


def test_bad_scales_and_bad_inputs_are_refused():
    payload = bytearray(quant.encode(torch.ones(1, 4), "q8"))
    for scale in (float("nan"), float("inf"), -1.0):
        payload[:4] = np.float32(scale).tobytes()
        with pytest.raises(RemoteProtocolError):
            quant.decode("q8", (1, 4), bytes(payload))
    with pytest.raises(LocalProtocolError):
        quant.encode(torch.tensor([[1.0, float("nan")]]), "q4")
    with pytest.raises(LocalProtocolError):
        quant.encode(torch.tensor(1.0), "q8")
    with pytest.raises(RemoteProtocolError):
        wire.check_tensor("q8", (), 0)


def test_a_frame_sliced_by_positions_decodes_to_those_positions():
    """Inference clients keep the last n positions of a reply by slicing its bytes (``generation``)."""
    tensor = torch.randn(1, 5, 33)
    for encoding in ENCODINGS:
        payload = quant.encode(tensor, encoding)
        whole = quant.decode(encoding, (1, 5, 33), payload)
        per = len(payload) // 5
        assert torch.equal(quant.decode(encoding, (1, 2, 33), payload[3 * per:]), whole[:, 3:])


RUN = """name = "q"\nmodel = "tiny-lm/2"\n[batch]\ndtype = "bfloat16"\n"""


def test_the_run_file_chooses_each_direction_and_only_a_quantized_choice_changes_the_identity():
    dense = parse_run(RUN, "q.toml", None)
    assert (dense.activations, dense.gradients) == ("dense", "dense")
    assert parse_run(RUN + '[wire]\nactivations = "dense"\n', "q.toml", None).identity == dense.identity
    q8 = parse_run(RUN + '[wire]\nactivations = "q8"\n', "q.toml", None)
    both = parse_run(RUN + '[wire]\nactivations = "q8"\ngradients = "q4"\n', "q.toml", None)
    assert len({dense.identity, q8.identity, both.identity}) == 3
    config = train_config(both)
    assert (config.activation_codec, config.gradient_codec) == ("q8", "q4")
    assert load_run("tiny-lm").identity == "b207e76645d80cfd"  # the packaged run with its [wire] defaults


@pytest.mark.parametrize("table, message", [('activations = "q5"', "wire.activations: must be one of dense, q8, q4"),
                                            ("gradients = 8", "wire.gradients: must be a string"),
                                            ('bits = "q8"', "wire.bits: unknown key")])
def test_a_bad_wire_table_is_one_line_naming_the_key(table, message):
    with pytest.raises(ConfigError) as caught:
        parse_run(RUN + f"[wire]\n{table}\n", "q.toml", None)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def _layout(activations: str, gradients: str) -> codec.Layout:
    run = parse_run(RUN + f'[wire]\nactivations = "{activations}"\ngradients = "{gradients}"\n', "q.toml", None)
    return codec.Layout.of(get_model("tiny-lm/2"), 1, train_config(run), run.run_bytes, "me")


def test_a_peer_takes_only_the_encoding_its_run_names_and_decodes_it_to_the_run_s_dtype():
    layout = _layout("q8", "q4")
    hidden = torch.randn(2, 16, layout.width)
    dtype, shape, data = codec.to_wire(hidden, layout.activations)
    header = dict(session=b"s" * 16, micro_batch=1, stage=1, priority=0, step=0, shape=shape, run=layout.run)
    forward = Forward(**header, dtype=dtype, targets=0)
    codec.check_header(forward, layout)
    work = codec.decode_work("forward", forward, data, layout)
    assert work.tensor.dtype == torch.bfloat16 and work.tensor.shape == hidden.shape
    for wrong in (Forward(**header, dtype="bfloat16", targets=0), Backward(**header, dtype="q8", targets=0)):
        with pytest.raises(RemoteProtocolError):  # dense where q8 is agreed; q8 where gradients are q4
            codec.check_header(wrong, layout)
    codec.check_header(Backward(**header, dtype="q4", targets=0), layout)


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_two_stages_learn_through_a_quantized_boundary(encoding):
    """As the two-stage test of test_transformer, with activations and gradients through the codec."""
    from tests.test_transformer import train_two_stages

    losses = train_two_stages(lambda tensor: codec.from_wire(*codec.to_wire(tensor.detach(), encoding), "float32"))
    assert losses[0] > 5.0 and losses[-1] < 0.5, (losses[0], losses[-1])  # the dense test's own bound

"""A subspace run on the wire: ``[wire] subspace`` in the run file, frames of K numbers a token with the
micro-batch's token ids, decoded only as the run says, and two engines that train through them."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from p2pswarm.errors import ConfigError, RemoteProtocolError  # noqa: E402
from p2pswarm.run.spec import parse_run  # noqa: E402
from p2pswarm.run.training import train_config  # noqa: E402
from p2pswarm.swarm import codec  # noqa: E402
from p2pswarm.swarm import engine as eng  # noqa: E402
from p2pswarm.swarm.activation import Backward, Forward  # noqa: E402
from p2pswarm.swarm.stage_core import Job  # noqa: E402

RUN = 'name = "sub"\nmodel = "tiny-lm/2"\n[batch]\nrows = 2\ncontext = 16\n'
RANK = 16


def _run(extra: str = f'subspace = {RANK}\nactivations = "q8"\ngradients = "q8"\n'):
    return parse_run(RUN + "[wire]\n" + extra, "sub.toml", None)


def test_the_run_file_names_the_subspace_and_only_a_subspace_changes_the_identity():
    plain, sub = parse_run(RUN, "sub.toml", None), _run(f"subspace = {RANK}\n")
    assert parse_run(RUN + "[wire]\nsubspace = 0\n", "sub.toml", None).identity == plain.identity
    assert sub.identity != plain.identity and train_config(sub).subspace == RANK
    for bad, why in (("subspace = 129", "wire.subspace: must be within [0, 128]"),
                     ("subspace = -1", "wire.subspace: must be within"), ('subspace = "16"', "must be an integer")):
        with pytest.raises(ConfigError) as caught:
            parse_run(RUN + f"[wire]\n{bad}\n", "sub.toml", None)
        assert why in str(caught.value) and "\n" not in str(caught.value)


def _engines(run):
    spec, config = run.spec(), train_config(run)
    layouts = [codec.Layout.of(spec, stage, config, run.run_bytes, "me") for stage in (0, 1)]
    return [eng.StageEngine(spec, stage, config) for stage in (0, 1)], layouts


def _forward_frame(engine, layout, ids):
    work = eng.Work("forward", (b"s" * 16, 1), ids[:, :-1], ids[:, 1:].contiguous())
    (send,) = codec.encode_outputs(Job(work, None), engine.compute(work), layout, engine.step, engine.host_out)
    return send


def test_a_forward_carries_k_numbers_and_the_ids_and_the_gradient_k_numbers_back():
    run = _run()
    (first, last), (lay0, lay1) = _engines(run)
    assert (lay0.width, lay1.width, lay1.carries_ids) == (RANK, RANK, True)
    ids = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))
    send = _forward_frame(first, lay0, ids)
    rows, seq = 2, 16
    assert send.message.shape == (rows, seq, RANK) and send.message.dtype == "q8"
    assert send.message.targets == rows * (seq + 1)  # the ids' window: 1 byte a token of a byte vocabulary
    assert len(send.payload) == rows * seq * (RANK + 4) + rows * (seq + 1)  # vs 256 B a token of bfloat16
    codec.check_header(send.message, lay1)
    work = codec.decode_work("forward", send.message, send.payload, lay1)
    assert torch.equal(work.ids, ids[:, :-1]) and torch.equal(work.targets, ids[:, 1:])
    out = last.compute(work)
    (back,) = codec.encode_outputs(Job(work, "up"), out, lay1, last.step, last.host_out)
    assert isinstance(back.message, Backward) and back.message.shape == (rows, seq, RANK)
    assert len(back.payload) == rows * seq * (RANK + 4)
    grad = codec.decode_work("backward", back.message, back.payload, lay0)
    assert first.compute(grad) == eng.Output() and first.step == 1 and last.step == 1


def test_a_forward_without_its_ids_or_of_the_wrong_width_is_refused():
    run = _run()
    (first, _), (lay0, lay1) = _engines(run)
    send = _forward_frame(first, lay0, torch.randint(0, 256, (2, 17)))
    tensor_bytes = send.payload[:-send.message.targets]
    short = Forward(**{**_fields(send.message), "targets": 2 * 16})
    with pytest.raises(RemoteProtocolError):  # targets only: no window of ids
        codec.decode_work("forward", short, tensor_bytes + bytes(2 * 16), lay1)
    wide = Forward(**{**_fields(send.message), "shape": (2, 16, 128)})
    with pytest.raises(RemoteProtocolError):  # full hidden states where the run sends coordinates
        codec.check_header(wide, lay1)


def _fields(message: Forward) -> dict:
    return {name: getattr(message, name) for name in message.__dataclass_fields__}


def test_two_engines_learn_through_the_subspace_boundary():
    run = _run()
    (first, last), (lay0, lay1) = _engines(run)
    text = torch.arange(17).repeat(2, 1) % 7 + 97  # a pattern the pair can learn in a few steps
    losses = []
    for _ in range(40):
        send = _forward_frame(first, lay0, text)
        work = codec.decode_work("forward", send.message, send.payload, lay1)
        out = last.compute(work)
        losses.append(out.loss_nats / out.tokens)
        (back,) = codec.encode_outputs(Job(work, "up"), out, lay1, last.step, last.host_out)
        first.compute(codec.decode_work("backward", back.message, back.payload, lay0))
    assert losses[0] > 4.0 and losses[-1] < 1.0, (losses[0], losses[-1])

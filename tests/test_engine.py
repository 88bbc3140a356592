"""The compute engine: a stage chain computes the whole model's gradients, and pipelining is safe.

Weight stashing is what lets a stage take optimizer steps while micro-batches are still waiting
for their gradients: these tests chain real stage engines by hand (no network) and compare with
the same model built as one piece.
"""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")

from p2pswarm.errors import RemoteProtocolError  # noqa: E402
from p2pswarm.model.catalog import get_model  # noqa: E402
from p2pswarm.model.transformer import build_stage  # noqa: E402
from p2pswarm.run.training import TrainConfig  # noqa: E402
from p2pswarm.swarm import engine as engine_module  # noqa: E402
from p2pswarm.swarm.codec import from_wire, to_wire  # noqa: E402
from p2pswarm.swarm.engine import StageEngine, Work, ids_tensor  # noqa: E402

SPEC = get_model("tiny-lm/2")
WHOLE = dataclasses.replace(SPEC, stage_size=SPEC.n_layers)  # the same weights as one stage


def batch(seed: int, rows: int = 2, seq: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (rows, seq + 1), generator=g)
    return ids[:, :-1], ids[:, 1:].contiguous()


def run_chain(first: StageEngine, last: StageEngine, key, ids, targets) -> None:
    out = first.compute(Work("forward", key, ids, targets))
    back = last.compute(Work("forward", key, out.forward, targets))
    first.compute(Work("backward", key, back.backward, None))


def test_a_chain_of_stages_computes_the_whole_models_gradients():
    config = TrainConfig(accumulate=2)  # no step after one micro-batch: the gradients stay to compare
    first, last = StageEngine(SPEC, 0, config), StageEngine(SPEC, 1, config)
    ids, targets = batch(1)
    run_chain(first, last, (b"s", 1), ids, targets)

    whole = build_stage(WHOLE, 0, 0)
    whole.loss(whole(ids), targets).backward()
    grads = dict(whole.named_parameters())
    for name, param in first.params.items():
        assert torch.allclose(param.grad, grads[name].grad, atol=1e-6), name
    offset = SPEC.stage_size
    for name, param in last.params.items():
        whole_name = name
        if name.startswith("layers."):
            index, rest = name.split(".", 2)[1:]
            whole_name = f"layers.{int(index) + offset}.{rest}"
        assert torch.allclose(param.grad, grads[whole_name].grad, atol=1e-6), name


def test_a_step_between_forward_and_backward_keeps_the_stashed_weights():
    first, last = StageEngine(SPEC, 0), StageEngine(SPEC, 1)
    (ids1, t1), (ids2, t2) = batch(1), batch(2)
    reference = StageEngine(SPEC, 0, TrainConfig(accumulate=10))  # never steps: the gradient at the initial weights
    ref_out = reference.compute(Work("forward", (b"r", 2), ids2, t2))

    out2 = first.compute(Work("forward", (b"s", 2), ids2, t2))  # micro-batch 2 waits ...
    run_chain(first, last, (b"s", 1), ids1, t1)  # ... while micro-batch 1 completes and steps
    assert first.step == 1 and first.kept == 1
    assert torch.equal(out2.forward, ref_out.forward)
    grad2 = last.compute(Work("forward", (b"s", 2), out2.forward, t2)).backward

    before = {n: p.detach().clone() for n, p in first.params.items()}
    first.config = dataclasses.replace(first.config, accumulate=10)  # keep the gradient to look at it
    first.compute(Work("backward", (b"s", 2), grad2, None))  # no autograd error after the in-place step
    reference.compute(Work("backward", (b"r", 2), grad2, None))
    for name, param in first.params.items():
        assert torch.equal(param, before[name])  # no step yet
        assert torch.allclose(param.grad, reference.params[name].grad, atol=1e-6), name
    assert first.kept == 0


def test_training_lowers_the_loss_on_a_repeated_batch():
    first, last = StageEngine(SPEC, 0), StageEngine(SPEC, 1)
    ids, targets = batch(3, rows=4, seq=32)
    losses = []
    for i in range(8):
        out = first.compute(Work("forward", (b"s", i), ids, targets))
        back = last.compute(Work("forward", (b"s", i), out.forward, targets))
        losses.append(back.loss_nats / back.tokens)
        first.compute(Work("backward", (b"s", i), back.backward, None))
    assert losses[-1] < losses[0] - 0.5
    assert first.step == last.step == 8 and first.tokens == last.tokens == 8 * ids.numel()


def test_evaluation_sums_the_loss_and_keeps_no_graph():
    first, last = StageEngine(SPEC, 0), StageEngine(SPEC, 1)
    ids, targets = batch(4)
    hidden = first.compute(Work("eval", (b"e", 0), ids, targets)).forward
    out = last.compute(Work("eval", (b"e", 0), hidden, targets))
    assert first.kept == 0 and not hidden.requires_grad
    assert out.tokens == targets.numel() and 5.0 < out.loss_nats / out.tokens < 6.0  # ~ln 256 at init
    assert first.step == last.step == 0


def test_forgotten_or_unknown_gradients_do_nothing_and_bad_shapes_are_refused():
    first = StageEngine(SPEC, 0)
    ids, targets = batch(5)
    out = first.compute(Work("forward", (b"s", 1), ids, targets))
    first.forget((b"s", 1))
    assert first.compute(Work("backward", (b"s", 1), torch.ones_like(out.forward), None)).backward is None
    first.compute(Work("forward", (b"s", 2), ids, targets))
    with pytest.raises(ValueError):  # the engine computes only: the worker drops the micro-batch
        first.compute(Work("backward", (b"s", 2), torch.ones(1, 2, 3), None))


def test_tensors_survive_the_wire_and_ids_are_bytes():
    tensor = torch.randn(2, 3, SPEC.width)
    assert torch.equal(from_wire(*to_wire(tensor)), tensor)
    assert ids_tensor([b"ab", b"cd"]).tolist() == [[97, 98], [99, 100]]
    with pytest.raises(RemoteProtocolError):
        from_wire("float32", (2, 3), b"\0" * 5)


# --- devices, precision and the wire dtype (the checks of tests/test_gpu.py, on the CPU) ------------

from p2pswarm.run.placement import Placement  # noqa: E402
from p2pswarm.swarm.staging import Staging  # noqa: E402
from tests.test_gpu import check_outer_step_matches_the_host, check_snapshot_round_trip, check_training_lowers_the_loss  # noqa: E402

CPU_STEPS = 8  # the CPU check of the training loop (a small batch): enough for the loss to fall, quick on 2 cores


def test_bf16_autocast_on_the_cpu_trains_through_bf16_activations():
    check_training_lowers_the_loss(Placement("cpu", "bf16"), CPU_STEPS, "bfloat16", rows=2, seq=16)


def test_the_outer_step_on_engine_weights_matches_the_host():
    check_outer_step_matches_the_host("cpu")


def test_a_snapshot_of_engine_state_round_trips_bit_equal():
    check_snapshot_round_trip("cpu")


def test_bf16_activations_give_gradients_close_to_the_fp32_path():
    """A stage pair exchanging bfloat16 activations and gradients: the first stage's gradients are
    those of the fp32 path to bf16's precision (8 bits of mantissa on each crossing)."""
    grads = {}
    for dtype in ("float32", "bfloat16"):
        config = TrainConfig(accumulate=2, activation_dtype=dtype)  # no step: the gradients stay to compare
        first, last = StageEngine(SPEC, 0, config), StageEngine(SPEC, 1, config)
        ids, targets = batch(6, rows=4, seq=32)
        wire_f = to_wire(first.compute(Work("forward", (b"s", 1), ids, targets)).forward)
        hidden = from_wire(*to_wire(first.host_out(first.compute(Work("forward", (b"s", 2), ids, targets)).forward)))
        assert hidden.dtype == getattr(torch, dtype) and wire_f[0] == "float32"  # (to_wire: as the tensor is)
        back = last.compute(Work("forward", (b"s", 2), hidden, targets)).backward
        first.compute(Work("backward", (b"s", 2), from_wire(*to_wire(last.host_out(back))), None))
        grads[dtype] = torch.cat([p.grad.reshape(-1) for p in first.params.values()])
    exact, coarse = grads["float32"], grads["bfloat16"]
    assert not torch.equal(exact, coarse)  # the bf16 path did round
    assert float((coarse - exact).norm() / exact.norm()) < 0.02
    assert float(torch.nn.functional.cosine_similarity(coarse, exact, dim=0)) > 0.999


def test_an_engine_refuses_an_activation_dtype_the_wire_cannot_carry():
    from p2pswarm.errors import ConfigError
    with pytest.raises(ConfigError):
        StageEngine(SPEC, 0, TrainConfig(activation_dtype="int8"))


def test_cpu_staging_casts_and_copies_nothing_else():
    staging = Staging("cpu")
    x = torch.randn(2, 3)
    assert staging.to_host(x, torch.float32).data_ptr() == x.data_ptr()  # nothing to stage on the host
    assert staging.to_host(x, torch.bfloat16).dtype == torch.bfloat16
    back = staging.to_device(x.to(torch.bfloat16), torch.float32)
    assert back.dtype == torch.float32 and torch.allclose(back, x, rtol=1e-2)


def test_evaluation_runs_on_the_agreed_weights_of_the_round_asked_for():
    """Two replicas whose live weights drifted apart give bit-equal held-out losses on the agreed weights
    of the same outer round; a round not kept falls back to the newest one, and is said so."""
    from p2pswarm.diloco.outer import flatten
    from p2pswarm.swarm.activation import NO_ROUND

    a, b = StageEngine(WHOLE, 0), StageEngine(WHOLE, 0)
    ids, targets = batch(7, rows=2, seq=16)
    probe = Work("eval", (b"k", 0), ids, targets, 0)
    assert a.compute(probe).round == NO_ROUND  # nothing agreed yet: the live weights
    a.agree(0, flatten(a.params).clone())
    b.agree(0, flatten(b.params).clone())
    for i in range(3):  # b trains on its own: its live weights are no longer a's
        b.compute(Work("forward", (b"t", i), *batch(100 + i)))
    live = b.compute(Work("eval", (b"k", 1), ids, targets, NO_ROUND))
    on_a, on_b = a.compute(probe), b.compute(probe)
    assert on_a.round == on_b.round == 0 and on_a.loss_nats == on_b.loss_nats != live.loss_nats
    last = engine_module.AGREED_MAX  # a small stage keeps AGREED_MAX rounds (0 to 15): at round 16, 0 is gone
    for round_ in range(1, last):
        b.agree(round_, flatten(b.params).clone())
    assert b.agreed_round == last - 1 and b.compute(probe).round == 0  # still held, AGREED_MAX - 1 rounds behind
    b.agree(last, flatten(b.params).clone())
    again = b.compute(probe)
    assert again.round == last and again.loss_nats == live.loss_nats  # the latest round's weights are b's live ones
    downstream = b.compute(Work("eval", (b"k", 2), ids, targets, 9, (1,)))  # stage 0 asked for round 1
    assert downstream.round == 1


def test_a_forward_whose_gradient_lands_late_runs_on_the_predicted_weights():
    """With micro-batches waiting for their gradients, a new forward's weights are the live ones moved
    ``ahead`` AdamW steps along the current update direction; with none waiting, the live ones."""
    first = StageEngine(SPEC, 0)
    ids, targets = batch(3)
    first.compute(Work("forward", (b"a", 0), ids, targets))
    first.compute(Work("backward", (b"a", 0), torch.ones(2, 16, SPEC.width), None))  # one step: Adam has state
    assert first.step == 1
    version = first.versions.current(first.kept)
    assert all(torch.equal(version[n], p) for n, p in first.params.items())  # nothing waits: no prediction
    first.compute(Work("forward", (b"a", 1), ids, targets))  # one graph kept: the next version looks 1 step ahead
    first.weights_changed()
    predicted = first.versions.current(first.kept)
    name, p = next(iter(first.params.items()))
    state = first.optimizer.state[p]
    beta1, beta2 = first.config.betas
    direction = (state["exp_avg"] / (1 - beta1)) / ((state["exp_avg_sq"] / (1 - beta2)).sqrt() + first.config.eps)
    lr = first.optimizer.param_groups[0]["lr"]
    assert torch.allclose(predicted[name], p - lr * direction, atol=1e-7) and not torch.equal(predicted[name], p)
    off = StageEngine(SPEC, 0, TrainConfig(predict_weights=False))
    off.compute(Work("forward", (b"a", 0), ids, targets))
    off.compute(Work("backward", (b"a", 0), torch.ones(2, 16, SPEC.width), None))
    off.compute(Work("forward", (b"a", 1), ids, targets))
    off.weights_changed()
    assert all(torch.equal(off.versions.current(off.kept)[n], q) for n, q in off.params.items())

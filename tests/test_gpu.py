"""The engine on a CUDA device: bf16 training, DiLoCo's outer step, snapshots (``-m gpu``).

Every test here is marked ``gpu`` and skips, saying why, where torch sees no CUDA device (CI is
CPU only: DEVELOPERS.md says how to run them on a GPU machine). The checks themselves take the
device as an argument: ``tests/test_engine.py`` runs the same ones on the CPU, so the code paths
that move tensors between host and device run in every CI build too.
"""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")

from p2pswarm.diloco import checkpoint  # noqa: E402
from p2pswarm.diloco.outer import OuterOptimizer, flatten  # noqa: E402
from p2pswarm.model.catalog import get_model  # noqa: E402
from p2pswarm.run.placement import Placement  # noqa: E402
from p2pswarm.run.training import TrainConfig  # noqa: E402
from p2pswarm.swarm.codec import from_wire, to_wire  # noqa: E402
from p2pswarm.swarm.engine import StageEngine, Work  # noqa: E402

pytestmark = pytest.mark.gpu

SPEC = get_model("tiny-lm/2")
GPU_STEPS = 50  # steps of the bf16 training check on a GPU: the loss has clearly fallen by then


def cuda() -> str:
    """The CUDA device to test on, or a skip that says why there is none."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA: torch.cuda.is_available() is False on this machine (run with -m gpu on a GPU)")
    return "cuda:0"


def batch(seed: int, rows: int = 4, seq: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (rows, seq + 1), generator=g)
    return ids[:, :-1], ids[:, 1:].contiguous()


def engines(placement: Placement, config: TrainConfig = TrainConfig()) -> tuple[StageEngine, StageEngine]:
    return StageEngine(SPEC, 0, config, placement), StageEngine(SPEC, 1, config, placement)


def train_through_the_wire(first: StageEngine, last: StageEngine, key, ids, targets) -> float:
    """One micro-batch through a two-stage chain, activations and gradients as wire bytes; its loss."""
    hidden = from_wire(*to_wire(first.host_out(first.compute(Work("forward", key, ids, targets)).forward)))
    out = last.compute(Work("forward", key, hidden, targets))
    first.compute(Work("backward", key, from_wire(*to_wire(last.host_out(out.backward))), None))
    return out.loss_nats / out.tokens


# --- the checks (a device in, assertions out) --------------------------------------------------------


def check_training_lowers_the_loss(placement: Placement, steps: int, wire_dtype: str, rows: int = 4,
                                   seq: int = 32) -> None:
    first, last = engines(placement, TrainConfig(activation_dtype=wire_dtype))
    assert first.params["embed_tokens.weight"].dtype == torch.float32  # fp32 master weights ...
    ids, targets = batch(3, rows, seq)
    losses = [train_through_the_wire(first, last, (b"s", i), ids, targets) for i in range(steps)]
    state = first.optimizer.state[first.params["embed_tokens.weight"]]
    assert state["exp_avg"].dtype == torch.float32 and state["exp_avg"].device == first.device  # ... and states
    k = max(2, steps // 5)
    assert sum(losses[-k:]) / k < sum(losses[:k]) / k - 0.5, losses


def check_outer_step_matches_the_host(device: str) -> None:
    """The outer step on an engine's device weights equals the same step on host copies."""
    engine = StageEngine(SPEC, 1, TrainConfig(), Placement(device))
    host = {n: p.detach().to("cpu", copy=True) for n, p in engine.params.items()}
    outer, host_outer = OuterOptimizer(engine.params), OuterOptimizer(host)
    assert outer.start.device.type == "cpu" and outer.momentum.device.type == "cpu"
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in engine.params.items():  # the inner phase moved every weight a little
            delta = 1e-3 * torch.randn(p.shape, generator=g)
            p.add_(delta.to(p.device))
            host[name].add_(delta)
    at, host_at = flatten(engine.params), flatten(host)
    assert at.device.type == "cpu" and torch.equal(at, host_at)
    aggregated = 0.5 * outer.pseudo_gradient(at)  # a group's mean, as it comes back
    outer.outer_step(aggregated, at, engine.params, step=10)
    host_outer.outer_step(aggregated, host_at, host, step=10)
    assert torch.equal(outer.start, host_outer.start) and torch.equal(outer.momentum, host_outer.momentum)
    for name, p in engine.params.items():
        assert p.device == engine.device
        assert torch.allclose(p.detach().cpu(), host[name], rtol=0, atol=1e-6), name


def check_snapshot_round_trip(device: str) -> None:
    """device -> host copy -> snapshot bytes -> another engine on the device: bit-equal."""
    placement = Placement(device)
    first, last = engines(placement)
    for i in range(3):  # optimizer states that are not zeros
        train_through_the_wire(first, last, (b"s", i), *batch(i))
    host = last.host_state_dict()
    for tensor in _tensors(host):
        assert tensor.device.type == "cpu"
    host["module"]["norm.weight"].add_(1.0)  # a copy: the engine's weights are untouched
    assert not torch.equal(host["module"]["norm.weight"], last.params["norm.weight"].detach().cpu())
    data = checkpoint.encode_state(last.host_state_dict())
    other = StageEngine(SPEC, 1, TrainConfig(seed=7), placement)
    other.load_state_dict(checkpoint.decode_state(data))
    assert other.step == last.step == 3
    for name, p in last.params.items():
        q = other.params[name]
        assert q.device == other.device and torch.equal(q, p), name
        mine, theirs = last.optimizer.state[p], other.optimizer.state[q]
        for key in ("exp_avg", "exp_avg_sq"):
            assert theirs[key].device == other.device and torch.equal(theirs[key], mine[key]), (name, key)
        assert torch.equal(theirs["step"].cpu(), mine["step"].cpu())


def _tensors(node):
    if isinstance(node, torch.Tensor):
        yield node
    elif isinstance(node, dict):
        for value in node.values():
            yield from _tensors(value)
    elif isinstance(node, (list, tuple)):
        for value in node:
            yield from _tensors(value)


# --- on a GPU --------------------------------------------------------------------------------------


def test_bf16_training_on_cuda_lowers_the_loss():
    placement = Placement(cuda(), "bf16")
    check_training_lowers_the_loss(placement, GPU_STEPS, "bfloat16")


def test_the_outer_step_on_cuda_weights_matches_the_host():
    check_outer_step_matches_the_host(cuda())


def test_a_snapshot_of_cuda_weights_round_trips_bit_equal():
    check_snapshot_round_trip(cuda())


def test_bf16_activations_cross_the_wire_from_pinned_buffers():
    device = cuda()
    first = StageEngine(SPEC, 0, TrainConfig(activation_dtype="bfloat16"), Placement(device, "bf16"))
    hidden = torch.randn(2, 8, SPEC.width, device=device)
    for _ in range(2):  # the second time through reuses the pinned buffer
        dtype, shape, data = to_wire(first.host_out(hidden))
        assert (dtype, shape) == ("bfloat16", (2, 8, SPEC.width))
        assert torch.equal(from_wire(dtype, shape, data), hidden.to(torch.bfloat16).cpu())
    last = StageEngine(SPEC, 1, dataclasses.replace(TrainConfig(), activation_dtype="bfloat16"),
                       Placement(device, "bf16"))
    received = from_wire(dtype, shape, data)
    on_device = last._input(received)
    assert on_device.device == last.device and on_device.dtype == torch.float32
    assert torch.equal(on_device.cpu(), received.float())

"""Devices and precision: the flags, the compute thread, GPU-aware records and stage choice.

``--device``/``--precision`` resolve against what a machine has (an ``Accelerators`` value, so
that a GPU machine is described here without one); the engine's compute thread runs every job on
one thread, in order, and survives its callers being cancelled; a peer on an accelerator says so
in its record, and ``--layers auto`` weighs stages by the throughput their replicas announce.
"""

from __future__ import annotations

import random
import threading

import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from p2pswarm.cli import build_parser, config_from_args, main
from p2pswarm.errors import ConfigError, LocalProtocolError
from p2pswarm.model.catalog import get_model, least_served_stage
from p2pswarm.run.placement import Accelerators, Placement, choose_placement, resolve_placement
from p2pswarm.swarm.compute_thread import ComputeThread, open_compute_thread

BOOTSTRAP = "/ip4/127.0.0.1/tcp/4001/p2p/12D3KooWQYhTNQdmr3ArTeUHRYzFg94BKyTkoWBDWez9kSCVe2Xo"
GPU_BOX = Accelerators(cuda_devices=2)
MAC = Accelerators(mps=True)
CPU_BOX = Accelerators()

# --- the flags ----------------------------------------------------------------------------------


@pytest.mark.parametrize("device, precision, found, expected", [
    ("auto", "auto", GPU_BOX, Placement("cuda:0", "bf16")),
    ("auto", "auto", MAC, Placement("mps", "fp32")),
    ("auto", "auto", CPU_BOX, Placement("cpu", "fp32")),
    ("cuda", "fp32", GPU_BOX, Placement("cuda:0", "fp32")),
    ("CUDA:1", "auto", GPU_BOX, Placement("cuda:1", "bf16")),
    ("cpu", "auto", GPU_BOX, Placement("cpu", "fp32")),  # the CPU on a GPU machine: fp32
    ("cpu", "bf16", CPU_BOX, Placement("cpu", "bf16")),  # bf16 autocast on the CPU is allowed
])
def test_the_flags_resolve_to_a_placement(device, precision, found, expected):
    assert resolve_placement(device, precision, found) == expected


@pytest.mark.parametrize("device, precision, found, words", [
    ("cuda", "auto", CPU_BOX, "no CUDA device"),
    ("cuda:2", "auto", GPU_BOX, "2 CUDA device(s)"),
    ("mps", "auto", CPU_BOX, "no mps device"),
    ("tpu", "auto", GPU_BOX, "--device must be one of"),
    ("cuda:x", "auto", GPU_BOX, "--device must be one of"),
    ("auto", "int8", GPU_BOX, "--precision must be one of"),
    ("auto", "fp16", GPU_BOX, "fp16 is not supported"),
    ("cpu", "fp16", CPU_BOX, "fp16 is not supported"),
    ("mps", "bf16", MAC, "not supported on mps"),
])
def test_bad_flags_are_one_line_config_errors(device, precision, found, words):
    with pytest.raises(ConfigError, match=None) as info:
        resolve_placement(device, precision, found)
    assert words in str(info.value) and "\n" not in str(info.value)


@given(cuda=st.integers(0, 4), mps=st.booleans(), device=st.sampled_from(["auto", "cpu", "cuda", "cuda:0", "cuda:3",
                                                                         "mps"]),
       precision=st.sampled_from(["auto", "fp32", "bf16", "fp16"]))
def test_a_placement_is_always_one_the_machine_can_run(cuda, mps, device, precision):
    found = Accelerators(cuda, mps)
    try:
        placement = choose_placement(device, precision, found)
    except ConfigError:
        return
    kind = placement.device_type
    assert placement.precision in ("fp32", "bf16")
    assert kind == "cpu" or (kind == "mps" and mps) or (kind == "cuda" and int(placement.device[5:]) < cuda)
    assert placement.accelerator == (kind != "cpu")
    if precision == "auto":  # bf16 exactly where CUDA is used
        assert (placement.precision == "bf16") == (kind == "cuda")


def test_join_takes_the_flags_into_its_config():
    args = build_parser().parse_args(["join", "--bootstrap", BOOTSTRAP, "--device", "cpu", "--precision", "bf16"])
    config = config_from_args(args)
    assert config.training.placement == Placement("cpu", "bf16")


def test_join_refuses_a_cuda_device_this_machine_lacks(capsys):
    torch = pytest.importorskip("torch")
    if torch.cuda.device_count() > 7:
        pytest.skip("this machine has a cuda:7")
    assert main(["join", "--bootstrap", BOOTSTRAP, "--device", "cuda:7"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("p2pswarm: error: --device cuda:7") and "\n" not in err


def test_join_refuses_fp16_in_one_line(capsys):
    assert main(["join", "--bootstrap", BOOTSTRAP, "--device", "cpu", "--precision", "fp16"]) == 1
    err = capsys.readouterr().err.strip()
    assert "fp16" in err and "\n" not in err


# --- the compute thread ---------------------------------------------------------------------------


def test_every_job_runs_on_the_same_thread_in_order():
    async def main_():
        seen = []
        async with open_compute_thread("t") as thread:
            for i in range(5):
                assert await thread.run(lambda i=i: seen.append((i, threading.get_ident())) or i * i) == i * i
            async with trio.open_nursery() as nursery:  # submitted concurrently: still one at a time, in order
                for i in range(5, 10):
                    nursery.start_soon(thread.run, lambda i=i: seen.append((i, threading.get_ident())))
                    await trio.sleep(0)
        assert {ident for _, ident in seen} == {thread.ident} and thread.ident != threading.get_ident()
        assert [i for i, _ in seen] == list(range(10))
    trio.run(main_)


def test_an_exception_is_raised_to_the_caller_and_the_thread_goes_on():
    async def main_():
        async with open_compute_thread() as thread:
            with pytest.raises(ZeroDivisionError):
                await thread.run(lambda: 1 / 0)
            assert await thread.run(lambda: 7) == 7
    trio.run(main_)


def test_a_cancelled_caller_leaves_its_job_to_finish_before_the_next():
    async def main_():
        release, log = threading.Event(), []

        def slow():
            release.wait()
            log.append("slow")
            return "dropped"

        async with open_compute_thread() as thread:
            with trio.move_on_after(0.01) as scope:  # (the job blocks until released: the cancel comes first)
                await thread.run(slow)
            assert scope.cancelled_caught
            release.set()
            assert await thread.run(lambda: log.append("next") or "kept") == "kept"
        assert log == ["slow", "next"]
    trio.run(main_)


def test_a_thread_not_started_or_stopped_refuses_jobs():
    async def main_():
        thread = ComputeThread()
        with pytest.raises(LocalProtocolError):
            await thread.run(lambda: 1)
        thread.start()
        with pytest.raises(LocalProtocolError):
            thread.start()
        thread.stop()
        await trio.to_thread.run_sync(thread._thread.join)
        with pytest.raises(LocalProtocolError):
            await thread.run(lambda: 1)
    trio.run(main_)


# --- records and the stage choice -------------------------------------------------------------------

MODEL = get_model("tiny-lm/8")
THROUGHPUT = st.one_of(st.just(0.0), st.floats(1.0, 1e6))


@given(st.dictionaries(st.integers(0, MODEL.n_stages - 1), st.lists(st.just(0.0), max_size=4)), st.integers(0, 99))
def test_with_no_throughput_known_the_choice_is_the_replica_count_rule(throughputs, seed):
    counts = {s: len(v) for s, v in throughputs.items()}
    by_count = least_served_stage(MODEL, counts, random.Random(seed))
    assert least_served_stage(MODEL, counts, random.Random(seed), throughputs) == by_count


@given(st.dictionaries(st.integers(0, MODEL.n_stages - 1), st.lists(THROUGHPUT, max_size=4)), st.integers(0, 99))
def test_the_chosen_stage_has_the_least_served_throughput(throughputs, seed):
    counts = {s: len(v) for s, v in throughputs.items()}
    chosen = least_served_stage(MODEL, counts, random.Random(seed), throughputs)
    known = [t for v in throughputs.values() for t in v if t > 0]
    if not known:
        assert counts.get(chosen, 0) == min(counts.get(s, 0) for s in range(MODEL.n_stages))
        return
    nominal = sum(known) / len(known)
    served = [sum(t or nominal for t in throughputs.get(s, ())) for s in range(MODEL.n_stages)]
    assert served[chosen] == min(served)
    if any(not throughputs.get(s) for s in range(MODEL.n_stages)):
        assert not throughputs.get(chosen)  # a stage nobody serves always comes first


def test_one_fast_replica_serves_a_stage_as_much_as_several_slow_ones():
    model = get_model("tiny-lm/2")
    throughputs = {0: [9000.0], 1: [1000.0, 1000.0, 1000.0]}  # a GPU on stage 0, three CPUs on stage 1
    counts = {0: 1, 1: 3}
    assert least_served_stage(model, counts, random.Random(0)) == 0  # by count
    assert least_served_stage(model, counts, random.Random(0), throughputs) == 1  # by throughput


def test_a_peer_on_an_accelerator_announces_it():
    from p2pswarm.dht.records import FLAG_GPU
    from p2pswarm.identity import generate_identity
    from p2pswarm.node.config import NodeConfig, Role
    from p2pswarm.node.running import NodeState
    from p2pswarm.run.spec import default_run
    from p2pswarm.run.training import Training

    def capacity(device):
        config = NodeConfig(role=Role.JOIN, training=Training.of(default_run(), placement=Placement(device)))
        return NodeState(identity=generate_identity(), config=config, model=get_model("tiny-lm/2")).capacity()

    on_cpu, on_gpu = capacity("cpu"), capacity("cuda:0")
    assert not on_cpu.flags & FLAG_GPU and on_cpu.free_memory_mb > 0  # host memory
    assert on_gpu.flags & FLAG_GPU  # and the device's free memory (0 here: no CUDA on this machine)


# --- the wire dtype ------------------------------------------------------------------------------


def test_a_peer_takes_activations_in_its_runs_dtype_only():
    pytest.importorskip("torch")
    from p2pswarm.errors import RemoteProtocolError
    from p2pswarm.run.training import TrainConfig
    from p2pswarm.swarm.activation import SESSION_BYTES, Ack, Forward
    from p2pswarm.swarm.buffers import Priority
    from p2pswarm.swarm.service import SwarmService

    spec, rows, seq = get_model("tiny-lm/2"), 2, 8

    def frame(dtype: str, size: int, micro_batch: int):
        shape = (rows, seq, spec.width)
        message = Forward(b"s" * SESSION_BYTES, micro_batch, 1, int(Priority.TRAINING_FORWARD), 0, dtype, shape,
                          rows * seq)
        return message, b"\0" * (rows * seq * spec.width * size + rows * seq)

    async def main_():
        svc = SwarmService(spec=spec, stage=1, me="me", pool=None, stage_map=None, host=None,
                           config=TrainConfig(activation_dtype="bfloat16"))
        assert await svc._on_frame("up", *frame("bfloat16", 2, 0)) == Ack(0, 1)
        with pytest.raises(RemoteProtocolError, match="bfloat16 micro-batch"):
            await svc._on_frame("other", *frame("float32", 4, 1))
    trio.run(main_)

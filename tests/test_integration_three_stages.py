"""A middle stage relays activations forward and gradients back: 3 stages of real processes on loopback.

``tiny-lm/3`` cuts the 8 blocks into stages [0, 3), [3, 6) and [6, 8); a bootstrap node and one
``p2pswarm join`` per stage replica run as their own processes, with the demo's DiLoCo values and
micro-batches of ``TEST_ROWS`` rows (``tests.procs.small_batch_run``).

- 3 stages x 1 replica: stage 0 completes micro-batches end to end, which it can only do once the
  middle stage forwarded their activations and relayed their gradients back; the counts of the
  three stages chain (each micro-batch computed once per stage); the last stage measures a
  held-out round, and its training loss falls.
- 3 stages with 2 middle replicas, one SIGKILLed while training: stage 0 keeps completing
  micro-batches through the other; those that were on the dead path are given up (a bounded
  number), and every other process lives on.

The counts come from each peer's ``/api/swarm``. Where two stages' counts are compared, the one
that must be the smaller is read first: counts only grow, so the comparison holds however much
happened between the two reads.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from p2pswarm.demo import DEMO_GATHER_S, DEMO_INNER_STEPS, DEMO_OUTER_LR, DEMO_OUTER_MOMENTUM
from p2pswarm.model.catalog import get_model
from p2pswarm.run.tunables import MIN_IN_FLIGHT
from tests.procs import Swarm, get_json, small_batch_run, wait_until

pytest.importorskip("torch")
pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

MODEL = get_model("tiny-lm/3")  # 3 + 3 + 2 blocks: stage 1 is a middle stage
GATHER = ("--gather", str(DEMO_GATHER_S))  # as `p2pswarm demo`, like the run's DiLoCo values
DONE = 20  # micro-batches stage 0 completes end to end before the counts are compared
BEFORE_KILL = 10  # micro-batches stage 0 completes before a middle replica is SIGKILLed: training is under way
MORE_AFTER_KILL = 20  # micro-batches stage 0 must complete after the SIGKILL
UNTRAINED_BPB = 8.0  # bits/byte of a model that knows nothing of bytes: log2(256)
API_DEADLINE = 30.0  # seconds for a peer's API to answer: its loop shares 2 cores with the others
START_DEADLINE = 180.0  # guards against a hang only: seconds to start, find each other and train a first step
TRAIN_DEADLINE = 180.0  # guards against a hang only: tens of micro-batches take seconds on an idle machine
MAX_IN_FLIGHT = max(MIN_IN_FLIGHT, 3)  # stage 0's bound with 3 stages: one micro-batch per stage
LOST_AT_KILL = 2 * MAX_IN_FLIGHT  # all stage 0 had in flight at the kill, and as many again overdue on a loaded machine


def swarm_doc(api: str) -> dict:
    """The peer's ``/api/swarm``, for a comparison: a busy peer may miss one request's timeout, so it is
    asked again until it answers."""
    doc = wait_until(lambda: get_json(api, "/api/swarm"), API_DEADLINE)
    assert doc, f"{api} did not answer /api/swarm"
    return doc


def peek(api: str) -> dict:
    """The peer's ``/api/swarm`` while polling: no answer (yet) is an empty document."""
    return get_json(api, "/api/swarm") or {}


def count(doc: dict, name: str) -> int:
    return doc.get("counts", {}).get(name, 0)


def layers(stage: int) -> str:
    start, end = MODEL.stage_range(stage)
    return f"{start}:{end}"


def start_swarm(swarm: Swarm, replicas: list[int]) -> list[list[tuple]]:
    """A bootstrap and ``replicas[s]`` joins of each stage s: per stage, its (process, api) pairs.
    Nothing waits for the stage map here: on a loaded machine a record may lapse for a moment and
    come back, and what matters is that training flows, which every test waits for."""
    boot = swarm.bootstrap()
    run = small_batch_run(swarm.workdir, MODEL.name, DEMO_INNER_STEPS, DEMO_OUTER_LR, DEMO_OUTER_MOMENTUM)
    return [[swarm.join(boot, layers(s), f"s{s}r{r}", *run, *GATHER) for r in range(n)]
            for s, n in enumerate(replicas)]


def wait_for(swarm: Swarm, what, deadline: float, *, about: str, killed=()):
    """Until ``what()`` is truthy (its value) while every process but ``killed`` lives; a failure
    shows ``about``'s swarm and stage documents."""
    def check():
        assert_alive(swarm, killed)
        return what()
    result = wait_until(check, deadline)
    assert result, (get_json(about, "/api/swarm"), get_json(about, "/api/stages"))
    return result


def assert_alive(swarm: Swarm, killed=()) -> None:
    exited = [(p.args, p.returncode) for p in swarm.processes if p not in killed and p.poll() is not None]
    assert not exited, (exited, tails(swarm))


def tails(swarm: Swarm) -> dict:
    return {log.name: log.read_text(errors="replace")[-2000:] for log in swarm.workdir.glob("*.log")}


def assert_no_traceback(swarm: Swarm) -> None:
    for log in swarm.workdir.glob("*.log"):
        text = log.read_text(errors="replace")
        assert "Traceback" not in text, (log.name, text[-3000:])


def wait_done(swarm: Swarm, api: str, target: int, killed=()) -> None:
    """Until stage 0 (``api``) completed ``target`` micro-batches end to end; every process must live."""
    wait_for(swarm, lambda: count(peek(api), "micro_batches_done") >= target, TRAIN_DEADLINE, about=api,
             killed=killed)


@pytest.fixture
def swarm(tmp_path):
    swarm = Swarm(tmp_path)
    yield swarm
    swarm.close()


def test_a_middle_stage_relays_activations_and_gradients(swarm):
    began = time.monotonic()
    first, middle, last = [api for [(_, api)] in start_swarm(swarm, [1, 1, 1])]
    first_loss = wait_for(swarm, lambda: peek(last).get("train_loss_bpb"), START_DEADLINE, about=first)
    trained_at = time.monotonic()
    wait_done(swarm, first, DONE)
    heldout = wait_for(swarm, lambda: peek(last).get("heldout"), TRAIN_DEADLINE, about=last)  # a whole round

    # Gradients, upstream first: a micro-batch completes at stage 0 only with a gradient the middle
    # relayed, which the middle computed only from a gradient of the last stage's loss.
    done = count(swarm_doc(first), "micro_batches_done")
    passed = count(swarm_doc(middle), "gradients_passed")
    trained_last = count(swarm_doc(last), "forwards_trained")
    assert DONE <= done <= passed <= trained_last, (done, passed, trained_last)
    # Forwards, downstream first: no stage computed more micro-batches than the stage before it cut or
    # computed (a re-sent copy is dropped as a duplicate, never computed twice). Every micro-batch
    # stage 0 cut is done, given up, or still in flight.
    trained_last = count(swarm_doc(last), "forwards_trained")
    middle_doc = swarm_doc(middle)
    trained_middle = count(middle_doc, "forwards_trained")
    first_doc = swarm_doc(first)
    cut = count(first_doc, "micro_batches_done") + count(first_doc, "given_up") + first_doc["in_flight"]
    assert count(middle_doc, "gradients_passed") <= trained_middle
    assert trained_last <= trained_middle <= cut, (trained_last, trained_middle, cut)
    duplicates = [count(swarm_doc(api), "duplicates_dropped") for api in (first, middle, last)]
    print(f"3 stages: first loss {trained_at - began:.1f} s after the start, {done} done "
          f"{time.monotonic() - trained_at:.1f} s later; stage 0 done {done}, middle passed {passed} gradients "
          f"of {trained_middle} forwards, last trained {trained_last}, stage 0 cut {cut}; duplicates dropped "
          f"per stage {duplicates}; held-out {[(r['round'], r['bpb']) for r in heldout]}")

    def learned():
        loss = peek(last).get("train_loss_bpb")
        return loss is not None and loss < min(first_loss, UNTRAINED_BPB) and loss
    final_loss = wait_for(swarm, learned, TRAIN_DEADLINE, about=last)
    print(f"train loss at the last stage: {first_loss:.3f} -> {final_loss:.3f} bits/byte")
    assert_alive(swarm)
    assert_no_traceback(swarm)


def test_training_goes_on_through_the_surviving_middle_replica(swarm):
    began = time.monotonic()
    [(_, first)], middles, [(_, last)] = start_swarm(swarm, [1, 2, 1])
    wait_for(swarm, lambda: any(count(peek(api), "gradients_passed") > 0 for _, api in middles), START_DEADLINE,
             about=first)  # a middle replica carries training both ways (stage 0's few micro-batches in flight
    # may all go to the best one: the other is then the spare that must take over)
    passed = [count(peek(api), "gradients_passed") for _, api in middles]
    (victim, _), (_, survivor) = middles if passed[0] >= passed[1] else middles[::-1]
    wait_done(swarm, first, BEFORE_KILL)

    given_up_before, lost_before = count(swarm_doc(first), "given_up"), count(swarm_doc(last), "lost_backward")
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait()
    at_kill = count(swarm_doc(first), "micro_batches_done")
    through_survivor = count(swarm_doc(survivor), "gradients_passed")
    killed_at = time.monotonic()
    wait_done(swarm, first, at_kill + MORE_AFTER_KILL, killed=[victim])

    # Of stage 0's completions since the kill, at most MAX_IN_FLIGHT (all it had on its way then)
    # can have come from the victim: the others' gradients were relayed by the survivor.
    relayed = count(swarm_doc(survivor), "gradients_passed") - through_survivor
    assert relayed >= MORE_AFTER_KILL - MAX_IN_FLIGHT, (relayed, swarm_doc(survivor))
    first_doc, last_doc = swarm_doc(first), swarm_doc(last)
    given_up = count(first_doc, "given_up") - given_up_before
    lost_backward = count(last_doc, "lost_backward") - lost_before
    delivery = first_doc["delivery"]
    print(f"middle replica SIGKILLed {killed_at - began:.1f} s after the start, at stage 0's {at_kill} "
          f"micro-batches: {MORE_AFTER_KILL} more within {time.monotonic() - killed_at:.1f} s, {relayed} gradients "
          f"relayed by the survivor; stage 0 gave up {given_up}, rerouted {delivery['rerouted']}, lost "
          f"{delivery['lost']} (failover ms p50/p99 {delivery['failover_ms_p50']}/{delivery['failover_ms_p99']}); "
          f"the last stage lost {lost_backward} gradients")
    assert given_up <= LOST_AT_KILL, first_doc  # only what was on the dead path: no stalled swarm
    assert lost_backward <= LOST_AT_KILL, last_doc  # gradients of micro-batches the victim had forwarded
    assert_alive(swarm, killed=[victim])
    assert_no_traceback(swarm)

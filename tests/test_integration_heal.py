"""A swarm heals itself: both replicas of the middle stage SIGKILLed, a peer of another stage moves in,
loads the stage's backup, and training resumes. Real processes on loopback.

``tiny-lm/3`` with 2 replicas per stage, each started on its stage (``--layers``, a deterministic
start) with ``--rebalance``, and the demo's DiLoCo values but H = 10. Once outer round 1 is agreed
everywhere and peers of other stages hold a backup of stage 1, both stage-1 replicas are
SIGKILLed. Then: a peer moves to stage 1 and loads the backup (its ``/api/diloco`` ``loaded_from``
names the holder), stage 0 completes micro-batches again, the last stage's loss on the text after
the recovery is no worse than before the loss, no process crashed or logged a traceback, and no
other move follows during a settle window.

The loss compared is the last stage's training loss (an EMA over ~20 micro-batches): the corpus is
streamed once, so each micro-batch is text the model has not seen, a held-out figure in effect.
The held-out rounds themselves are too rare for a short test on a loaded machine: a round that
takes t seconds waits 9 t before the next (``run.tunables.EVAL_SHARE``), minutes here. Every
deadline is a guard against a hang only; the recovery time is printed, never asserted (bench/heal.py
measures it).
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from p2pswarm.demo import DEMO_GATHER_S, DEMO_OUTER_LR, DEMO_OUTER_MOMENTUM
from tests.procs import Swarm, get_json, wait_until
from tests.test_integration_three_stages import MODEL, assert_no_traceback, count, layers, peek, wait_for

pytest.importorskip("torch")
pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

REPLICAS = 2  # per stage: the scenario
INNER_STEPS = 10  # a quarter of the demo's H: round 1, and so the first backups, come four times as soon
AGREED = ("--model", MODEL.name, "--inner-steps", str(INNER_STEPS), "--outer-momentum", str(DEMO_OUTER_MOMENTUM),
          "--outer-lr", str(DEMO_OUTER_LR), "--gather", str(DEMO_GATHER_S))
START_DEADLINE = 420.0  # guard only: 7 processes start on 2 shared cores, train, agree round 1, back stage 1 up
HEAL_DEADLINE = 240.0  # guard only: records expire (15 s), the down grace (5 s), the move, the load, training
LOSS_DEADLINE = 240.0  # guard only: the last stage trains LOSS_WINDOW micro-batches after the recovery
MORE_AFTER_HEAL = 10  # micro-batches stage 0 completes after the loss: training flows again
LOSS_WINDOW = 40  # micro-batches the last stage trains after the recovery: twice the loss EMA's horizon
LOSS_NOISE = 0.15  # bits/byte: the spread of the loss EMA between replicas and moments on tiny-lm
API_DEADLINE = 30.0  # seconds for a busy peer's API to answer
SETTLE_S = 30.0  # seconds watched from the recovery on (the loss window runs in it): six move checks, none may move


@pytest.fixture
def swarm(tmp_path):
    swarm = Swarm(tmp_path)
    yield swarm
    swarm.close()


def api_doc(api: str, path: str) -> dict:
    return get_json(api, path) or {}


def held_backup_rounds(apis: list[str], stage: int) -> list[int]:
    """The rounds of ``stage``'s backups held by the peers behind ``apis``."""
    return [h["round"] for api in apis for h in api_doc(api, "/api/backups").get("held", []) if h["stage"] == stage]


def last_stage_loss(apis: list[str]) -> tuple[float, int] | None:
    """The last stage's training loss (mean of its replicas' EMAs) and the micro-batches it trained."""
    docs = [api_doc(api, "/api/swarm") for api in apis]
    if not all(doc.get("train_loss_bpb") is not None for doc in docs):
        return None
    return sum(doc["train_loss_bpb"] for doc in docs) / len(docs), sum(count(doc, "forwards_trained") for doc in docs)


def moves_done(api: str) -> int | None:
    """Moves the peer behind ``api`` made (None: it did not answer this time)."""
    stats = get_json(api, "/api/stats")
    return None if stats is None else stats["rebalance"]["moves"]


def test_a_peer_moves_into_a_dead_stage_and_loads_its_backup(swarm):
    boot = swarm.bootstrap()
    peers = [[swarm.join(boot, layers(s), f"s{s}r{r}", *AGREED, "--rebalance") for r in range(REPLICAS)]
             for s in range(3)]
    apis = [api for stage in peers for _, api in stage]
    first, last, others = [api for _, api in peers[0]], [api for _, api in peers[2]], [*peers[0], *peers[2]]
    others_apis = [api for _, api in others]

    began = time.monotonic()
    wait_for(swarm, lambda: all(api_doc(api, "/api/diloco").get("outer_round", 0) >= 1 for api in apis),
             START_DEADLINE, about=first[0])
    wait_for(swarm, lambda: any(r >= 1 for r in held_backup_rounds(others_apis, 1)), START_DEADLINE, about=first[0])
    before = wait_for(swarm, lambda: last_stage_loss(last), START_DEADLINE, about=last[0])
    print(f"round 1 agreed and stage 1 backed up {time.monotonic() - began:.1f} s after the start; "
          f"last stage's loss before the loss of stage 1: {before[0]:.3f} bits/byte; "
          f"stage 1 backups held at rounds {held_backup_rounds(others_apis, 1)}")

    victims = [process for process, _ in peers[1]]
    for process in victims:
        os.kill(process.pid, signal.SIGKILL)
    for process in victims:
        process.wait()
    killed_at = time.monotonic()
    done_at_kill = {api: count(peek(api), "micro_batches_done") for api in first}

    def moved_in():
        movers = [api for api in others_apis if api_doc(api, "/api/stats").get("stage") == 1]
        return movers[0] if movers else None
    mover = wait_for(swarm, moved_in, HEAL_DEADLINE, about=first[0], killed=victims)
    moved_at = time.monotonic()
    loaded = wait_for(swarm, lambda: api_doc(mover, "/api/diloco").get("loaded_from"), HEAL_DEADLINE,
                      about=mover, killed=victims)
    assert "backup" in loaded, loaded  # no replica of stage 1 was left to load from

    feeder = [api for api in first if api != mover]
    assert feeder, "the only stage-0 peer left cannot have moved"
    wait_for(swarm, lambda: count(peek(feeder[0]), "micro_batches_done") >= done_at_kill[feeder[0]] + MORE_AFTER_HEAL,
             HEAL_DEADLINE, about=feeder[0], killed=victims)
    healed_at = time.monotonic()
    survivors = [api for api in apis if api not in [a for _, a in peers[1]]]
    settled = {api: wait_until(lambda api=api: get_json(api, "/api/stats"), API_DEADLINE)["rebalance"]["moves"]
               for api in survivors}
    assert sorted(settled.values()) == [0, 0, 0, 1], settled  # one move healed it
    print(f"stage 1's replicas SIGKILLed: a peer moved in after {moved_at - killed_at:.1f} s, loaded {loaded}; "
          f"stage 0 completed {MORE_AFTER_HEAL} more micro-batches {healed_at - killed_at:.1f} s after the kill")

    last = [api for api in last if api != mover]  # the mover may have come from the last stage: it serves 1 now
    at_heal = wait_for(swarm, lambda: last_stage_loss(last), LOSS_DEADLINE, about=last[0], killed=victims)

    def trained_on():
        now = last_stage_loss(last)
        return now if now is not None and now[1] >= at_heal[1] + LOSS_WINDOW else None
    after = wait_for(swarm, trained_on, LOSS_DEADLINE, about=last[0], killed=victims)
    print(f"last stage's loss {LOSS_WINDOW} micro-batches after the recovery: {after[0]:.3f} bits/byte "
          f"(before the loss of stage 1: {before[0]:.3f})")
    assert after[0] <= before[0] + LOSS_NOISE, (before, after)

    def moved_again():
        now = {api: moves_done(api) for api in survivors}
        return {api: n for api, n in now.items() if n is not None and n != settled[api]}
    watched = max(healed_at + SETTLE_S - time.monotonic(), 1.0)  # the window runs from the recovery on
    assert not wait_until(moved_again, watched), "a move after the recovery: the swarm oscillates"

    assert_no_traceback(swarm)
    exited = [(p.args, p.returncode) for p in swarm.processes if p not in victims and p.poll() is not None]
    assert not exited, exited

"""Generation through a real 2-stage swarm that trains: a bootstrap, one stage-0 peer (whose API serves
``/v1/completions``) and two stage-1 replicas, each its own process, on loopback.

Greedy generation through the swarm must equal greedy generation in ``transformers`` on the agreed
weights of the outer round the reply names, token for token (the swarm's inner rounds are made too
long to end here, so the agreed weights are round 0's: the initial weights, which the test builds
itself; live weights train on meanwhile). Then the stage-1 replica serving a streamed generation is
SIGKILLed mid-stream, and the text still completes, equal to the unfailed text (the client replays
the prefix on the other replica, which holds the same agreed weights).
"""

from __future__ import annotations

import json
import os
import signal
import urllib.request

import pytest

from p2pswarm.model.catalog import get_model
from tests.procs import Swarm, get_json, small_batch_run, wait_until

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

MODEL = get_model("tiny-lm/2")
INNER_STEPS = 1_000_000  # no outer round ends during the test: the agreed weights stay round 0's (the initial ones)
PROMPT = "def main():\n    "
NEW_TOKENS = 24
LONG_TOKENS = 60  # the stream a replica dies in: long enough to kill it midway
KILL_AFTER = 8  # streamed tokens before the SIGKILL
START_DEADLINE = 180.0  # guards against a hang only: start, find each other, train a first micro-batch
REQUEST_TIMEOUT = 120.0  # guards against a hang only: one completion on 2 shared cores


def _layers(stage: int) -> str:
    start, end = MODEL.stage_range(stage)
    return f"{start}:{end}"


def _post(api: str, body: dict):
    request = urllib.request.Request(f"http://{api}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
    return urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT)


def _complete(api: str, tokens: int) -> dict:
    with _post(api, {"model": MODEL.name, "prompt": PROMPT, "max_tokens": tokens, "temperature": 0}) as reply:
        return json.load(reply)


def _stream(api: str, tokens: int, after_each):
    """The streamed text, calling ``after_each(events so far)`` after each event."""
    text, events = [], 0
    with _post(api, {"model": MODEL.name, "prompt": PROMPT, "max_tokens": tokens, "temperature": 0,
                     "stream": True}) as reply:
        for raw in reply:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            doc = json.loads(line[len("data: "):])
            assert "error" not in doc, doc
            text.append(doc["choices"][0]["text"])
            events += 1
            after_each(events)
    return "".join(text)


def _reference(tokens: int) -> str:
    """Greedy generation in transformers from the agreed weights of round 0 (the initial weights)."""
    from p2pswarm.model.hf_names import hf_state_dict, llama_config
    from p2pswarm.model.tokenizer import ByteTokenizer
    from p2pswarm.model.transformer import build_model

    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**llama_config(MODEL))).eval()
    model.load_state_dict(hf_state_dict(build_model(MODEL, seed=0)), strict=True)
    ids = torch.tensor([list(PROMPT.encode())])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=tokens, do_sample=False, min_new_tokens=tokens)
    return ByteTokenizer().decode(out[0, ids.shape[1]:].tolist())


@pytest.fixture
def swarm(tmp_path):
    swarm = Swarm(tmp_path)
    yield swarm
    swarm.close()


def _inference(api: str) -> dict:
    return (get_json(api, "/api/swarm") or {}).get("inference", {})


def test_greedy_generation_through_the_swarm_equals_transformers_and_survives_a_sigkill(swarm):
    boot = swarm.bootstrap()
    run = small_batch_run(swarm.workdir, MODEL.name, INNER_STEPS)  # training is the background here: a light one
    (first, api), = [swarm.join(boot, _layers(0), "s0", *run)]
    replicas = [swarm.join(boot, _layers(1), f"s1r{r}", *run) for r in range(2)]
    trained = wait_until(lambda: ((get_json(api, "/api/swarm") or {}).get("counts", {})
                                  .get("micro_batches_done", 0) > 0), START_DEADLINE)
    assert trained, [p.poll() for p in swarm.processes]
    assert wait_until(lambda: all(_inference(a).get("max_sessions") for _, a in replicas), START_DEADLINE)

    reply = _complete(api, NEW_TOKENS)
    assert reply["p2pswarm"]["rounds"] == [0, 0], reply  # the agreed weights of round 0 at both stages
    assert reply["choices"][0]["text"] == _reference(NEW_TOKENS)
    assert reply["choices"][0]["finish_reason"] == "length"

    unfailed = _complete(api, LONG_TOKENS)["choices"][0]["text"]
    steps = {a: _inference(a).get("steps", 0) for _, a in replicas}
    killed = []

    def kill_the_serving_replica(events: int) -> None:
        if events != KILL_AFTER:
            return
        serving = [(p, a) for p, a in replicas if _inference(a).get("steps", 0) > steps[a]]
        assert len(serving) == 1, serving  # the session is sticky: one replica of stage 1 serves it
        os.kill(serving[0][0].pid, signal.SIGKILL)
        killed.append(serving[0][1])

    text = _stream(api, LONG_TOKENS, kill_the_serving_replica)
    assert killed, "the stream ended before the kill"
    assert text == unfailed
    survivor = next(a for _, a in replicas if a not in killed)
    assert _inference(survivor)["steps"] > steps[survivor]  # the replay went there
    assert first.poll() is None

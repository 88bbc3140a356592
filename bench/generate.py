"""Generation through a training swarm: first-token latency and tokens/s, against the exported model in
plain transformers in the same run, and the training throughput lost while one client generates.

Starts ``p2pswarm demo`` (2 stages x 2 replicas of tiny-lm on loopback, training), then alternates
windows without and with one client generating (greedy, streaming ``POST /v1/completions`` to peer 0's
API, request after request); each window's training tokens/s is the growth of the stage-0 replicas'
token counts (``/api/swarm``). Then ``p2pswarm export --api`` takes the swarm's agreed weights, and
transformers' ``generate`` (KV cache, greedy) runs the same prompts on them: the baseline.

    python bench/generate.py [--peers 4] [--windows 2] [--window-s 30] [--tokens 64]

``--peers 2`` is one replica per stage (the issue's "2-stage swarm"), 4 the 2 x 2 swarm.
"""

from __future__ import annotations

import argparse
import http.client
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import machine_line, median, percentile, print_table

from p2pswarm.demo import get_json

PROMPTS = ["The swarm", "Once upon a time", "In the beginning", "A peer to peer network"]
FORM_TIMEOUT = 240.0  # seconds for the demo to form on a loaded 2-core machine
WARMUP_S = 20.0  # training settles (first outer round under way) before the first window
REQUEST_TIMEOUT = 120.0  # one streaming completion, a guard only


def stream_completion(api: str, prompt: str, tokens: int) -> dict:
    """One greedy streaming completion: first-token latency, tokens, seconds, text, rounds."""
    host, port = api.rsplit(":", 1)
    model = get_json(api, "/v1/models")["data"][0]["id"]
    conn = http.client.HTTPConnection(host, int(port), timeout=REQUEST_TIMEOUT)
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0, "stream": True})
    started = time.perf_counter()
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    reply = conn.getresponse()
    if reply.status != 200:
        raise RuntimeError(f"/v1/completions answered {reply.status}: {reply.read()[:300]!r}")
    first, text, count, rounds = None, "", 0, None
    for raw in reply:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if first is None:
            first = time.perf_counter() - started
        text += chunk["choices"][0]["text"]
        count += chunk.get("p2pswarm", {}).get("tokens", 1)
        rounds = chunk.get("p2pswarm", {}).get("rounds", rounds)
    seconds = time.perf_counter() - started
    conn.close()
    return {"first": first, "seconds": seconds, "tokens": count, "text": text, "rounds": rounds}


def training_tokens(apis: list[str]) -> int:
    return sum(d.get("tokens", 0) for d in (get_json(a, "/api/swarm") for a in apis) if d and d.get("first"))


def window(apis: list[str], seconds: float, generate_on: str | None, tokens: int) -> dict:
    """Training tokens/s over ``seconds``; with ``generate_on``, one client generating meanwhile."""
    start_tokens, start, requests = training_tokens(apis), time.time(), []
    while time.time() - start < seconds:
        if generate_on is None:
            time.sleep(1.0)
        else:
            requests.append(stream_completion(generate_on, PROMPTS[len(requests) % len(PROMPTS)], tokens))
    elapsed = time.time() - start
    return {"train_tok_s": (training_tokens(apis) - start_tokens) / elapsed, "requests": requests}


def start_demo(workdir: Path, seconds: float, peers: int) -> tuple[subprocess.Popen, list[str]]:
    demo = subprocess.Popen([sys.executable, "-m", "p2pswarm", "demo", "--peers", str(peers), "--stages", "2",
                             "--duration", str(seconds), "--dir", str(workdir / "demo")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    apis, deadline = [], time.time() + FORM_TIMEOUT
    for line in demo.stdout:
        if m := re.search(r"status API (\S+)", line):
            apis.append(m.group(1))
        if "every stage served" in line or time.time() > deadline:
            break
    if len(apis) < peers:
        demo.kill()
        raise RuntimeError("the demo did not form")
    return demo, apis


def baseline(export_dir: Path, tokens: int) -> list[dict]:
    """The exported model in transformers, greedy with the KV cache: first token and tokens/s per prompt."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # its notes on max_length vs max_new_tokens, once per call
    tokenizer = AutoTokenizer.from_pretrained(export_dir)
    model = AutoModelForCausalLM.from_pretrained(export_dir, dtype=torch.float32).eval()
    out = []
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            t0 = time.perf_counter()
            model.generate(ids, max_new_tokens=1, do_sample=False)
            first = time.perf_counter() - t0
            t0 = time.perf_counter()
            full = model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
            seconds = time.perf_counter() - t0
        out.append({"first": first, "seconds": seconds, "tokens": tokens,
                    "text": tokenizer.decode(full[0, ids.shape[1]:])})
    return out


def rate_rows(name: str, requests: list[dict]) -> list[object]:
    firsts = [r["first"] * 1000 for r in requests if r["first"] is not None]
    rates = [r["tokens"] / r["seconds"] for r in requests]
    return [name, len(requests), f"{median(firsts):.0f}", f"{percentile(firsts, 90):.0f}", f"{median(rates):.1f}"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=4, help="training peers: 2 (2 x 1) or 4 (2 x 2)")
    parser.add_argument("--windows", type=int, default=2, help="pairs of windows (off, on)")
    parser.add_argument("--window-s", type=float, default=30.0)
    parser.add_argument("--tokens", type=int, default=64, help="new tokens per request")
    args = parser.parse_args()
    print(machine_line())
    with tempfile.TemporaryDirectory(prefix="bench-generate-") as tmp:
        workdir = Path(tmp)
        total = WARMUP_S + 2 * args.windows * args.window_s + 120
        demo, apis = start_demo(workdir, total, args.peers)
        try:
            time.sleep(WARMUP_S)  # a bench's warm-up, not a test's wait for an event
            off, on = [], []
            for _ in range(args.windows):
                off.append(window(apis, args.window_s, None, args.tokens))
                on.append(window(apis, args.window_s, apis[0], args.tokens))
            t0 = time.perf_counter()
            subprocess.run([sys.executable, "-m", "p2pswarm", "export", "--api", apis[0], "--out",
                            str(workdir / "export")], check=True, timeout=120)
            export_s = time.perf_counter() - t0
        finally:
            demo.terminate()
            demo.wait(timeout=60)
        swarm = [r for w in on for r in w["requests"]]
        base = baseline(workdir / "export", args.tokens)
    print_table(f"generation, greedy, tiny-lm, 2 stages x {args.peers // 2} replica(s) training on loopback",
                ["path", "requests", "first token p50 ms", "p90 ms", "tokens/s p50"],
                [rate_rows("swarm (/v1/completions, streamed)", swarm), rate_rows("transformers, exported", base)])
    train_off = sum(w["train_tok_s"] for w in off) / len(off)
    train_on = sum(w["train_tok_s"] for w in on) / len(on)
    print(f"training tokens/s without generation {train_off:.0f}, with one client generating {train_on:.0f} "
          f"({train_on / train_off:.2f}x; target >= 0.80x)")
    swarm_rate = median([r["tokens"] / r["seconds"] for r in swarm])
    base_rate = median([r["tokens"] / r["seconds"] for r in base])
    print(f"swarm tokens/s against transformers in this process: {swarm_rate / base_rate:.2f}x; "
          f"export took {export_s:.1f} s; rounds of the last swarm reply {swarm[-1]['rounds']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

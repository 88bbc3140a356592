"""A node's API from the client side: ``get_json`` (its JSON status documents, for ``p2pswarm
status`` and ``p2pswarm export``) and ``p2pswarm generate``, a streaming ``POST /v1/completions``
(stdlib ``http.client``), the text written to stdout as it comes, figures on stderr at the end.

Bad input and an unreachable or refusing node are one line and exit 1, like ``status``.
"""

from __future__ import annotations

import http.client
import json
import os
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

from p2pswarm.api.serve import parse_host_port
from p2pswarm.errors import ConfigError, DialError
from p2pswarm.swarm.completions import CompletionRequest

GENERATE_NEW_TOKENS = 64  # a few lines of text: enough to see what the model does
GENERATE_TEMPERATURE = 0.0  # greedy by default: the same prompt gives the same text
GENERATE_TIMEOUT = 60.0  # seconds without a byte from the node; a first token through a busy swarm fits
API_TIMEOUT = 5.0  # seconds to wait for a node's API before saying it is not answering
API_TOKEN_ENV = "P2PSWARM_API_TOKEN"  # the token when none is given: keeps it out of process listings


def get_json(api: str, path: str, timeout: float = API_TIMEOUT, token: str | None = None) -> dict:
    """The JSON document at ``path`` of the node's API at ``api`` (HOST:PORT); ConfigError, one line, when
    the node refuses (its own message) or does not answer."""
    host, port = parse_host_port(api)
    token = token or os.environ.get(API_TOKEN_ENV)
    request = urllib.request.Request(f"http://{host}:{port}{path}",
                                     headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.load(response)
    except urllib.error.HTTPError as exc:  # the node answered: a bad request or an unreachable peer
        try:
            reason = json.load(exc).get("error", exc.reason)
        except (ValueError, OSError, AttributeError):
            reason = exc.reason
        raise ConfigError(str(reason.get("message", reason) if isinstance(reason, dict) else reason)) from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise ConfigError(f"no p2pswarm node answers at {api}: {getattr(exc, 'reason', exc)}") from None


def add_parser(sub, token_option) -> None:
    gen = sub.add_parser("generate", help="generate text through the swarm, streamed to stdout",
                         description="Ask the node behind --api to complete --prompt (POST /v1/completions, "
                                     "streamed). The text goes to stdout as it comes; tokens, tokens/s, the "
                                     "first token's latency and the weights' outer rounds go to stderr.")
    gen.add_argument("--api", required=True, metavar="HOST:PORT", help="the node's API")
    gen.add_argument("--prompt", required=True, metavar="TEXT", help="the text to continue")
    gen.add_argument("--max-new-tokens", type=int, default=GENERATE_NEW_TOKENS, metavar="N",
                     help="tokens to generate at most (default %(default)s)")
    gen.add_argument("--temperature", type=float, default=GENERATE_TEMPERATURE, metavar="T",
                     help="0 is greedy, deterministic (default %(default)s)")
    gen.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling (default 1: off)")
    gen.add_argument("--seed", type=int, default=None, metavar="S", help="fixes sampling (temperature > 0)")
    token_option(gen)


def stream_completion(api: str, body: dict, token: str | None,
                      timeout: float = GENERATE_TIMEOUT) -> Iterator[dict]:
    """The chunks of a streamed completion, as OpenAI's JSON documents; P2PSwarmError on failure."""
    host, port = parse_host_port(api)
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
    connection = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        connection.request("POST", "/v1/completions", json.dumps({**body, "stream": True}), headers)
        response = connection.getresponse()
        if response.status != 200:
            raise ConfigError(_error_message(response.read(), f"{response.status} {response.reason}"))
        for line in response:
            if not line.startswith(b"data: "):
                continue
            data = line[len(b"data: "):].strip()
            if data == b"[DONE]":
                return
            doc = json.loads(data)
            if "error" in doc:
                raise DialError(_error_message(data, "generation failed"))
            yield doc
        raise DialError(f"the node at {api} ended the stream before it was complete")
    except (OSError, http.client.HTTPException, ValueError) as exc:
        raise DialError(f"no p2pswarm node answers at {api}: {exc}") from None
    finally:
        connection.close()


def _error_message(data: bytes, fallback: str) -> str:
    try:
        error = json.loads(data)["error"]
        return str(error.get("message", error) if isinstance(error, dict) else error)
    except (ValueError, KeyError, TypeError):
        return fallback


def cmd_generate(args) -> int:
    request = CompletionRequest(prompt=args.prompt, max_new_tokens=args.max_new_tokens,
                                temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    request.check()  # ConfigError, one line, before we connect
    body = {"prompt": request.prompt, "max_tokens": request.max_new_tokens, "temperature": request.temperature,
            "top_p": request.top_p, "seed": request.seed}
    rounds: list[int]
    start, first, tokens, rounds = time.monotonic(), None, 0, []
    for doc in stream_completion(args.api, body, args.api_token):
        text = doc["choices"][0]["text"]
        if first is None and text:
            first = time.monotonic() - start
        sys.stdout.write(text)
        sys.stdout.flush()
        extra = doc.get("p2pswarm", {})
        tokens, rounds = tokens + extra.get("tokens", 0), extra.get("rounds") or rounds
    elapsed = time.monotonic() - start
    sys.stdout.write("\n")
    sys.stdout.flush()
    first_ms = "-" if first is None else f"{first * 1000:.0f} ms"
    print(f"{tokens} tokens in {elapsed:.2f} s ({tokens / elapsed if elapsed > 0 else 0:.1f} tokens/s), "
          f"first token after {first_ms}, weights of outer round(s) {rounds or '-'}", file=sys.stderr)
    return 0

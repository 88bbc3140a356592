"""OpenAI-compatible ``GET /v1/models`` and ``POST /v1/completions`` over a ``Completer``.

A completion is one JSON reply, or with ``"stream": true`` server-sent events: ``data: {chunk}``
per ``CompletionChunk``, then ``data: [DONE]``. Each reply carries the DiLoCo outer rounds of the
weights that decoded it (``"p2pswarm": {"rounds": [...]}``). Errors before the first chunk are a
status (400, 429, 502, 503, 500); after it, an ``error`` event ends the stream (OpenAI's clients
raise on it). A client that goes away cancels its generation: the Completer's iterator is closed.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
import time
from contextlib import aclosing, nullcontext

import trio

from p2pswarm.api.http import ClientGone, HttpError, cancel_on_disconnect, error_for, read_body, send_json
from p2pswarm.swarm.completions import DEFAULT_NEW_TOKENS, Completer, CompletionChunk, CompletionRequest

OPENAI_TEMPERATURE = 1.0  # OpenAI's default when a request names none: clients that omit it get what they expect
EVENT_STREAM = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
UNSUPPORTED = {"n": 1, "best_of": 1, "echo": False, "logprobs": None, "suffix": None, "stop": None}  # field: default


async def serve_v1(completer: Completer | None, scope, receive, send) -> None:
    path, method = scope["path"], scope["method"]
    if completer is None:
        raise HttpError(404, "this node does not generate text (no model to complete with)", "not_found")
    if path == "/v1/models":
        if method not in ("GET", "HEAD"):
            raise HttpError(405, "/v1/models answers GET", "method_not_allowed")
        return await send_json(send, 200, {"object": "list", "data": [
            {"id": completer.model_name, "object": "model", "created": 0, "owned_by": "p2pswarm"}]})
    if path != "/v1/completions":
        raise HttpError(404, f"no such endpoint {path}; try /v1/models, /v1/completions", "not_found")
    if method != "POST":
        raise HttpError(405, "/v1/completions answers POST", "method_not_allowed")
    body = await read_body(scope, receive)
    prompts, request, stream = parse_completion(body, completer.model_name)
    reply = Reply(completer.model_name)
    async with trio.open_nursery() as nursery:  # a client going away cancels the generation
        nursery.start_soon(cancel_on_disconnect, receive, nursery.cancel_scope)
        if stream:
            await reply.stream(completer, prompts, request, send)
        else:
            await send_json(send, 200, await reply.collect(completer, prompts, request))
        nursery.cancel_scope.cancel()
    if nursery.cancel_scope.cancelled_caught and not reply.done:
        raise ClientGone()


def parse_completion(body: bytes, model: str) -> tuple[list[str], CompletionRequest, bool]:
    """OpenAI's completion body: the prompts, the request (checked), whether to stream. HttpError 400/404."""
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        raise HttpError(400, "the body is not JSON") from None
    if not isinstance(doc, dict):
        raise HttpError(400, "the body must be a JSON object")
    if doc.get("model", model) != model:
        raise HttpError(404, f"this node serves the model {model!r}, not {doc.get('model')!r}", "model_not_found")
    for field, default in UNSUPPORTED.items():
        if doc.get(field, default) not in (default, None):
            raise HttpError(400, f"{field!r} is not supported here (leave it out)", "unsupported_parameter")
    prompts = doc.get("prompt")
    prompts = [prompts] if isinstance(prompts, str) else prompts
    if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) for p in prompts):
        raise HttpError(400, "prompt must be a string or a non-empty list of strings")
    request = CompletionRequest(prompt=prompts[0], max_new_tokens=_or(doc.get("max_tokens"), DEFAULT_NEW_TOKENS),
                                temperature=_or(doc.get("temperature"), OPENAI_TEMPERATURE),
                                top_p=_or(doc.get("top_p"), 1.0), seed=doc.get("seed"))
    if isinstance(request.max_new_tokens, bool) or isinstance(request.seed, bool):
        raise HttpError(400, "max_tokens and seed must be integers")
    for prompt in prompts:
        dataclasses.replace(request, prompt=prompt).check()  # ConfigError: a 400
    return prompts, request, doc.get("stream") is True


def _or(value, default):
    return default if value is None else value


class Reply:
    """One completion's id and figures, as OpenAI's documents carry them."""

    def __init__(self, model: str) -> None:
        self.id, self.created, self.model = f"cmpl-{secrets.token_hex(12)}", int(time.time()), model
        self.prompt_tokens = self.completion_tokens = 0
        self.rounds: list[int] = []
        self.done = False

    def document(self, choices: list[dict]) -> dict:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": choices, "p2pswarm": {"rounds": self.rounds}}

    def usage(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}

    def count(self, chunk: CompletionChunk, first: bool) -> None:
        self.prompt_tokens += chunk.prompt_tokens if first else 0
        self.completion_tokens += len(chunk.token_ids)
        self.rounds = list(chunk.rounds) or self.rounds

    async def chunks(self, completer: Completer, prompts: list[str], request: CompletionRequest):
        """(index, chunk) for every prompt in turn; each Completer iterator closed when left."""
        for index, prompt in enumerate(prompts):
            it = completer.stream(dataclasses.replace(request, prompt=prompt))
            async with aclosing(it) if hasattr(it, "aclose") else nullcontext(it):  # type: ignore[type-var]  # hasattr: it has aclose
                first = True
                async for chunk in it:
                    self.count(chunk, first)
                    first = False
                    yield index, chunk

    async def collect(self, completer: Completer, prompts: list[str], request: CompletionRequest) -> dict:
        texts, reasons = [""] * len(prompts), [None] * len(prompts)
        async with aclosing(self.chunks(completer, prompts, request)) as chunks:
            async for index, chunk in chunks:
                texts[index] += chunk.text
                reasons[index] = chunk.finish_reason or reasons[index]
        self.done = True
        choices = [{"text": text, "index": i, "finish_reason": reasons[i], "logprobs": None}
                   for i, text in enumerate(texts)]
        return {**self.document(choices), "usage": self.usage()}

    async def stream(self, completer: Completer, prompts: list[str], request: CompletionRequest, send) -> None:
        """Server-sent events; the response starts with the first chunk, so an early error keeps its status."""
        started = False
        try:
            async with aclosing(self.chunks(completer, prompts, request)) as chunks:
                async for index, chunk in chunks:
                    if not started:
                        await send({"type": "http.response.start", "status": 200, "headers": EVENT_STREAM})
                        started = True
                    choice = {"text": chunk.text, "index": index, "finish_reason": chunk.finish_reason,
                              "logprobs": None}
                    doc = self.document([choice])
                    doc["p2pswarm"]["tokens"] = len(chunk.token_ids)
                    await _event(send, json.dumps(doc))
        except Exception as exc:
            if not started:
                raise
            await _event(send, json.dumps(error_for(exc, "generation").body()))
        if not started:
            await send({"type": "http.response.start", "status": 200, "headers": EVENT_STREAM})
        await _event(send, "[DONE]", more=False)
        self.done = True


async def _event(send, data: str, more: bool = True) -> None:
    await send({"type": "http.response.body", "body": f"data: {data}\n\n".encode(), "more_body": more})

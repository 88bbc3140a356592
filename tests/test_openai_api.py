"""The OpenAI-compatible endpoints over a real server and a fake Completer: /v1/models, completions
(JSON and server-sent events), each error's status, body and auth limits, clients that reset or
stall mid-stream, the official ``openai`` client, and ``p2pswarm generate``."""

from __future__ import annotations

import json
import logging
import os
import socket
import struct
import subprocess
import sys
import threading
import time

import openai
import pytest
import trio

from p2pswarm.api import http as api
from p2pswarm.api.serve import parse_host_port
from p2pswarm.errors import ConfigError, DialError, NoCandidates, Overloaded
from p2pswarm.swarm.completions import CompletionChunk, CompletionRequest
from tests.test_api import SERVER_DEADLINE, http, running_api

MODEL = "tiny-lm/2"
ERRORS = {"config": ConfigError, "overloaded": Overloaded, "nocandidates": NoCandidates, "dial": DialError,
          "bug": RuntimeError}
STATUSES = {"config": 400, "overloaded": 429, "nocandidates": 503, "dial": 502, "bug": 500}


class FakeCompleter:
    """Chunks "w0 ", "w1 ", ... for a prompt; prompts steer it: "raise:KIND" fails before the first
    chunk, "late:KIND" after it, "block" blocks after it, "endless" never ends (1 MiB chunks). Who
    closed a generation is recorded (thread-safe: the server runs in another thread)."""

    model_name = MODEL

    def __init__(self) -> None:
        self.requests: list[CompletionRequest] = []
        self.closed = threading.Event()

    async def stream(self, request: CompletionRequest):
        self.requests.append(request)
        kind = request.prompt.partition(":")[2]
        try:
            if request.prompt.startswith("raise:"):
                raise ERRORS[kind](f"fake {kind}")
            for i in range(request.max_new_tokens):
                last = i == request.max_new_tokens - 1
                text = "x" * (1 << 20) if request.prompt == "endless" else f"w{i} "
                yield CompletionChunk(text=text, token_ids=(i,), finish_reason="length" if last else None,
                                      rounds=(3, 4), prompt_tokens=len(request.prompt))
                if request.prompt.startswith("late:"):
                    raise ExceptionGroup("nursery", [ERRORS[kind](f"fake late {kind}")])
                if request.prompt == "block":
                    await trio.sleep_forever()
        finally:
            self.closed.set()


def post(address: str, body: dict | bytes, headers: dict | None = None) -> tuple[int, bytes]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return http(address, "/v1/completions", data=data, headers={"Content-Type": "application/json", **(headers or {})})


def events(body: bytes) -> list:
    """The data of each server-sent event, JSON decoded ("[DONE]" as is)."""
    datas = [e[len(b"data: "):] for e in body.split(b"\n\n") if e.startswith(b"data: ")]
    return [d.decode() if d == b"[DONE]" else json.loads(d) for d in datas]


@pytest.fixture
def completer() -> FakeCompleter:
    return FakeCompleter()


@pytest.fixture
def server(completer):
    with running_api({}, completer=lambda: completer) as address:
        yield address


def test_models_lists_the_completers_model(server):
    status, body = http(server, "/v1/models")
    assert status == 200
    doc = json.loads(body)
    assert doc["object"] == "list" and [(m["id"], m["object"], m["owned_by"]) for m in doc["data"]] == \
        [(MODEL, "model", "p2pswarm")]


def test_a_completion_as_one_json_reply(server, completer):
    status, body = post(server, {"model": MODEL, "prompt": "hello", "max_tokens": 3, "temperature": 0, "seed": 5})
    assert status == 200
    doc = json.loads(body)
    assert doc["object"] == "text_completion" and doc["model"] == MODEL and doc["id"].startswith("cmpl-")
    assert doc["choices"] == [{"text": "w0 w1 w2 ", "index": 0, "finish_reason": "length", "logprobs": None}]
    assert doc["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
    assert doc["p2pswarm"] == {"rounds": [3, 4]}
    assert completer.requests == [CompletionRequest("hello", max_new_tokens=3, temperature=0, seed=5)]


def test_a_list_of_prompts_gets_one_choice_each(server):
    status, body = post(server, {"prompt": ["a", "bb"], "max_tokens": 2})
    assert status == 200
    assert [(c["index"], c["text"]) for c in json.loads(body)["choices"]] == [(0, "w0 w1 "), (1, "w0 w1 ")]


def test_a_streamed_completion_is_server_sent_events_ending_in_done(server):
    status, body = post(server, {"prompt": "hello", "max_tokens": 3, "stream": True})
    assert status == 200
    chunks = events(body)
    assert chunks[-1] == "[DONE]"
    assert [c["choices"][0]["text"] for c in chunks[:-1]] == ["w0 ", "w1 ", "w2 "]
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]] == [None, None, "length"]
    assert all(c["p2pswarm"] == {"rounds": [3, 4], "tokens": 1} for c in chunks[:-1])
    assert len({c["id"] for c in chunks[:-1]}) == 1


@pytest.mark.parametrize("kind", sorted(ERRORS))
@pytest.mark.parametrize("stream", [False, True])
def test_each_completer_error_is_its_status_in_openais_format(server, kind, stream, caplog):
    status, body = post(server, {"prompt": f"raise:{kind}", "stream": stream})
    assert status == STATUSES[kind]
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "code"}
    assert error["message"] == ("POST /v1/completions failed" if kind == "bug" else f"fake {kind}")
    assert bool([r for r in caplog.records if r.exc_info]) == (kind == "bug")  # only a bug's traceback is logged


def test_an_error_after_the_first_chunk_ends_the_stream_with_an_error_event(server):
    status, body = post(server, {"prompt": "late:overloaded", "max_tokens": 3, "stream": True})
    assert status == 200
    chunks = events(body)
    assert chunks[0]["choices"][0]["text"] == "w0 "
    assert chunks[1] == {"error": {"message": "fake late overloaded", "type": "rate_limit_error", "code": "overloaded"}}
    assert chunks[2] == "[DONE]"


@pytest.mark.parametrize("body, status", [
    (b"not json", 400), (b"[1]", 400), ({"prompt": ""}, 400), ({"prompt": []}, 400), ({"prompt": 3}, 400),
    ({"prompt": "x", "temperature": 5}, 400), ({"prompt": "x", "max_tokens": 0}, 400),
    ({"prompt": "x", "max_tokens": True}, 400), ({"prompt": "x", "n": 2}, 400), ({"prompt": "x", "stop": "\n"}, 400),
    ({"prompt": "x", "model": "gpt-4"}, 404)])
def test_bad_requests_are_refused_before_any_generation(server, completer, body, status):
    code, reply = post(server, body)
    assert code == status and json.loads(reply)["error"]["message"]
    assert completer.requests == []


def test_wrong_methods_and_paths_under_v1(server):
    assert http(server, "/v1/completions")[0] == 405
    assert http(server, "/v1/models", data=b"{}")[0] == 405
    assert json.loads(http(server, "/v1/chat/completions", data=b"{}")[1])["error"]["code"] == "not_found"


def test_without_a_completer_v1_is_not_served():
    with running_api({}) as address:
        status, body = http(address, "/v1/models")
        assert status == 404 and "does not generate" in json.loads(body)["error"]["message"]


def _raw(address: str) -> socket.socket:
    return socket.create_connection(parse_host_port(address), timeout=SERVER_DEADLINE)


def _read_head(sock: socket.socket, until: bytes = b"\r\n\r\n") -> bytes:
    """What the server sent up to ``until`` (the end of the head by default), and whatever came with it."""
    data = b""
    while until not in data and (chunk := sock.recv(4096)):
        data += chunk
    return data


def test_a_body_larger_than_the_bound_is_a_413(server, monkeypatch, completer):
    """Announced (Content-Length) or found while reading (chunked): 413, and the server goes on."""
    sock = _raw(server)
    sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {api.MAX_BODY_BYTES + 1}\r\n\r\n"
                 .encode())
    assert _read_head(sock).startswith(b"HTTP/1.1 413")
    sock.close()
    monkeypatch.setattr(api, "MAX_BODY_BYTES", 1000)
    body = json.dumps({"prompt": "y" * 2000}).encode()
    status, reply = http(server, "/v1/completions", data=iter([body[:700], body[700:]]),
                         headers={"Transfer-Encoding": "chunked"})
    assert status == 413 and json.loads(reply)["error"]["code"] == "request_too_large"
    assert completer.requests == []
    assert post(server, {"prompt": "ok", "max_tokens": 1})[0] == 200


def test_a_body_that_does_not_arrive_is_a_408(server, monkeypatch):
    monkeypatch.setattr(api, "BODY_TIMEOUT", 0.3)
    sock = _raw(server)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"pro")
    assert _read_head(sock).startswith(b"HTTP/1.1 408")
    sock.close()
    assert post(server, {"prompt": "ok", "max_tokens": 1})[0] == 200


def test_a_token_is_required_when_set(completer):
    async def stats(params: dict) -> dict:
        return {"ok": 1}

    with running_api({"/api/stats": stats}, completer=lambda: completer, token="s3cret") as address:
        for headers in [{}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"},
                        {"Authorization": "Bearer s3cre"}, {"Authorization": "Basic s3cret"}]:
            status, body = post(address, {"prompt": "x"}, headers)
            assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"
            assert http(address, "/api/stats", headers=headers)[0] == 401
        assert completer.requests == []
        assert post(address, {"prompt": "x", "max_tokens": 1}, {"Authorization": "Bearer s3cret"})[0] == 200
        assert http(address, "/api/stats", headers={"Authorization": "bearer s3cret"})[0] == 200  # any case


def _reset(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def _stream_request(prompt: str, max_tokens: int = 3) -> bytes:
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "stream": True}).encode()
    return (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


def test_a_client_resetting_mid_stream_cancels_its_generation(server, completer):
    sock = _raw(server)
    sock.sendall(_stream_request("block"))
    assert b"w0 " in _read_head(sock, until=b"w0 ")  # the first chunk came (with the head or after it); now it blocks
    _reset(sock)
    assert completer.closed.wait(SERVER_DEADLINE), "the generation was not closed"
    assert post(server, {"prompt": "next", "max_tokens": 1})[0] == 200


def test_a_client_that_stops_reading_mid_stream_is_dropped_and_its_generation_closed(server, completer, monkeypatch,
                                                                                     caplog):
    monkeypatch.setattr(api, "REPLY_TIMEOUT", 0.3)
    caplog.set_level(logging.INFO, logger=api.log.name)
    sock = _raw(server)
    sock.sendall(_stream_request("endless", max_tokens=1000))  # 1 GiB of text that nobody reads
    assert _read_head(sock).startswith(b"HTTP/1.1 200")
    assert completer.closed.wait(SERVER_DEADLINE), "the generation was not closed"
    assert any("did not take its reply" in m for m in caplog.messages)
    assert post(server, {"prompt": "next", "max_tokens": 1})[0] == 200
    sock.close()


def test_the_official_openai_client_gets_completions(completer):
    with running_api({}, completer=lambda: completer, token="k") as address:
        client = openai.OpenAI(base_url=f"http://{address}/v1", api_key="k", max_retries=0, timeout=SERVER_DEADLINE)
        assert [m.id for m in client.models.list()] == [MODEL]
        reply = client.completions.create(model=MODEL, prompt="hello", max_tokens=2, temperature=0)
        assert reply.choices[0].text == "w0 w1 " and reply.choices[0].finish_reason == "length"
        assert reply.usage.completion_tokens == 2
        streamed = client.completions.create(model=MODEL, prompt="hello", max_tokens=3, stream=True)
        assert "".join(chunk.choices[0].text for chunk in streamed) == "w0 w1 w2 "
        with pytest.raises(openai.RateLimitError):
            client.completions.create(model=MODEL, prompt="raise:overloaded")
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"http://{address}/v1", api_key="wrong", max_retries=0).models.list()


def _generate(address: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "p2pswarm", "generate", "--api", address, *args],
                          capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})})


def test_p2pswarm_generate_streams_the_text_and_reports_figures(completer):
    with running_api({}, completer=lambda: completer, token="tok") as address:
        done = _generate(address, "--prompt", "hello", "--max-new-tokens", "3", "--seed", "7",
                         env={"P2PSWARM_API_TOKEN": "tok"})
        assert done.returncode == 0, done.stderr
        assert done.stdout == "w0 w1 w2 \n"
        last = done.stderr.strip().splitlines()[-1]
        assert last.startswith("3 tokens in ") and "tokens/s" in last and "first token after" in last
        assert "[3, 4]" in last
        assert completer.requests == [CompletionRequest("hello", max_new_tokens=3, temperature=0.0, seed=7)]
        for args, message in [(["--prompt", "raise:overloaded"], "fake overloaded"),
                              (["--prompt", "late:dial", "--max-new-tokens", "3"], "fake late dial"),
                              (["--prompt", "x", "--api-token", "wrong"], "Bearer"),
                              (["--prompt", ""], "non-empty")]:
            failed = _generate(address, *args, env={"P2PSWARM_API_TOKEN": "tok"})
            assert failed.returncode == 1 and len(failed.stderr.strip().splitlines()) == 1, failed.stderr
            assert message in failed.stderr
    gone = _generate(address, "--prompt", "x")
    assert gone.returncode == 1 and "no p2pswarm node answers" in gone.stderr


def test_the_cli_takes_the_token_and_refuses_public_binding_without_one():
    from p2pswarm.cli import build_parser, config_from_args

    boot = ["bootstrap", "--api", "0.0.0.0:8700"]
    with pytest.raises(ConfigError, match="--api-token"):
        config_from_args(build_parser().parse_args(boot))
    config = config_from_args(build_parser().parse_args([*boot, "--api-token", "t"]))
    assert config.api_token == "t" and "'t'" not in repr(config)


def _from(address: str, source: str) -> socket.socket:
    """A raw connection to the API from the loopback address ``source`` (another client, as the API sees it)."""
    host, port = address.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=SERVER_DEADLINE, source_address=(source, 0))


def test_a_flooding_client_gets_half_the_generations_and_429_the_other_client_keeps_its_share(server, completer):
    """One client (127.0.0.1) opens twice the node's generations; it gets its share (half) and 429 for the
    rest, at once. A second client (127.0.0.2) still gets the other half; past the node's total it gets 429
    too; and once the flood ends its generations are given back."""
    from p2pswarm.api.shares import MAX_COMPLETIONS, MAX_PER_CLIENT

    def open_stream(source: str) -> tuple[socket.socket, bytes]:
        sock = _from(server, source)
        sock.sendall(_stream_request("block"))
        head = _read_head(sock)
        return sock, head

    flood = [open_stream("127.0.0.1") for _ in range(2 * MAX_COMPLETIONS)]
    statuses = [head.split(b" ", 2)[1] for _, head in flood]
    assert statuses.count(b"200") == MAX_PER_CLIENT and statuses.count(b"429") == 2 * MAX_COMPLETIONS - MAX_PER_CLIENT
    honest = [open_stream("127.0.0.2") for _ in range(MAX_COMPLETIONS - MAX_PER_CLIENT)]
    assert all(head.split(b" ", 2)[1] == b"200" for _, head in honest)  # >= half the node's generations
    extra, head = open_stream("127.0.0.2")
    assert head.split(b" ", 2)[1] == b"429"  # the node's total is reached: nobody gets more
    for sock, _ in [*flood, *honest, (extra, b"")]:
        _reset(sock)

    def status() -> int:
        return post(server, {"prompt": "next", "max_tokens": 1})[0]
    deadline = time.monotonic() + SERVER_DEADLINE
    while status() != 200 and time.monotonic() < deadline:  # the resets cancel the generations, shares return
        time.sleep(0.1)
    assert status() == 200

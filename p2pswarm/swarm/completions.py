"""What the HTTP API asks of text generation, and what generation answers: the seam between the
OpenAI-compatible endpoint (``p2pswarm/api/serve.py``) and generation through the swarm
(``p2pswarm/swarm/generation.py``), so that each is built and tested on its own.

A ``CompletionRequest`` is validated before any work starts (``check``); a ``Completer`` turns it
into ``CompletionChunk``s as tokens come. Errors, from the one error tree:

- ``ConfigError``: bad input (a prompt longer than the model's context, a bad temperature): HTTP 400;
- ``Overloaded``: too many sessions, a session past its memory budget: HTTP 429;
- ``NoCandidates`` / ``DialError``: no replica of some stage could be reached: HTTP 503 / 502.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from p2pswarm.errors import ConfigError

MAX_NEW_TOKENS = 4096  # per request: far beyond the catalog's contexts minus a prompt; bounds a session's life
DEFAULT_NEW_TOKENS = 16  # OpenAI's default max_tokens for completions
MAX_PROMPT_CHARS = 1 << 20  # 1 MiB of text: more than any catalog context holds; bounds tokenizing work


@dataclass(frozen=True)
class CompletionRequest:
    """One generation: ``temperature`` 0 is greedy (deterministic); ``seed`` fixes sampling."""

    prompt: str
    max_new_tokens: int = DEFAULT_NEW_TOKENS
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None

    def check(self) -> None:
        """ConfigError, one line, for a request no model could serve."""
        if not isinstance(self.prompt, str) or not self.prompt:
            raise ConfigError("the prompt must be a non-empty string")
        if len(self.prompt) > MAX_PROMPT_CHARS:
            raise ConfigError(f"the prompt is longer than {MAX_PROMPT_CHARS} characters")
        if not isinstance(self.max_new_tokens, int) or not 1 <= self.max_new_tokens <= MAX_NEW_TOKENS:
            raise ConfigError(f"max new tokens must be an integer in 1..{MAX_NEW_TOKENS}")
        if not isinstance(self.temperature, (int, float)) or not (0.0 <= self.temperature <= 2.0):
            raise ConfigError("temperature must be a number in 0..2")
        if not isinstance(self.top_p, (int, float)) or not (0.0 < self.top_p <= 1.0) or math.isnan(self.top_p):
            raise ConfigError("top_p must be a number in (0, 1]")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2**63):
            raise ConfigError("seed must be an integer in 0..2^63-1")


@dataclass(frozen=True)
class CompletionChunk:
    """New output: ``text`` is the new text (UTF-8 safe: an incomplete character waits for the next
    chunk), ``token_ids`` the new tokens. The last chunk has ``finish_reason`` ("length" or "stop")."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None = None
    rounds: tuple[int, ...] = ()  # the DiLoCo outer round of the weights each stage decoded with
    prompt_tokens: int = 0


class Completer(Protocol):
    """Generation as the API sees it."""

    model_name: str  # the id /v1/models lists and /v1/completions accepts

    def stream(self, request: CompletionRequest) -> AsyncIterator[CompletionChunk]:
        """Chunks as tokens come; raises (module docstring) before the first chunk or between chunks."""
        ...

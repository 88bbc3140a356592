"""What a replica contributes to an outer round: its pseudo-gradient, taken and encoded shard by shard.

Taking the pseudo-gradient runs on the engine's compute thread (``SwarmService.with_engine``): the
parameters may be on a GPU, and ``outer.flatten`` moves them to the host slice by slice; encoding it
(``encode_with_residual``) runs in a worker thread, so that training goes on meanwhile.

``encode_contribution`` is the one function that turns our pseudo-gradient into the bytes the
other members of the group receive (our ``Part`` of each owner's shard). It is the seam a test's
attacking replica replaces (``tests/attacking_peer.py``: -10 times our shards, or noise): the
package itself never sends anything else.
"""

from __future__ import annotations

import torch

from p2pswarm.diloco import codec as codecs
from p2pswarm.diloco.outer import OuterOptimizer, flatten

Buffers = tuple[torch.Tensor, torch.Tensor]  # (weights at the close, pseudo-gradient), on the host


def round_buffers(buffers: Buffers | None, outer: OuterOptimizer) -> Buffers:
    """Two vectors at least as long as the round's fragment (``OuterOptimizer.fragment``) for the round to fill,
    kept from round to round (``buffers``, unless they are too short): one round at a time uses them, and
    fresh ones would cost page faults."""
    a, b = outer.fragment()
    if buffers is None or buffers[0].numel() < b - a:
        buffers = (torch.empty(b - a), torch.empty(b - a))
    return buffers


def take_pseudo_gradient(engine, outer: OuterOptimizer, buffers: Buffers) -> Buffers:
    """Our weights now (``at``) and the pseudo-gradient ``start - at``, of the round's fragment, written into
    the first elements of ``buffers`` (views of them)."""
    a, b = outer.fragment()
    at, pseudo = buffers[0][:b - a], buffers[1][:b - a]
    flatten(engine.params, out=at, bounds=(a, b))
    outer.pseudo_gradient(at, out=pseudo)
    return at, pseudo


def take_alone(engine, outer: OuterOptimizer, buffers: Buffers) -> dict:
    """A group of one: our own pseudo-gradient is the aggregate (DiLoCo with one worker), nothing is encoded."""
    at, pseudo = take_pseudo_gradient(engine, outer, buffers)
    return {"at": at, "pseudo": pseudo, "bounds": ((0, at.numel()),)}


def fragment_residual(residual: torch.Tensor | None, fragment: tuple[int, int]) -> torch.Tensor | None:
    """The round's piece of the stage's error-feedback ``residual``: a view, written in place (None: none yet)."""
    return None if residual is None else residual[fragment[0]:fragment[1]]


def stage_residual(residual: torch.Tensor | None, piece: torch.Tensor | None, fragment: tuple[int, int],
                   numel: int) -> torch.Tensor | None:
    """The stage's residual after a round of ``fragment`` left ``piece`` (``offload.Assembled.residual``):
    ``residual`` itself when ``piece`` is its view, else a new stage-sized one holding ``piece``."""
    if piece is None or residual is not None:
        return residual  # (a view of it, written in place; or nothing carried)
    if piece.numel() == numel:
        return piece
    residual = torch.zeros(numel)
    residual[fragment[0]:fragment[1]].copy_(piece)
    return residual


def encode_contribution(pseudo: torch.Tensor, bounds, codec: str, residual: torch.Tensor | None) -> list[bytes]:
    """Our pseudo-gradient's piece ``pseudo[a:b]`` for each ``(a, b)`` of ``bounds``, encoded with
    ``codec``; what the codec leaves out of each piece goes into ``residual[a:b]`` (error feedback:
    carried on to the next round), if there is a residual."""
    return [codecs.encode(pseudo[a:b], codec, error_out=None if residual is None else residual[a:b])
            for a, b in bounds]


def encode_with_residual(pseudo: torch.Tensor, bounds, codec: str, residual: torch.Tensor | None) -> list[bytes]:
    """``encode_contribution`` of ``pseudo`` plus the residual carried on (added in place first); in a worker
    thread, off the engine's: the encoding does not hold training."""
    if residual is not None:
        pseudo.add_(residual)
    return encode_contribution(pseudo, bounds, codec, residual)

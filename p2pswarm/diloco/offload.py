"""The O(shard) work of an outer round, as plain functions that ``service`` runs in worker threads.

A peer's trio loop also answers the activation protocol (its acks), the round's own messages and
the API, so nothing that walks a stage's vector may run on it: an owner's combine of a 4M-element
shard takes ~95 ms, a stall every ack waiting behind it would see. The driver therefore runs each
of these in ``trio.to_thread.run_sync`` and keeps only O(1) bookkeeping on the loop:

- ``combine_shard``: an owner decodes its shard's parts, verifies and combines them
  (``aggregation``) and encodes the aggregate (the answer to the round's ``CombineShard``);
- ``assemble``: a member decodes the owners' results, checks them against its own shards, carries
  what it cannot apply into the error-feedback residual, and measures the norms it reports.

The others run on the engine's compute thread (``SwarmService.with_engine``): taking and encoding
the pseudo-gradient, the outer step, the host copy of a snapshot and loading one (the parameters
may be on a GPU: those steps move them slice by slice, ``outer.flatten``/``shift_flat``). Here
everything is on the host, nothing touches the engine or the driver's attributes: each function
works on what it is given and returns what the driver then records on the loop (so a peer's strike
is counted on the trio side, never in a thread).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from p2pswarm.diloco import aggregation
from p2pswarm.diloco import codec as codecs
from p2pswarm.errors import RemoteProtocolError

SPARSE_RESULT_SHARE = 0.25  # a sparse aggregate's cosine with our part: at least this share of our 1/n in it


def combine_shard(parts: dict[str, bytes], me: str, numel: int, *, codec: str, aggregator: str,
                  verify: bool) -> tuple[bytes, dict[str, str]]:
    """An owner's aggregate of its shard of ``numel`` elements, encoded, and the contributors it
    refused (peer -> reason): a part that does not decode (bad int8 scales, a non-finite value) or
    that ``aggregation.combine`` refuses. Our own part (``me``) is ours: it always decodes."""
    tensors, refused = {}, {}
    for peer, data in parts.items():
        try:
            tensors[peer] = codecs.decode(data, codec, numel)
        except RemoteProtocolError as exc:
            if peer == me:
                raise ValueError(f"our own part does not decode: {exc}") from None
            refused[peer] = f"undecodable: {exc}"
    verify_config = aggregation.VerifyConfig() if verify else None
    combined = aggregation.combine(tensors, me, aggregator, verify_config)
    width = len(combined.accepted)  # a sparse aggregate holds room for each accepted part's entries
    return codecs.encode(combined.result, codec, width=width), {**refused, **combined.rejected}


@dataclass
class Assembled:
    """What ``assemble`` made of a round's outcome."""

    aggregated: torch.Tensor  # the group's pseudo-gradient (in the round's pseudo-gradient buffer)
    missing: list[int]  # shards whose owner sent no result: nothing applied there, our part carried
    refused: dict[int, str]  # shards whose result we refused (a lying owner) -> why; our part carried
    residual: torch.Tensor | None  # the error-feedback residual (the one given, or a new one), carries included
    pseudo_norm: float  # of our own pseudo-gradient, before assembling
    update_norm: float  # of the aggregate that will be applied


def assemble(outcome, pseudo: torch.Tensor, bounds, *, me: str, codec: str,
             verify: aggregation.VerifyConfig | None, residual: torch.Tensor | None) -> Assembled:
    """The group's pseudo-gradient, in place of our own ``pseudo`` (no full-size temporary).

    Each shard is its owner's result. Where a result is missing (owner gone) or refused (a
    lying owner: it does not decode, or ``verify`` finds it far from our own shard), nothing
    is applied and our own part is carried to the next round in the error-feedback residual
    (created if None; else written in place): the members that all lack the same result stay
    bit-equal (keeping each one's own part would split their start weights for good), and our
    progress there is averaged in one round later instead of lost. A group of one has no
    results and applies its own pseudo-gradient (DiLoCo with one worker)."""
    missing, refused = list(outcome.missing), {}
    pseudo_norm = float(pseudo.norm())
    scratch = torch.empty(max(b - a for a, b in bounds))
    for index, (a, b) in enumerate(bounds):
        data = outcome.results.get(index)
        if data is None:
            if index in outcome.missing:
                residual = _carry(pseudo, residual, a, b)
            continue  # (a group of one: our own part is the aggregate)
        check = verify if outcome.owner(index) != me else None  # (our own shard's result is ours)
        width = outcome.contributors.get(index, 1)
        sent = pseudo[a:b] - residual[a:b] if codec == "sparse" and residual is not None else None  # our part
        reason = _judge_result(data, pseudo[a:b], scratch[:b - a], codec, check, width, sent)
        if reason is not None:
            refused[index] = reason
            residual = _carry(pseudo, residual, a, b)
            continue
        pseudo[a:b].copy_(scratch[:b - a])
    return Assembled(pseudo, missing, refused, residual, pseudo_norm, float(pseudo.norm()))


def _judge_result(data: bytes, own: torch.Tensor, out: torch.Tensor, codec: str,
                  verify: aggregation.VerifyConfig | None, width: int, sent: torch.Tensor | None) -> str | None:
    """Decode an owner's result (of ``width`` contributors) into ``out``; None if it is to be applied, else
    why it is refused."""
    try:
        result = codecs.decode(data, codec, own.numel(), out=out, width=width)
    except RemoteProtocolError as exc:
        return f"undecodable: {exc}"
    return refuse_result(result, own, verify, sent, width) if verify is not None else None


def refuse_result(result: torch.Tensor, own: torch.Tensor, verify: aggregation.VerifyConfig,
                  sent: torch.Tensor | None = None, contributors: int = 1) -> str | None:
    """Why an owner's decoded aggregate is refused, or None: far from our own shard ``own`` (``verify``), or,
    for a sparse round (``sent``: our part as it was sent), holding less of our part's direction than
    SPARSE_RESULT_SHARE of our share of it: the chunk-clipped mean of ``contributors`` parts, ours among
    them, has cosine about 1 / contributors with ours or more (1 / sqrt(n) among orthogonal parts), an
    owner's noise about 0 (which passes the length and projection checks)."""
    verdict = aggregation.verify(result, own, verify)
    if not verdict.accepted:
        return verdict.reason
    if sent is None or contributors < 2 or not bool(sent.any()):  # (a part of zeros has no direction)
        return None
    bar = SPARSE_RESULT_SHARE / contributors
    norms = float(torch.linalg.vector_norm(result)) * float(torch.linalg.vector_norm(sent))
    cosine = float(torch.dot(result, sent)) / norms if norms > 0 else 0.0
    return None if cosine >= bar else f"agreement with our part {cosine:.3g} < {bar:.3g}"


def _carry(pseudo: torch.Tensor, residual: torch.Tensor | None, a: int, b: int) -> torch.Tensor:
    """Apply nothing to [a, b) this round; send all of our part there again next round."""
    if residual is None:
        residual = torch.zeros_like(pseudo)
    residual[a:b].copy_(pseudo[a:b])  # (it held what the codec left out of the part we sent)
    pseudo[a:b].zero_()
    return residual

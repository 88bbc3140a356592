"""Which activation frames a stage computes: the pure checks of a request, and the peers it bars.

A frame that passed the wire's own checks (``activation.Forward.check``) must still be meant for
us: a request (a forward or a gradient, not a reply), with a priority that fits its kind and
our place in the pipeline, with targets where the last stage needs them, and (an evaluation) one
outer round per stage before us. ``classify`` says which job it asks for, or raises
``RemoteProtocolError``; the driver bars a peer that sent such a frame for ``BAN_PERIOD``
(``Bans``). A request of another run or for another stage is no garbage (a peer of another swarm,
or a map behind a move): the driver refuses it without a ban, before these checks. The tensor's
dtype and shape are ``codec.check_header``'s. Pure: no trio, no torch.
"""

from __future__ import annotations

from typing import Protocol

from p2pswarm.errors import RemoteProtocolError
from p2pswarm.swarm.activation import Backward, Forward
from p2pswarm.swarm.buffers import Priority
from p2pswarm.wire import Message

BAN_PERIOD = 60.0  # seconds a peer that sent us garbage is refused


class Waiting(Protocol):
    """The micro-batches whose gradient we still wait for, by (session, micro-batch): ``InFlight``."""

    def __contains__(self, key: tuple[bytes, int], /) -> bool: ...


def check_request(message: Message) -> None:
    """RemoteProtocolError unless ``message`` is a tensor request (a forward or a gradient)."""
    if not isinstance(message, (Forward, Backward)):
        raise RemoteProtocolError(f"{message.TYPE} is not a request")


def classify(message: Forward | Backward, *, stage: int, is_last: bool, waiting: Waiting) -> str | None:
    """The kind of job an addressed frame asks for ("forward", "eval" or "backward"); None for a
    gradient of a micro-batch not ``waiting`` from its sender (given up already, or acked by another
    peer: ``InFlight.awaiting``); RemoteProtocolError for a frame we would not compute."""
    if isinstance(message, Backward):
        if message.priority != Priority.TRAINING_BACKWARD:
            raise RemoteProtocolError(f"a gradient with priority {message.priority}")
        return "backward" if (message.session, message.micro_batch) in waiting else None
    if stage == 0 or message.priority == Priority.TRAINING_BACKWARD:
        raise RemoteProtocolError(f"a forward with priority {message.priority} for stage {stage}")
    if is_last and not message.targets:
        raise RemoteProtocolError("a forward for the last stage without its targets")
    if message.priority == Priority.TRAINING_FORWARD:
        return "forward"
    if len(message.rounds) != stage:
        raise RemoteProtocolError(f"an evaluation for stage {stage} with {len(message.rounds)} rounds")
    return "eval"


class Bans:
    """Peers refused until a time: ``bar`` one that sent garbage, ``prune`` the expired."""

    def __init__(self, period: float = BAN_PERIOD) -> None:
        self.period = period
        self.until: dict[str, float] = {}  # peer -> when it is served again

    def barred(self, peer: str, now: float) -> bool:
        return self.until.get(peer, float("-inf")) > now

    def bar(self, peer: str, now: float) -> None:
        self.until[peer] = now + self.period

    def prune(self, now: float) -> None:
        for peer in [p for p, t in self.until.items() if t <= now]:
            del self.until[peer]

"""The one error tree of p2pswarm.

Every error the package raises on purpose is a ``P2PSwarmError``. Foreign exceptions
(libp2p, cbor2, OS errors) are translated into this tree at exactly one boundary: the
module that talks to the foreign library.

    P2PSwarmError
    ├── ConfigError            bad input from the user: flags, files, keys (exit code 1)
    ├── ProtocolError
    │   ├── LocalProtocolError   we tried to send something the protocol forbids (a bug)
    │   └── RemoteProtocolError  a peer sent bytes that are not a valid message: drop it
    ├── DialError              a peer or address could not be reached
    │   └── CircuitExhausted     a relay circuit cannot carry the next frame: try another peer
    ├── NoCandidates           no fresh peer serves what was asked for
    ├── StartupError           the node could not start (port in use, no bootstrap reachable)
    └── Overloaded             a valid request that cannot be served now (too many sessions): retry later
"""


class P2PSwarmError(Exception):
    """Base of every error p2pswarm raises on purpose."""


class ConfigError(P2PSwarmError):
    """Bad input from the user: a flag, a config file, a key file."""


class ProtocolError(P2PSwarmError):
    """A protocol rule was broken, by us or by a peer."""


class LocalProtocolError(ProtocolError):
    """We tried to send something the protocol forbids: a programming error."""


class RemoteProtocolError(ProtocolError):
    """A peer sent bytes that do not decode to a valid message; the peer is dropped."""


class DialError(P2PSwarmError):
    """A peer or address could not be reached."""


class CircuitExhausted(DialError):
    """A frame would not fit the remaining bytes or time of the relay circuit it would travel on."""


class Stalled(DialError):
    """A peer made no progress within a deadline: no stream to it in time, or a frame's bytes
    stopped moving (it is not reading)."""


class NoCandidates(P2PSwarmError):
    """No fresh peer serves what was asked for."""


class StartupError(P2PSwarmError):
    """The node could not start: a port in use, no bootstrap peer reachable."""


class Overloaded(P2PSwarmError):
    """A valid request that cannot be served now (too many sessions, a session past its memory
    budget): the client may retry later."""


def first_error(exc: BaseException) -> BaseException:
    """The first P2PSwarmError inside (possibly nested) exception groups, or ``exc`` itself.

    Trio nurseries wrap what their tasks raise in exception groups; the boundaries that turn an
    error into an exit code or an HTTP status look through them with this.
    """
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            found = first_error(inner)
            if isinstance(found, P2PSwarmError):
                return found
    return exc

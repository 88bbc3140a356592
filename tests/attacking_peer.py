"""A Byzantine DiLoCo replica for tests: ``p2pswarm`` whose every contribution to an outer round is poisoned.

``python tests/attacking_peer.py ATTACK ARGS...`` runs ``p2pswarm ARGS...`` (``p2pswarm.cli.main``)
after replacing the one function that makes what a replica sends to the others,
``p2pswarm.diloco.contribution.encode_contribution``, by one that encodes ``poisoned`` pieces:
-10 times each (``negate10``) or noise of its norm (``noise``). The package has no such switch;
``tests/procs.py`` launches this script for the one attacking peer (``Swarm.join(program=...)``).
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

ATTACKS = ("negate10", "noise")
log = logging.getLogger("p2pswarm.diloco.attack")


def poisoned(shard, attack: str):
    """What a Byzantine replica sends instead of its shard: -10 times it, or noise of its norm."""
    import torch

    if attack == "noise":
        noise = torch.randn_like(shard)
        return noise * (shard.norm() / noise.norm().clamp_min(1e-12))
    return -10.0 * shard


def install(attack: str) -> None:
    """Make every contribution of this process ``attack``'s poison (no error feedback: it is not ours to carry)."""
    from p2pswarm.diloco import codec as codecs
    from p2pswarm.diloco import contribution

    def encode_poisoned(pseudo, bounds, codec: str, residual) -> list[bytes]:
        log.warning("attacking peer (%s): this peer sends poisoned pseudo-gradients (a test of the others' "
                    "defences)", attack)
        return [codecs.encode(poisoned(pseudo[a:b], attack), codec) for a, b in bounds]

    contribution.encode_contribution = encode_poisoned


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ATTACKS:
        raise SystemExit(f"usage: attacking_peer.py {{{','.join(ATTACKS)}}} P2PSWARM-ARGS...")
    install(argv[0])
    from p2pswarm.cli import main as cli_main

    return cli_main(argv[1:])


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's p2pswarm, as `-m p2pswarm`
    raise SystemExit(main(sys.argv[1:]))

"""p2pswarm: a fully decentralized peer-to-peer node that trains one language model with strangers.

Importing the package is cheap: it pulls in neither torch nor libp2p. The networking
lives in ``p2pswarm.net``, discovery in ``p2pswarm.dht``, the command in ``p2pswarm.cli``.
"""

__version__ = "0.1.0"

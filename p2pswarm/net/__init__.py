"""Networking: the only package that builds a py-libp2p host and touches its streams."""

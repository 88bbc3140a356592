"""A node: its configuration (``config``), how it runs (``running.run_node``), its memory upkeep and
its NAT traversal. Empty on purpose: ``node.config`` is imported by the command line without the
services behind ``run_node`` (libp2p and torch, 2 s at import), so that ``--help``, ``keygen``,
``status`` and every one-line error stay fast.
"""

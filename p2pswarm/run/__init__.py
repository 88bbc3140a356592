"""The run: everything the peers of a swarm agree on (``spec``), and the one frozen ``Training``
value a peer trains by."""

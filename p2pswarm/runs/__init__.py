"""Packaged run files (``p2pswarm join --run NAME``): one TOML per run, read by ``p2pswarm.run.spec``."""

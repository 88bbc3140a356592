"""SWARM parallelism: choosing peers for micro-batches, buffering and computing them."""

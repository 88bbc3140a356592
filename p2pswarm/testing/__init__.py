"""Test helpers for p2pswarm: Hypothesis strategies for messages and frames."""

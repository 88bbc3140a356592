"""NAT traversal: reachability, STUN, relays, hole punching."""

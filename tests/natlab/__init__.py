"""NAT lab tests: real network namespaces, nftables NATs and p2pswarm processes (root only)."""

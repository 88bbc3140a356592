"""Self-healing: stage backups, rebalancing, health."""

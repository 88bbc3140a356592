"""Self-healing: moving peers to an under-served stage at runtime (a pure rule and its driver)."""

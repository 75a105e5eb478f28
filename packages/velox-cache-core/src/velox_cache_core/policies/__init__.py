"""One module per eviction policy."""

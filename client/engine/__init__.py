"""client/engine."""

"""client/cluster."""

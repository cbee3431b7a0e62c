"""client/ops."""

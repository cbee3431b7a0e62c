"""client/serve/dashboard."""

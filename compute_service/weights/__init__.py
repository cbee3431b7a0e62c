"""compute_service/weights."""

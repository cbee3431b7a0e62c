"""compute_service/model."""

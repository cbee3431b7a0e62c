"""pagedkv compute_service."""

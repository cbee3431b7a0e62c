"""memory_service/tiers."""

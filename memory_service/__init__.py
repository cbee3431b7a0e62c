"""pagedkv memory_service."""

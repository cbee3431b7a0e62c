"""memory_service/manager."""

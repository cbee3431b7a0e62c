"""protos/pagedkv/runtime."""

"""protos/pagedkv/model."""

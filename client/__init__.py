"""pagedkv client."""

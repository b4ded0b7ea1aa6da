"""The fault-free twin: its cache key and cache, golden results, the rounding battery."""

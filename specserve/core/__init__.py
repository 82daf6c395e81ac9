"""Records that the engine and speculative decoding both stand on: a request's state, the paged-KV block
bookkeeping, draft proposals, one step's batch and row layout, and the speculative counters."""

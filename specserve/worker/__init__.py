"""Running a model over a flat batch of pieces, with its paged KV cache."""

"""Structured outputs: grammar-constrained decoding (llguidance), exact under speculation."""

"""Speculative decoding: drafters, verify planners and the lossless rejection sampler."""

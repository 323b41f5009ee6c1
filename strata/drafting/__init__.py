"""Speculative decoding: proposers, the verifier, and draft statistics."""

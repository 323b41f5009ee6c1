"""Shared building blocks that every architecture file assembles: norms, rotary
embeddings, paged attention, gated MLP, mixture of experts and the decoder layer."""

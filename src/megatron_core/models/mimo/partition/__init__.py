"""Sequence sharding of MIMO's combined embeddings for context and sequence parallelism."""

"""Recommendation decoding: trie constraints, beam search, speculative beam search, metrics."""

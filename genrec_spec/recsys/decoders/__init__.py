"""Recommendation decoders: trie-constrained beam search, lossless speculative beam search, and
the one-pass decoders (parallel heads, NEZHA draft head, RPG long IDs, dense top-K)."""

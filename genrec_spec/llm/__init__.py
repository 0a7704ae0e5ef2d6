"""LLM text decoding on the core: proposers (one per file), drafter training, prompt corpora and
the registry of speculative methods."""

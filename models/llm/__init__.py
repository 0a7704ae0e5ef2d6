"""The LLM side's models: the native Llama target (SmolLM2, Gemma-3), its KV cache, 4-bit weights
and the trained drafters' networks (EAGLE, Medusa, MTP, exit head)."""

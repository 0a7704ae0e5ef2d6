"""Models: the Llama-family LLM target, the Semantic-ID recommender, draft heads."""

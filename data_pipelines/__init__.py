"""Data side of the recommender: raw interactions -> splits -> item text embeddings ->
semantic IDs -> jagged batches. Imports nothing of the project but plain types."""

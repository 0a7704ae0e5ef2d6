"""Offline products: the batch candidate-generation job and the A/B replay evaluation."""

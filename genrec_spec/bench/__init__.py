"""Benchmarks, kept apart from the runtime path. Each prints ratios against a baseline measured
in the same run (medians of repeats)."""

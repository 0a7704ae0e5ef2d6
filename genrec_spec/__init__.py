"""genrec_spec: lossless speculative decoding for generative recommenders and LLMs."""

__version__ = "0.1.0"

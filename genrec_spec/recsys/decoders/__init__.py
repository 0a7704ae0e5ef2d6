"""Recommendation decoders: trie-constrained beam search, lossless speculative beam search, and
the one-pass decoders (parallel heads, NEZHA draft head, RPG long IDs, dense top-K).

`registry` lists them by name (`DECODERS`, `get_decoder`); each decoder is one module here."""

from genrec_spec.recsys.decoders.registry import DECODERS, DecoderInfo, get_decoder

__all__ = ["DECODERS", "DecoderInfo", "get_decoder"]

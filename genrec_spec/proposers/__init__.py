"""Proposers: one drafter per module, each producing a DraftTree."""

from genrec_spec.proposers.cross_tokenizer import CrossTokenizerProposer, TokenBridge
from genrec_spec.proposers.draft_model import DraftModelProposer, layer_skip_copy
from genrec_spec.proposers.eagle import Eagle2Proposer, EagleProposer
from genrec_spec.proposers.layerskip import LayerSkipProposer
from genrec_spec.proposers.lookahead import LookaheadProposer
from genrec_spec.proposers.medusa import MedusaProposer
from genrec_spec.proposers.mtp import MTPProposer, MTPTreeProposer
from genrec_spec.proposers.ngram import NgramTrie, PromptLookup, TrieProposer
from genrec_spec.proposers.quantized import QuantizedSelfProposer

__all__ = [
    "CrossTokenizerProposer",
    "DraftModelProposer",
    "Eagle2Proposer",
    "EagleProposer",
    "LayerSkipProposer",
    "LookaheadProposer",
    "MTPProposer",
    "MTPTreeProposer",
    "MedusaProposer",
    "NgramTrie",
    "PromptLookup",
    "QuantizedSelfProposer",
    "TokenBridge",
    "TrieProposer",
    "layer_skip_copy",
]

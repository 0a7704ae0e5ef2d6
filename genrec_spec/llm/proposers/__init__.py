"""Proposers: one drafter per module, each producing a DraftTree."""

from genrec_spec.llm.proposers.catalogue import CatalogueProposer
from genrec_spec.llm.proposers.cross_tokenizer import CrossTokenizerProposer, TokenBridge
from genrec_spec.llm.proposers.draft_model import DraftModelProposer, layer_skip_copy
from genrec_spec.llm.proposers.eagle import Eagle2Proposer, EagleProposer
from genrec_spec.llm.proposers.layerskip import LayerSkipProposer
from genrec_spec.llm.proposers.lookahead import LookaheadProposer
from genrec_spec.llm.proposers.medusa import MedusaProposer
from genrec_spec.llm.proposers.mtp import MTPProposer, MTPTreeProposer
from genrec_spec.llm.proposers.ngram import NgramTrie, PromptLookup, TrieProposer
from genrec_spec.llm.proposers.quantized import QuantizedSelfProposer

__all__ = [
    "CatalogueProposer",
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

"""Dense retrieval: top-K over the whole catalogue by the model's item objective, SASRec's scoring
on the Semantic-ID backbone (the dense half of LIGER-style hybrids).

A model trained with the item objective (`RecommenderConfig.item_objective`) also learns the
next item directly: log p(item | h) = log_softmax(h . E)[item], with h the last history state
and E the item embedding table the history tokens read (tied, as in SASRec). One backbone pass
and one [B, D] x [D, I] product score every catalogue item, so the top-K is exact under that
objective; no code, trie or beam is involved (the trie argument is checked only, like every
decoder's).
Scores are the items' log-probabilities over the catalogue.

Shape letters: B users, M history items, I items, D model width, K recommendations.
"""

from __future__ import annotations

import torch
from torch import Tensor

from genrec_spec.data_pipelines.trie import PrefixTrie
from genrec_spec.models.recsys.blocks import HistoryState
from genrec_spec.recsys.decoders.heads import rank_catalogue
from genrec_spec.recsys.errors import DecodeOptionError
from genrec_spec.recsys.types import Recommendations


def check_item_objective(model, what: str = "the dense decoder") -> None:
    if model.item_objective is None:
        raise DecodeOptionError(
            f"{what} needs a model trained with the item objective",
            'train with a model.item_objective (e.g. {"weight": 1.0}) or use decoder "beam"',
        )


def item_log_probs(model, state: HistoryState) -> Tensor:  # [B, I]
    """log p(item | history) of every catalogue item under the model's item objective."""
    check_item_objective(model)
    return model.item_scores(state.hidden).log_softmax(dim=-1)


@torch.no_grad()
def decode(
    model,  # SemanticIdRecommender trained with the item objective
    values: Tensor,  # [M] int64 item indices of B histories, oldest first
    offsets: Tensor,  # [B+1] int64
    *,
    k: int,
    trie: PrefixTrie,
) -> Recommendations:
    """Top-K catalogue items by log p(item | history) (one backbone pass, one product)."""
    return rank_catalogue(model, values, offsets, k, trie, lambda s: item_log_probs(model, s))

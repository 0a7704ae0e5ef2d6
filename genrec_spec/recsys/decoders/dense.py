"""Dense retrieval: top-K over the whole catalogue by the model's item objective, SASRec's scoring
on the Semantic-ID backbone (the dense half of LIGER-style hybrids).

A model trained with the item objective (`RecommenderConfig.item_objective`) also learns the
next item directly: log p(item | h) = log_softmax(h . E)[item], with h the last history state
and E the item embedding table the history tokens read (tied, as in SASRec). One backbone pass
and one [B, D] x [D, I] product score every catalogue item, so the top-K is exact under that
objective; no code, trie or beam is involved (the trie argument is checked only, like every
decoder's). Scores are then the items' log-probabilities over the catalogue.

That product is linear in the catalogue. With `item_search="index"`, or "auto" (the default) on
a catalogue of at least `ItemIndexConfig.min_items` items, the top-K come instead from an
approximate inner-product index over the same item table (`recsys.item_index`; `index_kind`
"ivf-pq", the default, "ivf" or "hnsw"): the decoder is then approximate (an item the index
misses is missing from the list; `index_recall` measures the share of the exact top-K it keeps),
and its scores are the items' logits, not log-probabilities: the softmax normaliser sums over
every item, which is what the index avoids. Both rank alike; they differ per row by that
normaliser. `item_search="exact"` always takes the product.

Shape letters: B users, M history items, I items, D model width, K recommendations.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from genrec_spec.data_pipelines.trie import PrefixTrie
from genrec_spec.models.recsys.blocks import HistoryState
from genrec_spec.models.recsys.times import HistoryTimes
from genrec_spec.recsys.decoders.heads import rank_catalogue, whole_catalogue
from genrec_spec.recsys.errors import DecodeOptionError
from genrec_spec.recsys.inference import inference
from genrec_spec.recsys.item_index import (
    ItemIndexConfig,
    exact_top_items,
    recall_at_k,
    top_items,
    use_index,
)
from genrec_spec.recsys.types import Recommendations


@dataclass(frozen=True)
class DenseConfig:
    """Defaults of the `dense` decoder's options."""

    # "exact": the [B, I] product; "index": the approximate item index; "auto": the index from
    # `ItemIndexConfig.min_items` items on
    item_search: str = "auto"
    index_kind: str = ItemIndexConfig.kind  # the index searched (`item_index.KINDS`)


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


@inference
def decode(
    model,  # SemanticIdRecommender trained with the item objective
    values: Tensor,  # [M] int64 item indices of B histories, oldest first
    offsets: Tensor,  # [B+1] int64
    *,
    k: int,
    trie: PrefixTrie,
    item_search: str = DenseConfig.item_search,
    index_kind: str = DenseConfig.index_kind,
    times: HistoryTimes | None = None,  # a time-aware model's (`models.recsys.times`)
) -> Recommendations:
    """Top-K catalogue items by log p(item | history) (one backbone pass, one product), or by
    item logit through the approximate item index (module docstring)."""
    check_item_objective(model)
    config = ItemIndexConfig(kind=index_kind)
    if not use_index(model, item_search, config):
        top = whole_catalogue(lambda state: item_log_probs(model, state))
        return rank_catalogue(model, values, offsets, k, trie, top, times)

    def indexed(state: HistoryState, k: int) -> tuple[Tensor, Tensor, dict]:
        found = top_items(model, state.hidden, k, config)
        return found.items, found.scores, {"item_index": True}

    return rank_catalogue(model, values, offsets, k, trie, indexed, times)


@inference
def index_recall(
    model,  # SemanticIdRecommender trained with the item objective
    values: Tensor,  # [M] int64 item indices of B histories, oldest first
    offsets: Tensor,  # [B+1] int64
    *,
    k: int,
    index_kind: str = DenseConfig.index_kind,
    times: HistoryTimes | None = None,  # a time-aware model's (`models.recsys.times`)
) -> Tensor:  # [B] recall@K: the share of each row's exact top-K the item index finds
    """How much of the exact product's top-K `decode(..., item_search="index")` returns."""
    check_item_objective(model)
    hidden = model.encode_history(values, offsets, times).hidden  # [B, D]
    found = top_items(model, hidden, k, ItemIndexConfig(kind=index_kind))
    return recall_at_k(found.items, exact_top_items(model, hidden, k).items)

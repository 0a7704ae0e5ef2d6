"""PinRec-style decoding: every code level from one backbone pass, top-K over the whole catalogue.

The parallel level heads (`models/recsys/heads.ParallelLevelHeads`) predict all L code levels of the
next item independently from the last history state h. An item's score is the sum of its levels'
log-probabilities, log p(c_0 | h) + ... + log p(c_{L-1} | h), so one backbone pass and L gathers
of [B, I] score every catalogue item: no tree, no beam, one sequential pass instead of beam
search's L. Every catalogue item is scored, so the top-K is exact under this factorised model;
what it gives up against `beam` is the conditioning of deeper levels on the earlier ones. (The
heads' sparse product with the items' code incidence matrix, `score_items`, which training and
validation use, is slower at batch 1 and faster in large batches.)

Level 0 from the backbone's own level-0 head (`level0="backbone"`) is free in the same pass and
is trained at every history position, where the parallel heads see only the sampled branch
positions: with heads trained on per-code cross-entropy it ranks better. Heads trained on the
catalogue cross-entropy of their summed levels (`CodeHeadsConfig.item_loss`) fit their own level
0 together with the others, and their own sum ranks better. So the default, `level0="auto"`,
is "head" for such models and "backbone" otherwise; `level0="head"` is the pure PinRec model.

Scores are raw sums of log-probabilities (not renormalised over the catalogue: that would shift
every item of a row by the same constant and change no ranking).

Shape letters: B users, M history items, I items, L code levels, K recommendations.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor

from genrec_spec.data_pipelines.trie import PrefixTrie
from genrec_spec.models.recsys.blocks import HistoryState
from genrec_spec.models.recsys.times import HistoryTimes
from genrec_spec.recsys.decoders.beam import beam_width_for, check_trie
from genrec_spec.recsys.errors import DecodeOptionError
from genrec_spec.recsys.inference import inference
from genrec_spec.recsys.types import Recommendations, RecommendStats

LEVEL0_SOURCES = ("auto", "backbone", "head")


@dataclass(frozen=True)
class HeadsConfig:
    """Options of the `heads` decoder."""

    # level-0 log-probs from "backbone" (its level-0 head), "head", or "auto" (see above)
    level0: str = "auto"


def check_decode_args(model, k: int, trie: PrefixTrie) -> None:
    """The checks every decoder makes first (beam's): 1 <= k <= I, a trie of this catalogue."""
    beam_width_for(k, k, model.num_items)  # a list of k items is a beam of width k
    check_trie(model, trie)


def item_scores(
    model,  # SemanticIdRecommender with parallel heads
    state,  # HistoryState of B users
    level0: str = HeadsConfig.level0,
) -> Tensor:  # [B, I] sum over levels of log p(item's code at that level)
    if model.parallel_heads is None:
        raise DecodeOptionError(
            "the heads decoder needs the model's parallel level heads",
            'train with model.parallel_heads = true or use decoder "beam"',
        )
    if level0 not in LEVEL0_SOURCES:
        raise DecodeOptionError(
            f"level0 must be one of {LEVEL0_SOURCES}, got {level0!r}",
            'pass level0="auto" (the default), "backbone" or "head"',
        )
    if level0 == "auto":
        level0 = "head" if model.config.parallel_heads.item_loss else "backbone"
    codes = model.item_codes  # [I, L]
    score = state.level0_log_probs[:, codes[:, 0]] if level0 == "backbone" else 0.0  # [B, I]
    # Level by level over each level's own codebook (what `ParallelLevelHeads.log_probs` stacks
    # and pads for the training loss): fewer ops, and no level 0 when the backbone gives it.
    for level, mlp in enumerate(model.parallel_heads.mlp):
        if level or level0 == "head":
            score = score + mlp(state.hidden).log_softmax(dim=-1)[:, codes[:, level]]
    return score


@inference
def decode(
    model,  # SemanticIdRecommender
    values: Tensor,  # [M] int64 item indices of B histories, oldest first
    offsets: Tensor,  # [B+1] int64
    *,
    k: int,
    trie: PrefixTrie,
    level0: str = HeadsConfig.level0,
    times: HistoryTimes | None = None,  # a time-aware model's (`models.recsys.times`)
) -> Recommendations:
    """Top-K catalogue items by the parallel heads' summed level log-probs (one backbone pass)."""
    top = whole_catalogue(lambda s: item_scores(model, s, level0))
    return rank_catalogue(model, values, offsets, k, trie, top, times)


# state, k -> (items [B, K], scores [B, K], the search's own RecommendStats fields)
TopItems = Callable[[HistoryState, int], tuple[Tensor, Tensor, dict]]


def whole_catalogue(score: Callable[[HistoryState], Tensor]) -> TopItems:
    """The top-K of `score` (state -> [B, I], a score of every item)."""

    def top(state: HistoryState, k: int) -> tuple[Tensor, Tensor, dict]:
        scores = score(state)  # [B, I]
        best = scores.topk(k, dim=1)
        return best.indices, best.values, {"items_scored_per_user": scores.shape[1]}

    return top


def rank_catalogue(
    model,  # SemanticIdRecommender
    values: Tensor,  # [M] int64 item indices of B histories, oldest first
    offsets: Tensor,  # [B+1] int64
    k: int,
    trie: PrefixTrie,
    top: TopItems,  # the K best items of the history state, by whole catalogue or an index
    times: HistoryTimes | None = None,  # a time-aware model's (`models.recsys.times`)
) -> Recommendations:
    """Top-K catalogue items after one backbone pass: the body of the decoders that rank the
    catalogue from the history state (`heads`, `dense`)."""
    check_decode_args(model, k, trie)
    start = time.perf_counter()
    state = model.encode_history(values, offsets, times)
    items, scores, found = top(state, k)
    return Recommendations(
        items=items,
        scores=scores,
        stats=RecommendStats(
            target_passes=1,
            nodes_scored=0,
            wall_time_s=time.perf_counter() - start,
            truncated_histories=int(state.truncated.sum()),
            **found,
        ),
    )

"""PinRec-style decoding: every code level from one backbone pass, top-K over the whole catalogue.

The parallel level heads (`models/rec_heads.ParallelLevelHeads`) predict all L code levels of the
next item independently from the last history state h. An item's score is the sum of its levels'
log-probabilities, log p(c_0 | h) + ... + log p(c_{L-1} | h), so one backbone pass and one sparse
product with the items' code incidence matrix score every catalogue item: no tree, no beam, one
sequential pass instead of beam search's L. Every catalogue item is scored, so the top-K is exact
under this factorised model; what it gives up against `beam` is the conditioning of deeper levels
on the earlier ones.

Level 0 comes by default from the backbone's own level-0 head (`level0="backbone"`): it is free
in the same pass and is trained at every history position, where the parallel heads see only the
sampled branch positions (on ML-100K it ranks better); `level0="head"` is the pure PinRec model.

Scores are raw sums of log-probabilities (not renormalised over the catalogue: that would shift
every item of a row by the same constant and change no ranking).

Shape letters: B users, M history items, I items, L code levels, K recommendations.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from genrec_spec.data_pipelines.trie import PrefixTrie
from genrec_spec.models.recommender import HistoryState
from genrec_spec.recsys.beam import DecodeOptionError, beam_width_for, check_trie
from genrec_spec.recsys.types import Recommendations

LEVEL0_SOURCES = ("backbone", "head")


@dataclass(frozen=True)
class HeadsConfig:
    """Options of the `heads` decoder."""

    level0: str = "backbone"  # level-0 log-probs from "backbone" (its level-0 head) or "head"


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
            "the heads decoder needs the model's parallel level heads; train with "
            'model.parallel_heads = true or use decoder "beam"'
        )
    if level0 not in LEVEL0_SOURCES:
        raise DecodeOptionError(f"level0 must be one of {LEVEL0_SOURCES}, got {level0!r}")
    level0_log_probs = state.level0_log_probs if level0 == "backbone" else None
    return model.parallel_heads.score_items(state.hidden, model.item_codes, level0_log_probs)


@torch.no_grad()
def decode(
    model,  # SemanticIdRecommender
    values: Tensor,  # [M] int64 item indices of B histories, oldest first
    offsets: Tensor,  # [B+1] int64
    *,
    k: int,
    trie: PrefixTrie,
    level0: str = HeadsConfig.level0,
) -> Recommendations:
    """Top-K catalogue items by the parallel heads' summed level log-probs (one backbone pass)."""
    return rank_catalogue(
        model, values, offsets, k, trie, lambda state: item_scores(model, state, level0)
    )


def rank_catalogue(
    model,  # SemanticIdRecommender
    values: Tensor,  # [M] int64 item indices of B histories, oldest first
    offsets: Tensor,  # [B+1] int64
    k: int,
    trie: PrefixTrie,
    score: Callable[[HistoryState], Tensor],  # state -> [B, I] a score of every item
) -> Recommendations:
    """Top-K catalogue items by `score` after one backbone pass: the body of the decoders that
    score the whole catalogue from the history state (`heads`, `dense`)."""
    check_decode_args(model, k, trie)
    start = time.perf_counter()
    state = model.encode_history(values, offsets)
    top = score(state).topk(k, dim=1)
    return Recommendations(
        items=top.indices,
        scores=top.values,
        stats={
            "target_passes": 1,
            "nodes_scored": 0,
            "items_scored_per_user": model.num_items,
            "wall_time_s": time.perf_counter() - start,
            "truncated_histories": int(state.truncated.sum()),
        },
    )

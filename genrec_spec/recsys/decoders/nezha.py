"""NEZHA-style decoding: one backbone pass, then a lightweight recurrent draft head runs the beam.

`beam` costs one backbone pass per code level. Here the backbone runs once over the history
(`encode_history`: its last state h and the level-0 log-probs), and the deeper levels come from
`models/recsys/heads.RecurrentDraftHead`, a GRU cell started from h that reads the chosen code of
level l and predicts level l + 1: a beam step costs one tiny GRU step for all B x W beams
instead of a transformer pass. The beam is the same trie-constrained beam as `beam`'s
(`decoders.beam.extend`: codes that lead to no item are masked, the top W prefixes kept, equal
scores broken the same way), so every returned ID names a catalogue item and no item repeats.
An item's score is the level-0 log-prob of the backbone plus the draft head's log-probs of the
deeper levels (raw log-probs, like `beam`'s).

The answer is approximate: where the draft head's distribution differs from the backbone's, its
top-K does too (`spec_beam` instead uses such a draft only to propose, and stays exact).

Shape letters: B users, M history items, W beams, V codes of a level, Hd draft width, K results.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch
from torch import Tensor

from genrec_spec.data_pipelines.trie import PrefixTrie
from genrec_spec.models.recsys.times import HistoryTimes
from genrec_spec.recsys.decoders.beam import (
    Beams,
    beam_width_for,
    check_trie,
    extend,
    finish,
    start_beams,
)
from genrec_spec.recsys.errors import DecodeOptionError
from genrec_spec.recsys.inference import inference
from genrec_spec.recsys.types import Recommendations, RecommendStats


def draft_head_of(model):  # -> the model's RecurrentDraftHead
    if model.draft_head is None:
        raise DecodeOptionError(
            "the nezha decoder and draft need the model's draft head",
            'train with model.draft_head = true or use decoder "beam"',
        )
    return model.draft_head


def head_beams(
    model,  # SemanticIdRecommender with a draft head
    state,  # HistoryState of B users
    beams: Beams,  # [B, W] the level-0 beams (from the backbone's level-0 log-probs)
    trie: PrefixTrie,
    width: int,
    levels: int,  # prefixes grow to this length (L: whole Semantic IDs)
) -> Iterator[Beams]:  # the beams of each length 2..levels, in turn
    """The draft head's trie-constrained beam, level by level (what `decode` ranks with and
    `spec_beam`'s "nezha" draft proposes)."""
    head = draft_head_of(model)
    draft = head.init(state.hidden)[:, None].expand(-1, beams.nodes.shape[1], -1)  # [B, W, Hd]
    prefixes = beams.code[..., None]  # [B, W, level] each beam's codes so far
    # A tied head (draft_tied) adds the item objective's mass under each child: the rows' item
    # logits are computed once here, as `dense` does, and read per prefix at every level.
    scores = model.item_scores(state.hidden) if model.config.draft_tied else None  # [B, I]
    for level in range(1, levels):
        item_logits = None if scores is None else model.draft_item_logits(scores, prefixes)
        # The state of each surviving beam reads its last code and predicts this level.
        draft, log_probs = head.step(draft, beams.code, level - 1, item_logits)  # [B, W, V]
        beams = extend(beams, log_probs, trie, level, width)
        draft = draft.gather(1, beams.origin[:, :, None].expand(-1, -1, draft.shape[-1]))
        kept = prefixes.gather(1, beams.origin[:, :, None].expand(-1, -1, level))
        prefixes = torch.cat([kept, beams.code[..., None]], dim=2)
        yield beams


def search(
    model,  # SemanticIdRecommender with a draft head
    state,  # HistoryState of B users
    trie: PrefixTrie,
    k: int,
    width: int,  # W >= k
) -> tuple[Tensor, Tensor, int]:  # items [B, K], scores [B, K], draft nodes expanded
    """The whole NEZHA search from an encoded history: level 0 from the backbone, the deeper
    levels from the draft head's beam."""
    batch = state.lengths.numel()
    first = extend(start_beams(batch, trie), state.level0_log_probs[:, None], trie, 0, width)
    draft_nodes = 0
    for beams in head_beams(model, state, first, trie, width, model.num_levels):
        draft_nodes += beams.code.numel()
    items, scores = finish(beams, trie, k)
    return items, scores, draft_nodes


@inference
def decode(
    model,  # SemanticIdRecommender with a draft head
    values: Tensor,  # [M] int64 item indices of B histories, oldest first
    offsets: Tensor,  # [B+1] int64
    *,
    k: int,
    trie: PrefixTrie,
    beam_width: int | None = None,  # W >= k; None = beam's default, max(k, 20)
    times: HistoryTimes | None = None,  # a time-aware model's (`models.recsys.times`)
) -> Recommendations:
    """Top-K items of a trie-constrained beam over the draft head's code distributions."""
    start_time = time.perf_counter()
    width = beam_width_for(k, beam_width, model.num_items)
    check_trie(model, trie)
    draft_head_of(model)  # before any work
    state = model.encode_history(values, offsets, times)
    items, scores, draft_nodes = search(model, state, trie, k, width)
    return Recommendations(
        items=items,
        scores=scores,
        stats=RecommendStats(
            target_passes=1,
            nodes_scored=0,
            wall_time_s=time.perf_counter() - start_time,
            truncated_histories=int(state.truncated.sum()),
            draft_nodes=draft_nodes,
            draft_steps=model.num_levels - 1,
        ),
    )

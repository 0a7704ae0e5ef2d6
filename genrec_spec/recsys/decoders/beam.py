"""Trie-constrained beam search over Semantic-ID codes (TIGER's decoder, the baseline).

    decode(model, values, offsets, *, k, trie, beam_width=None, engine="core") -> Recommendations

It runs on the decoding core (`engine="core"`, the default): the core's ``beam_search`` on the
recommender as a Target (`recsys.target`: the history is the root, code levels are tokens)
under the catalogue of its items, whose selection, stopping and stats every target shares.
`engine="native"` runs this module's search, the same rule a level at a time with its own
selection (`extend`): the reference the core is held to (the same lists, scores, passes and
nodes; `bench recsys` times both), and the level step of the NEZHA decoder and drafts.

The search (both engines): one `encode_history` pass gives the level-0 log-probs; then one
`score_tree` pass per further level scores the current beams' prefixes (the beams of every
earlier level form one tree per row, linked by which beam each came from, so shared prefixes
are scored once). On a model whose levels are normalised over a prefix's children
(`forced_codes_free`), a prefix with one child gives it log-prob 0 without a pass: a level's
pass scores only the beams with a choice, and a level where no beam has one costs none. At
every level only codes that lead to an item are candidates (each beam's children in the
valid-ID trie), so every finished beam is an item. An item's score is the sum of its levels'
log-probs: the exact log-likelihood of its full code tuple under the model. The last level is
the collision code.

Tie-breaking (deterministic, and what `spec_beam` reproduces): the candidates of a level are
ordered by score, descending; equal scores keep the order of (parent beam's rank, code), i.e. a
stable sort over the flattened [W, V] candidates.

Shape letters: B users, W beams, V codes of a level, C most trie children of a prefix at a
level, N tree nodes, L code levels, K results.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import Tensor

from genrec_spec.core.beam import stable_top
from genrec_spec.data_pipelines.trie import PrefixTrie
from genrec_spec.models.recsys.times import HistoryTimes
from genrec_spec.recsys.errors import DecodeOptionError
from genrec_spec.recsys.inference import inference
from genrec_spec.recsys.target import core_beam, score_level
from genrec_spec.recsys.types import Recommendations, RecommendStats

DEFAULT_MIN_BEAM_WIDTH = 20  # beam width when none is given: max(k, this)
ENGINES = ("core", "native")


@dataclass(frozen=True)
class Beams:
    """The W best prefixes of one length per row, best first."""

    code: Tensor  # [B, W] int64 the prefix's last code
    nodes: Tensor  # [B, W] int64 trie node of the prefix; -1 = empty beam (too few prefixes)
    scores: Tensor  # [B, W] float32 sum of the prefix's log-probs; -inf for empty beams
    origin: Tensor  # [B, W] int64 index of the beam of length l - 1 this one extends


def beam_width_for(k: int, beam_width: int | None, num_items: int) -> int:
    """The beam width to use; raises on k < 1, a width below k, or k over the catalogue."""
    if k < 1:
        raise DecodeOptionError(f"k must be >= 1, got {k}", "ask for at least one item")
    if k > num_items:
        raise DecodeOptionError(
            f"k = {k} is larger than the catalogue ({num_items} items)",
            f"ask for k <= {num_items}",
        )
    width = max(k, DEFAULT_MIN_BEAM_WIDTH) if beam_width is None else int(beam_width)
    if width < k:
        raise DecodeOptionError(
            f"beam_width {width} must be >= k = {k}", f"pass beam_width >= {k} or leave it unset"
        )
    return width


def check_trie(model, trie: PrefixTrie) -> None:
    """The trie must describe the model's catalogue (same levels, codebook sizes and items)."""
    if (
        tuple(trie.codebook_sizes) != tuple(model.codebook_sizes)
        or len(trie.leaf_items) != model.num_items
    ):
        raise DecodeOptionError(
            f"trie (codebook sizes {tuple(trie.codebook_sizes)}, {len(trie.leaf_items)} items) "
            f"does not match the model ({tuple(model.codebook_sizes)}, {model.num_items} items)",
            "pass genrec_spec.recsys.item_trie.item_trie(model)",
        )


def start_beams(batch: int, trie: PrefixTrie) -> Beams:
    """One beam per row: the empty prefix at the trie root, score 0."""
    origin = torch.zeros(batch, 1, dtype=torch.long, device=trie.device)
    return Beams(
        code=origin,
        nodes=trie.root(batch)[:, None],
        scores=torch.zeros(batch, 1, device=trie.device),
        origin=origin,
    )


def extend(
    beams: Beams,  # prefixes of length `level`
    log_probs: Tensor,  # [B, W, >= V] log-probs of the next code (level `level`) per beam
    trie: PrefixTrie,
    level: int,
    width: int,
) -> Beams:  # the min(width, W * V) best valid prefixes of length level + 1; -1 nodes pad
    """One beam step: the top `width` valid extensions (module docstring for the tie-breaking).

    The candidates are each beam's trie children (at most `trie.max_children[level]` per beam,
    a small part of a level's codes), read from the trie's CSR arrays in code
    order, instead of a [W, V] grid masked to the valid codes: the same candidates in the same
    order, a sort over W * C instead of W * V scores, and each child's node id for free (edge
    e leads to node e + 1)."""
    batch, beams_in = beams.nodes.shape
    vocab, most = trie.codebook_sizes[level], trie.max_children[level]
    # An empty beam (node -1, score -inf) reads the root's child slots: its candidates stay -inf.
    safe = beams.nodes.clamp(min=0)  # [B, W]
    first = trie.child_offsets[safe].long()  # [B, W] int64 (the trie stores int32)
    edge = first[..., None] + torch.arange(most, device=safe.device)  # [B, W, C]
    exists = edge < trie.child_offsets[safe + 1][..., None]  # [B, W, C]
    edge = edge.clamp(max=len(trie.child_codes) - 1)
    code = trie.child_codes[edge].long()  # [B, W, C]
    # (the root's level-0 codes an empty beam reads, like a slot past a beam's children, may lie
    # past this level's codebook, which log_probs may be no wider than: read clamped, -inf anyway)
    picked = log_probs.gather(2, code.clamp(max=log_probs.shape[2] - 1))
    candidates = beams.scores[..., None] + picked
    candidates = candidates.masked_fill(~exists, float("-inf")).flatten(1)  # [B, W * C]
    keep = min(width, candidates.shape[1])
    scores, flat = stable_top(candidates, keep)  # [B, W']
    found = torch.isfinite(scores)
    picked = edge.flatten(1).gather(1, flat)
    beams_out = Beams(
        code=code.flatten(1).gather(1, flat),
        nodes=torch.where(found, picked + 1, -1),
        scores=scores,
        origin=flat // most,
    )
    short = min(width, beams_in * vocab) - keep  # beam's width over [W, V]: pad to it
    return _pad(beams_out, short) if short > 0 else beams_out


def _pad(beams: Beams, count: int) -> Beams:
    """`count` more empty beams at the end of every row."""
    pad = torch.nn.functional.pad
    return Beams(
        code=pad(beams.code, (0, count)),
        nodes=pad(beams.nodes, (0, count), value=-1),
        scores=pad(beams.scores, (0, count), value=float("-inf")),
        origin=pad(beams.origin, (0, count)),
    )


def check_engine(engine: str) -> None:
    if engine not in ENGINES:
        raise DecodeOptionError(f"unknown engine {engine!r}", f"use one of {', '.join(ENGINES)}")


def finish(
    beams: Beams,  # full code tuples (length L)
    trie: PrefixTrie,
    k: int,
) -> tuple[Tensor, Tensor]:  # items [B, K] (-1 pads), scores [B, K] (-inf pads)
    leaf = (beams.nodes[:, :k] - trie.level_starts[-2]).clamp(min=0)
    real = beams.nodes[:, :k] >= 0
    items = torch.where(real, trie.leaf_items[leaf].long(), -1)
    scores = beams.scores[:, :k]
    if items.shape[1] < k:  # fewer candidates than k in the whole last level
        pad = k - items.shape[1]
        items = torch.nn.functional.pad(items, (0, pad), value=-1)
        scores = torch.nn.functional.pad(scores, (0, pad), value=float("-inf"))
    return items, scores


def search(
    model,  # SemanticIdRecommender
    state,  # HistoryState of B users (`model.encode_history`)
    trie: PrefixTrie,
    width: int,  # W
) -> tuple[list[Beams], int, int]:  # the beams of every length 1..L, passes, nodes scored
    """The beam search from an encoded history: one `score_tree` pass per level after the
    first. On a model whose forced codes are free (`forced_codes_free`: a prefix's only child
    gets log-prob 0, the value the pass would give) the pass scores only the beams with a choice
    of code, in the rows that have one, and a level where no beam has one costs none. Passes
    count the history pass."""
    batch = state.lengths.numel()
    beams = extend(start_beams(batch, trie), state.level0_log_probs[:, None], trie, 0, width)
    history, passes, nodes_scored = [beams], 1, 0
    for level in range(1, model.num_levels):
        scored = beams.nodes >= 0
        if model.forced_codes_free:
            scored &= trie.has_choice(beams.nodes)
        # [B, W, >= V] each beam's log-probs of the next code; a forced one's is 0
        out, nodes = score_level(
            model, state, [b.code for b in history], [b.origin for b in history], scored
        )
        if nodes is not None:
            passes += 1
            nodes_scored += int(nodes)
        beams = extend(beams, out, trie, level, width)
        history.append(beams)
    return history, passes, nodes_scored


@inference
def decode(
    model,  # SemanticIdRecommender
    values: Tensor,  # [M] int64 history item indices, oldest first within a row
    offsets: Tensor,  # [B+1] int64
    *,
    k: int,
    trie: PrefixTrie,
    beam_width: int | None = None,  # W >= k; None = max(k, DEFAULT_MIN_BEAM_WIDTH)
    # "core": the engine's beam_search on the recommender as a Target (recsys.target);
    # "native": this module's search, a level at a time (the same lists)
    engine: str = "core",
    times: HistoryTimes | None = None,  # a time-aware model's (`models.recsys.times`)
) -> Recommendations:
    start_time = time.perf_counter()
    width = beam_width_for(k, beam_width, model.num_items)
    check_trie(model, trie)
    check_engine(engine)
    if engine == "core":
        return core_beam(model, values, offsets, k, width, start_time, times=times)
    state = model.encode_history(values, offsets, times)
    history, passes, nodes_scored = search(model, state, trie, width)
    items, scores = finish(history[-1], trie, k)
    return Recommendations(
        items=items,
        scores=scores,
        stats=RecommendStats(
            target_passes=passes,
            nodes_scored=nodes_scored,
            wall_time_s=time.perf_counter() - start_time,
            truncated_histories=int(state.truncated.sum()),
        ),
    )

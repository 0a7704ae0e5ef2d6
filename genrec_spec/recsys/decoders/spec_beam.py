"""Lossless speculative beam search over Semantic IDs: `beam`'s exact top-K in fewer passes.

    decode(model, values, offsets, *, k, trie, beam_width=None, draft="auto", draft_items=None,
           lookahead=None, draft_width=None, item_search="auto", engine="core",
           plain_from="auto") -> Recommendations

Trie-constrained beam search needs, at level l, the target's log-probs of level l at each of the
W beams (prefixes of length l). Which prefixes those are is known only after level l - 1 was
selected, so `beam` pays one sequential target pass per level. Here:

1. Draft: pick trie prefixes the beam is likely to need. Before any target pass: `"frontier"`
   takes the whole first level of the trie (every level-0 code), so whichever codes the target
   ranks top-W, they are scored; `draft_items` adds the prefixes of given items (any retrieval
   result). After the history pass: `"items"` takes, at every prefix length 2..L-1, the
   `draft_width` (default W + 4.5 sqrt(W), `default_draft_width`) prefixes under which the
   model's item objective puts the most
   probability (one [B, D] x [D, I] product: on a model whose code levels are tied to that
   objective a prefix's beam score is close to the log of that mass; from
   `ItemIndexConfig.min_items` items on, or with `item_search="index"`, the prefixes of the
   items the approximate item index finds instead, `recsys.item_index`); `"heads"` the same
   from the parallel level heads' item distribution (every level predicted from the history
   at once; no item objective needed, the whole catalogue scored); `"nezha"` runs the
   model's NEZHA draft head's trie-constrained beam (width `draft_width`, default 2 W) from the
   exact level-0 beams down to prefixes of length L - 1. `"none"` drafts nothing. `"auto"`
   (default): "items" on a model with the item objective, else "frontier".
2. One fused target pass scores the history AND the pre-history draft
   (`model.encode_history_and_tree`).
3. Beam selection runs level by level on the target's exact log-probs looked up at the beams'
   nodes, through the very selection of plain beam search (same candidates, same
   tie-breaking), so the result is `beam`'s up to float rounding.
4. Beams whose prefix is unscored get a follow-up `score_tree` pass, of the rows that have
   any: the missing prefixes, the not yet scored post-history draft (so the first follow-up is
   that draft's pass), and the unscored descendants of every current beam `lookahead` levels
   down (1: the children, the only prefixes the next level can need; L - 2: all the rest of
   the decode can need, so at most one follow-up; default 0 after a post-history draft, else
   1), plus their ancestors as context.

Both engines score through `recsys.spec_levels` (the drafts, the prefixes scored, the
follow-ups): `engine="core"` (the default) hands it to the core's `beam_search` on the model as
a core target (`recsys.target`), whose step read asks it and whose selection is the core's;
`engine="native"` selects with `beam.extend`, a level at a time (the reference, as `beam`'s):
the same lists, passes, nodes and draft stats.

On a model whose code levels are normalised over a prefix's children (`forced_codes_free`), a
prefix with one child gives it log-prob exactly 0, so such prefixes are never drafted, needed
or scored (most deeper prefixes of a catalogue have one child). With 3 code
levels + the collision code (L = 4) and the frontier draft, pass 1 covers levels 0 and 1, the
follow-up at level 2 covers levels 2 and 3: 2 sequential passes instead of 4, whatever the
model says.

What it saves is sequential passes; what it pays is the drafted nodes and the draft itself.
On a CPU a tree node costs real compute (its feed-forward, attention and the tied levels' item
windows) and a pass little more than its nodes, so the gain is largest at batch 1 and with wide
beams, and in large batches the drafted nodes can cost more than the saved passes; it pays most
where a pass's fixed cost dominates a node's (an accelerator). In a wide step (many rows times
many beams) some row misses the draft at every level, so the follow-ups save no pass at all:
from `plain_from` beams a step (batch x width; by default `PLAIN_FROM_CPU` on a CPU) the decode
runs as `beam`. `genrec-spec bench recsys` measures it, with the exact floor no exact decoder
can beat (docs/results).

Stats (`RecommendStats`): target_passes, nodes_scored (real tree nodes over all passes),
draft_nodes (prefixes drafted), draft_hit_rate (needed prefixes that some draft proposed),
wall_time_s, truncated_histories.

Shape letters: B users, W beams, N tree nodes, V codes, L code levels, R drafted items.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
from torch import Tensor

from genrec_spec.data_pipelines.trie import PrefixTrie
from genrec_spec.models.recsys.times import HistoryTimes
from genrec_spec.recsys.decoders.beam import (
    beam_width_for,
    check_engine,
    check_trie,
    extend,
    finish,
    start_beams,
)
from genrec_spec.recsys.decoders.beam import decode as plain_beam
from genrec_spec.recsys.decoders.dense import check_item_objective
from genrec_spec.recsys.decoders.nezha import draft_head_of
from genrec_spec.recsys.drafters import AFTER_HISTORY
from genrec_spec.recsys.errors import DecodeOptionError
from genrec_spec.recsys.inference import inference
from genrec_spec.recsys.item_index import use_index
from genrec_spec.recsys.scoring import check_candidates
from genrec_spec.recsys.spec_levels import SpecLevels
from genrec_spec.recsys.target import core_beam
from genrec_spec.recsys.types import Recommendations, RecommendStats

DRAFTS = ("auto", "frontier", "items", "heads", "nezha", "none")


@dataclass(frozen=True)
class SpecBeamConfig:
    """Defaults of the `spec_beam` options."""

    # What is drafted: "frontier" (pass 1 scores it with the history), "items", "heads" or
    # "nezha" (after the history pass, they ride on the first follow-up), "none", or "auto":
    # "items" when the model has the item objective, else "frontier".
    draft: str = "auto"
    # "items", "heads": prefixes per length; "nezha": beam width; None: `default_draft_width`
    draft_width: int | None = None
    # "items" through the item index (`item_index.use_index`: "exact", "index", or "auto": the
    # index from `ItemIndexConfig.min_items` items on)
    item_search: str = "auto"
    # Levels of the current beams' descendants a follow-up pass also scores (0: only the
    # missing prefixes; 1: their children; L - 2: all the decode can still need). None: 0 with
    # a draft made after the history pass (follow-ups for its misses only), else 1.
    lookahead: int | None = None
    # Beams a step (batch x width) from which a decode runs as `beam` (the same lists): in wide
    # steps some row misses the draft at every level, so the follow-ups save no pass while the
    # drafted nodes cost. "auto": PLAIN_FROM_CPU beams on a CPU, never on another device (on a
    # GPU the measured crossover did not follow the batch); a number: that many on any
    # device; "never".
    plain_from: int | str = "auto"


# The "items" draft's default width is W + this x sqrt(W) prefixes a length: the W prefixes the
# beam keeps are mostly among the most probable W by the item objective, give or take a band
# that grows like sqrt(W). Measured on ML-1M's default model at W = 20, 50, 100 and 200
# (docs/results/recsys-speed.md, "The items draft's width"), against 2 W: about the same at
# W = 20, faster from W = 50 on (fewer drafted nodes, hardly more follow-ups).
ITEMS_DRAFT_BAND = 4.5


def default_draft_width(draft: str, width: int) -> int:
    """The draft width when none is given, for a beam of `width`: the "items" draft's
    `ITEMS_DRAFT_BAND` rule; 2 W for "heads" and "nezha" (not measured otherwise)."""
    if draft == "items":
        return width + math.ceil(ITEMS_DRAFT_BAND * math.sqrt(width))
    return 2 * width


# Measured on a 2-core AMD EPYC (docs/results/recsys-speed.md, "spec_beam in batches"): drafting
# lost from 16 rows at W=20 and W=100, from 8 at W=50, and broke even at 4 at W=200.
PLAIN_FROM_CPU = 512


def runs_plain(plain_from: int | str, beams: int, device: torch.device) -> bool:
    """Whether a decode of `beams` beams a step (batch x width) on `device` runs as `beam`;
    raises on a bad `plain_from`."""
    if plain_from == "auto":
        return device.type == "cpu" and beams >= PLAIN_FROM_CPU
    if plain_from == "never":
        return False
    if isinstance(plain_from, bool) or not isinstance(plain_from, int) or plain_from < 1:
        raise DecodeOptionError(
            f'plain_from must be "auto", "never" or a number of beams >= 1, got {plain_from!r}',
            'leave it unset ("auto"), or pass e.g. plain_from=1024',
        )
    return beams >= plain_from


def resolve_draft(model, draft: str) -> str:
    """The draft "auto" stands for on this model; raises on an unknown draft or one the model
    cannot make, before any work."""
    if draft not in DRAFTS:
        raise DecodeOptionError(
            f"unknown draft {draft!r}; valid drafts: {', '.join(DRAFTS)}",
            'pass one of them, or leave draft unset ("auto")',
        )
    if draft == "auto":
        draft = "items" if model.item_objective is not None else "frontier"
    if draft == "nezha":
        draft_head_of(model)
    if draft == "heads" and model.parallel_heads is None:
        raise DecodeOptionError(
            "the heads draft needs the model's parallel level heads",
            'train with model.parallel_heads = true or use draft "items", "nezha" or "frontier"',
        )
    if draft == "items":
        check_item_objective(model, "the items draft")
    return draft


def resolve_options(
    model, draft: str, lookahead: int | None, draft_width: int | None
) -> tuple[str, int]:
    """(the draft, the lookahead) the options stand for on this model; raises on bad ones
    before any work."""
    draft = resolve_draft(model, draft)
    if lookahead is None:
        lookahead = 0 if draft in AFTER_HISTORY else 1
    if not isinstance(lookahead, int) or lookahead < 0:  # a bool is 0 or 1
        raise DecodeOptionError(
            f"lookahead must be an integer >= 0 (levels), got {lookahead!r}",
            "pass 0, 1, ... or leave it unset",
        )
    if draft_width is not None and draft_width < 1:
        raise DecodeOptionError(
            f"draft_width must be >= 1, got {draft_width}",
            "pass a positive width or leave it unset",
        )
    return draft, lookahead


def same_top_k(
    # Recommendations, or anything else with items [B, K] and scores [B, K] (a replay arm's run)
    reference,  # e.g. beam's
    other,  # e.g. spec_beam's, same B and K
    atol: float = 1e-4,
) -> Tensor:  # [B] bool, True where other's list is reference's up to float rounding
    """Rows where both lists hold the same scores position by position (within atol) and the
    same items, except that items whose reference scores are within atol of each other may come
    in either order, and a slot tied with the reference's last may hold an item the reference
    left out (which of tied items makes the list is rounding too): two decoders scoring one
    prefix in different trees differ in the last bits of a log-prob, which can only reorder
    near-exact ties."""
    a, b = reference.scores, other.scores
    close = ((a - b).abs() <= atol) | ((a == b) & torch.isinf(a))  # [B, K]
    same = reference.items[:, None, :] == other.items[:, :, None]  # [B, K(other), K(ref)]
    gap = (a[:, :, None] - a[:, None, :]).abs()
    tied = (gap <= atol) | ((a[:, :, None] == a[:, None, :]) & torch.isinf(a)[:, :, None])
    found = (same & tied).any(dim=2)  # other's item i sits among ref's near-ties of slot i
    at_boundary = (a - a[:, -1:]).abs() <= atol  # [B, K] slots tied with ref's last score
    found |= at_boundary & ~same.any(dim=2)  # a tied item the reference did not list
    return (close & found).all(dim=1)


@inference
def decode(
    model,  # SemanticIdRecommender
    values: Tensor,  # [M] int64 history item indices, oldest first within a row
    offsets: Tensor,  # [B+1] int64
    *,
    k: int,
    trie: PrefixTrie,
    beam_width: int | None = None,  # W >= k; None = beam's default, max(k, 20)
    draft: str = SpecBeamConfig.draft,
    draft_items: Tensor | None = None,  # [B, R] int64 items whose prefixes pass 1 also scores
    lookahead: int | None = SpecBeamConfig.lookahead,  # descendant levels per follow-up
    draft_width: int | None = SpecBeamConfig.draft_width,  # "items"/"heads"/"nezha" width
    item_search: str = SpecBeamConfig.item_search,  # "items" draft: "exact", "index" or "auto"
    # "core": the engine's beam_search with these drafts as its drafter (`recsys.spec_levels`);
    # "native": this module's search, a level at a time (the same lists)
    engine: str = "core",
    # beams a step (batch x width) from which it decodes as `beam` (SpecBeamConfig.plain_from)
    plain_from: int | str = SpecBeamConfig.plain_from,
    times: HistoryTimes | None = None,  # a time-aware model's (`models.recsys.times`)
) -> Recommendations:
    start_time = time.perf_counter()
    width = beam_width_for(k, beam_width, model.num_items)
    draft, lookahead = resolve_options(model, draft, lookahead, draft_width)
    draft_width = draft_width or default_draft_width(draft, width)
    use_index(model, item_search)  # raises on a bad value before any work
    check_trie(model, trie)
    check_engine(engine)
    batch = offsets.numel() - 1
    if draft_items is not None:
        check_candidates(model, draft_items, batch)
    if runs_plain(plain_from, batch * width, values.device):
        return plain_beam(
            model, values, offsets, k=k, trie=trie, beam_width=width, engine=engine, times=times
        )
    draft_codes = None if draft_items is None else model.item_codes[draft_items]
    levels = SpecLevels(model, trie, draft, draft_width, item_search, lookahead, draft_codes)
    if engine == "core":
        return core_beam(model, values, offsets, k, width, start_time, levels, times)
    state, nodes_scored = levels.history_pass(values, offsets, times)
    passes = 1
    beams = extend(start_beams(batch, trie), state.level0_log_probs[:, None], trie, 0, width)
    for level in range(1, model.num_levels):
        step, nodes = levels.log_probs(beams.nodes)  # [B, W, >= V]
        if nodes is not None:
            passes, nodes_scored = passes + 1, nodes_scored + nodes
        beams = extend(beams, step, trie, level, width)
    items, scores = finish(beams, trie, k)
    drafted, needed, hits = levels.counts()
    return Recommendations(
        items=items,
        scores=scores,
        stats=RecommendStats(
            target_passes=passes,
            nodes_scored=nodes_scored,
            wall_time_s=time.perf_counter() - start_time,
            truncated_histories=int(state.truncated.sum()),
            draft_nodes=drafted,
            draft_hit_rate=int(hits) / max(int(needed), 1),
        ),
    )

"""Lossless speculative beam search over Semantic IDs: `beam`'s exact top-K in fewer passes.

    decode(model, values, offsets, *, k, trie, beam_width=None, draft="frontier",
           draft_items=None, lookahead=True) -> Recommendations

Trie-constrained beam search needs, at level l, the target's log-probs of level l at each of the
W beams (prefixes of length l). Which prefixes those are is known only after level l - 1 was
selected, so `beam` pays one sequential target pass per level. Here:

1. Draft: before any target pass, pick trie prefixes the beam is likely to need. `"frontier"`
   (default) takes the whole first level of the trie (every level-0 code): whichever codes the
   target ranks top-W, they are scored. `draft_items` adds the prefixes of given items (any
   retrieval result); `"none"` drafts nothing (every level then needs a follow-up pass).
2. One fused target pass scores the history AND the draft tree (`scoring.encode_with_tree`).
3. Beam selection runs level by level on the target's exact log-probs looked up at the beams'
   nodes, through the very `beam.extend` of plain beam search (same masking, same
   tie-breaking), so the result is `beam`'s up to float rounding.
4. Beams whose prefix the draft missed are scored in a follow-up `score_tree` pass: the missing
   prefixes and, with `lookahead`, the unscored children of every current beam (the only
   prefixes the next level can need), plus their ancestors as context.

With 3 code levels + the collision code (L = 4) and the frontier draft, pass 1 covers levels 0
and 1, the follow-up at level 2 covers levels 2 and 3: 2 sequential passes instead of 4,
whatever the model says. The draft costs compute (V0 = 256 extra tree nodes per row): on a
2-core CPU with this project's 2-layer, 64-wide models that costs about what the two saved passes
cost, so batch-1 latency breaks even with `beam` and large batches lose throughput. The saving
pays where a pass's fixed cost dominates a tree node's (an accelerator; not measured here).
Drafts from the parallel or NEZHA heads (which need the history pass first) or from an ANN over
item text embeddings were measured to miss needed prefixes for nearly every user (trained ML-100K,
W = 20), so they would add follow-up passes rather than save them; they are not offered.

Stats: "target_passes", "nodes_scored" (real tree nodes over all passes), "draft_nodes" (in
pass 1), "draft_hit_rate" (needed prefixes found in the pass-1 draft), "wall_time_s",
"truncated_histories".

Shape letters: B users, W beams, N tree nodes, V codes, L code levels, R drafted items.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import Tensor

from genrec_spec.data_pipelines.trie import PrefixTrie
from genrec_spec.recsys.beam import (
    DecodeOptionError,
    beam_width_for,
    check_trie,
    extend,
    finish,
    start_beams,
)
from genrec_spec.recsys.scoring import (
    PrefixTree,
    TrieIndex,
    check_candidates,
    encode_with_tree,
    prefix_nodes,
    prefix_tree,
)
from genrec_spec.recsys.types import Recommendations

DRAFTS = ("frontier", "none")


@dataclass(frozen=True)
class SpecBeamConfig:
    """Defaults of the `spec_beam` options."""

    draft: str = "frontier"  # what pass 1 scores beside the history: "frontier" | "none"
    lookahead: bool = True  # follow-up passes also score the children of the current beams


@dataclass(frozen=True)
class ScoredNodes:
    """The target's log-probs at every prefix scored so far, per row."""

    slots: Tensor  # [B, scorable] int64 index into log_probs' node axis; -1 = not scored
    log_probs: Tensor  # [B, N, Vmax] next-level log-probs of the scored nodes

    def add(self, tree: PrefixTree, log_probs: Tensor) -> ScoredNodes:
        """Nodes already scored keep their first value (a rescored ancestor is only context)."""
        new = torch.where(tree.slots >= 0, tree.slots + self.log_probs.shape[1], -1)
        return ScoredNodes(
            slots=torch.where(self.slots >= 0, self.slots, new),
            log_probs=torch.cat([self.log_probs, log_probs], dim=1),
        )

    def lookup(self, nodes: Tensor) -> Tensor:  # nodes: [B, W] -> [B, W] slot, -1 = unscored
        return torch.where(nodes >= 0, self.slots.gather(1, nodes.clamp(min=0)), -1)


def draft_member(
    trie: PrefixTrie,
    index: TrieIndex,
    batch: int,
    draft: str,
    draft_codes: Tensor | None,  # [B, R, L] int64 Semantic IDs of items whose prefixes are drafted
) -> Tensor:  # [B, scorable] bool trie nodes to score in the first pass
    if draft not in DRAFTS:
        raise DecodeOptionError(f"unknown draft {draft!r}; valid drafts: {', '.join(DRAFTS)}")
    member = torch.zeros(batch, index.scorable, dtype=torch.bool, device=trie.device)
    if draft == "frontier":
        member[:, 1 : trie.level_starts[2]] = True  # every length-1 prefix
    if draft_codes is not None:
        member.scatter_(1, prefix_nodes(trie, draft_codes).flatten(1), True)
    return member


def children_member(
    trie: PrefixTrie,
    nodes: Tensor,  # [B, W] int64 trie nodes (-1 = none), all of prefix length <= L - 2
    scorable: int,
) -> Tensor:  # [B, scorable] bool, True at every child of the given nodes
    """Node n's children are the consecutive ids child_offsets[n] + 1 .. child_offsets[n+1]
    (edge e leads to node e + 1); mark those ranges with one difference array per row."""
    real = (nodes >= 0).long()
    safe = nodes.clamp(min=0)
    delta = torch.zeros(nodes.shape[0], len(trie.child_codes) + 2, dtype=torch.long)
    delta = delta.to(nodes.device)
    delta.scatter_add_(1, trie.child_offsets[safe] + 1, real)
    delta.scatter_add_(1, trie.child_offsets[safe + 1] + 1, -real)
    return delta.cumsum(dim=1)[:, :scorable] > 0


def same_top_k(
    reference: Recommendations,  # e.g. beam's
    other: Recommendations,  # e.g. spec_beam's, same B and K
    atol: float = 1e-4,
) -> Tensor:  # [B] bool, True where other's list is reference's up to float rounding
    """Rows where both lists hold the same scores position by position (within atol) and the
    same items, except that items whose reference scores are within atol of each other may come
    in either order: two decoders scoring one prefix in different trees differ in the last bits
    of a log-prob, which can only reorder near-exact ties."""
    a, b = reference.scores, other.scores
    close = ((a - b).abs() <= atol) | ((a == b) & torch.isinf(a))  # [B, K]
    same = reference.items[:, None, :] == other.items[:, :, None]  # [B, K(other), K(ref)]
    gap = (a[:, :, None] - a[:, None, :]).abs()
    tied = (gap <= atol) | ((a[:, :, None] == a[:, None, :]) & torch.isinf(a)[:, :, None])
    found = (same & tied).any(dim=2)  # other's item i sits among ref's near-ties of slot i
    return (close & found).all(dim=1)


@torch.no_grad()
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
    lookahead: bool = SpecBeamConfig.lookahead,
) -> Recommendations:
    start_time = time.perf_counter()
    width = beam_width_for(k, beam_width, model.num_items)
    check_trie(model, trie)
    batch = offsets.numel() - 1
    draft_codes = None
    if draft_items is not None:
        check_candidates(model, draft_items, batch)
        draft_codes = model.item_codes[draft_items]
    index = TrieIndex.of(trie)
    first = prefix_tree(index, draft_member(trie, index, batch, draft, draft_codes))
    state, log_probs = encode_with_tree(model, values, offsets, first)
    scored = ScoredNodes(first.slots, log_probs)
    passes, nodes_scored = 1, first.real_nodes
    needed = hits = torch.zeros((), dtype=torch.long)
    rows = torch.arange(batch, device=offsets.device)[:, None]

    beams = extend(start_beams(batch, trie), state.level0_log_probs[:, None], trie, 0, width)
    for level in range(1, model.num_levels):
        slot = scored.lookup(beams.nodes)  # [B, W]
        real = beams.nodes >= 0
        needed = needed + real.sum()
        hits = hits + (real & (first.slots.gather(1, beams.nodes.clamp(min=0)) >= 0)).sum()
        missing = real & (slot < 0)
        if bool(missing.any()):  # a follow-up pass only when some row needs one
            want = torch.zeros_like(first.slots, dtype=torch.bool)
            want[rows.expand_as(missing)[missing], beams.nodes[missing]] = True
            if lookahead and level + 1 < model.num_levels:
                want |= children_member(trie, beams.nodes, index.scorable) & (scored.slots < 0)
            tree = prefix_tree(index, want)
            out = model.score_tree(state, tree.codes, tree.levels, tree.parents)
            scored = scored.add(tree, out)
            passes, nodes_scored = passes + 1, nodes_scored + tree.real_nodes
            slot = scored.lookup(beams.nodes)
        beams = extend(beams, scored.log_probs[rows, slot.clamp(min=0)], trie, level, width)
    items, scores = finish(beams, trie, k)
    return Recommendations(
        items=items,
        scores=scores,
        stats={
            "target_passes": passes,
            "nodes_scored": nodes_scored,
            "draft_nodes": first.real_nodes,
            "draft_hit_rate": float(hits) / max(int(needed), 1),
            "wall_time_s": time.perf_counter() - start_time,
            "truncated_histories": int(state.truncated.sum()),
        },
    )

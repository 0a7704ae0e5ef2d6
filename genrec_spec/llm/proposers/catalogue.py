"""Drafts from a catalogue: what the catalogue trie makes certain (or likely) next.

- ``CatalogueProposer`` (``generate``): below each row's last token, the chain of tokens the
  catalogue forces (a prefix naming one item continues in one way only); deterministic, and a
  draft that cannot miss under the catalogue constraint (the target may still prefer another
  token where the constraint is off).
- ``CatalogueDrafter`` (``beam_search``): below every beam, forced continuations and the
  children of nodes with few items below them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from genrec_spec.core.beam_tree import BeamTree, rank_within_rows
from genrec_spec.core.constraints import Catalogue, ConstrainedTrees
from genrec_spec.core.tree import chain
from genrec_spec.core.types import Acceptance, DecodeInputError, DecodeState, DraftTree


class CatalogueProposer:
    draft_cost = 0.0
    hidden_layers: tuple[int, ...] = ()

    def __init__(self, catalogue: Catalogue, k: int = 16) -> None:
        if k < 1:
            raise DecodeInputError(f"k={k}", "draft at least one token (k >= 1)")
        self.catalogue, self.k = catalogue, k
        self.rows: ConstrainedTrees | None = None  # each row's trie node after its output

    def begin(self, state: DecodeState) -> None:
        self.rows = ConstrainedTrees(self.catalogue, state.batch_size, state.tokens.device)

    def observe(self, state: DecodeState, acceptance: Acceptance) -> None:
        self.rows.advance(acceptance.tokens[:, : int(state.counts.max())], state.counts)

    def propose(self, state: DecodeState, budget: int) -> DraftTree:
        trie, node = self.catalogue.trie, self.rows.states
        drafts = []
        for _ in range(min(budget, self.k)):
            token = trie.forced(node)  # [B], -1 where the next token is a choice
            drafts.append(token)
            node = trie.step(node, token.clamp_min(0))
        tokens = torch.stack(drafts, dim=1)  # [B, K]
        valid = (tokens >= 0).long().cumprod(1).bool()  # a row's chain stops at its first choice
        depth = int(valid.sum(1).max())  # trim to the longest chain: no target work for nothing
        return chain(state.roots, tokens[:, :depth].clamp_min(0), valid[:, :depth])


@dataclass
class CatalogueDrafter:
    """Drafts what a catalogue makes likely or certain: below every beam, the children of each
    node with at most ``items`` catalogue items below it (1: the forced continuations of a
    prefix that names one item, drafts that cannot miss; 2: also a title's two years), or at
    most ``fanout`` children, down to ``depth`` levels, a level at a time (so a small budget
    goes to the nearest nodes of every beam first)."""

    catalogue: Catalogue
    depth: int = 16
    fanout: int = 1
    items: int = 1

    def draft(self, tree: BeamTree, rows: Tensor, nodes: Tensor, budget: int, cache) -> None:
        """``BeamDrafter.draft``: a level at a time below the frontier (rows, nodes [F]); the
        catalogue alone decides, so the target's cache is not read."""
        trie, left = self.catalogue.trie, torch.full((tree.batch,), budget)
        states = tree.states[rows, nodes]  # [F]
        for _ in range(self.depth):
            if not len(rows):
                return
            tokens, exists = trie.children_of(states)  # [F, C]
            few = (states >= 0) & (self.catalogue.items_below[states.clamp_min(0)] <= self.items)
            exists &= (few | (exists.sum(1) <= self.fanout))[:, None]
            at, slot = exists.nonzero(as_tuple=True)  # frontier order, then token order
            rows, parents, tokens = rows[at], nodes[at], tokens[at, slot]
            states = trie.step(states[at], tokens)
            nodes = tree.child(rows, parents, tokens)  # [F'] -1: not planned yet
            new = (nodes < 0).nonzero()[:, 0]
            take = new[rank_within_rows(rows[new], tree.batch) < left[rows[new]]]
            nodes[take] = tree.add(rows[take], parents[take], tokens[take], states[take])
            left -= torch.bincount(rows[take], minlength=tree.batch)
            kept = nodes >= 0  # over budget: not drafted, nor anything below it
            rows, nodes, states = rows[kept], nodes[kept], states[kept]

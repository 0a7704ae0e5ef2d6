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

from genrec_spec.core.beam_tree import BeamTree, Planned
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

    def draft(
        self,
        tree: BeamTree,
        row: int,
        frontier: list[tuple[int, int]],
        plan: list[Planned],
        budget: int,
    ) -> None:
        level = frontier
        for _ in range(self.depth):
            below = []
            for node, state in level:
                options = self.catalogue.children(state)
                few = state >= 0 and self.catalogue.items_below[state] <= self.items
                if len(options) > self.fanout and not few:
                    continue
                for token, child_state in options:
                    child = tree.child(row, node, token)
                    if child < 0:
                        if budget == 0:
                            return
                        child = tree.add(row, plan, node, token, child_state)
                        budget -= 1
                    below.append((child, child_state))
            level = below

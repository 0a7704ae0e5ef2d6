"""Drafts from a catalogue for ``generate``: what the catalogue trie makes certain next.

``CatalogueProposer``: below each row's last token, the chain of tokens the catalogue forces (a
prefix naming one item continues in one way only); deterministic, and a draft that cannot miss
under the catalogue constraint (the target may still prefer another token where the constraint
is off). Its beam search twin is ``core.catalogue_drafter.CatalogueDrafter``.
"""

from __future__ import annotations

import torch

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

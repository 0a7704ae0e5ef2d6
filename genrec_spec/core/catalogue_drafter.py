"""The catalogue's beam drafter: what the catalogue trie makes certain (or likely) below every
beam of ``beam_search``: forced continuations and the children of nodes with few items below
them. It reads the catalogue alone, so it serves every target (an LLM naming titles, the
recommender's codes)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from genrec_spec.core.beam_tree import BeamTree, rank_within_rows
from genrec_spec.core.constraints import Catalogue


@dataclass
class CatalogueDrafter:
    """Drafts what a catalogue makes likely or certain: below every beam, the children of each
    node with at most ``items`` catalogue items below it (1: the forced continuations of a
    prefix that names one item, drafts that cannot miss; 2: also a title's two years), or at
    most ``fanout`` children, down to ``depth`` levels, a level at a time (so a small budget
    goes to the nearest nodes of every beam first). The search runs under this catalogue: the
    tree's states are its trie nodes."""

    catalogue: Catalogue
    depth: int = 16
    fanout: int = 1
    items: int = 1

    def begin(self, tokens: Tensor, lengths: Tensor) -> None:
        """``BeamDrafter.begin``: the catalogue beside the search's tables (on the target's
        device); nothing else to keep (the tree holds each node's catalogue state)."""
        self.catalogue = self.catalogue.to(tokens.device)

    def draft(self, tree: BeamTree, rows: Tensor, nodes: Tensor, budget: int, cache) -> None:
        """``BeamDrafter.draft``: a level at a time below the frontier (rows, nodes [F]); the
        catalogue alone decides, so the target's cache is not read."""
        trie, left = self.catalogue.trie, torch.full((tree.batch,), budget, device=tree.device)
        for _ in range(self.depth):
            if not len(rows):
                return
            # [F] each frontier node's catalogue state: the tree derives it (the search runs
            # under this catalogue)
            states = tree.states[rows, nodes]
            edges, exists = trie.child_edges(states)  # [F, C]
            few = (states >= 0) & (self.catalogue.items_below[states.clamp_min(0)] <= self.items)
            exists &= (few | (exists.sum(1) <= self.fanout))[:, None]
            at, slot = exists.nonzero(as_tuple=True)  # frontier order, then token order
            rows, parents, edges = rows[at], nodes[at], edges[at, slot]
            tokens = trie.child_tokens[edges]
            nodes = tree.child(rows, parents, tokens)  # [F'] -1: not planned yet
            new = (nodes < 0).nonzero()[:, 0]
            take = new[rank_within_rows(rows[new]) < left[rows[new]]]
            # (the children's catalogue states come with them: the tree need not step to them)
            states = edges[take] + 1
            nodes[take] = tree.add(rows[take], parents[take], tokens[take], states)
            left -= torch.bincount(rows[take], minlength=tree.batch)
            kept = nodes >= 0  # over budget: not drafted, nor anything below it
            rows, nodes = rows[kept], nodes[kept]

"""The recommender's drafts (``spec_beam``'s "items", "heads", "nezha", "frontier" and the
prefixes of given items), for both engines: as trie node sets (the native decoder's), and as
the core's ``BeamDrafter`` (``spec_beam`` on the core).

    drafter = RecommenderDrafter(target, catalogue, trie, width=W, kind="items", ...)
    out = beam_search(target, histories, constraint=catalogue, drafter=drafter, ...)

The core drafter makes the drafts where the native decoder makes them. The target's first
grow is the history pass (``RecommenderTarget``), so what can be drafted before the histories
are read (the frontier, given items) is planned below the roots and scored in that pass. A
drafter receives the target's cache: at the next pass (the level-0 beams') it reads the
encoded histories there and plans the drafts made from them ("items", "heads", "nezha"), the native
decoder's first follow-up. Prefixes whose next code is free (``forced_codes_free``) are not
drafted; their ancestors are planned as parents (the engine knows a forced node's candidates
without the target). Every pass after the history's also drafts the beams' descendants
``lookahead`` levels down (the catalogue's children: ``CatalogueDrafter``), the native
decoder's lookahead.

Recsys trie nodes (``data_pipelines.trie.PrefixTrie``, level-ordered) become core tree nodes
(``core.beam_tree.BeamTree``) in one ``add``: a prefix's token is its code at its level's offset
in the target's code vocabulary (one block a level), its parent the core node of its trie parent,
and a prefix the tree holds already is found by its catalogue state (one per prefix).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from genrec_spec.core.beam_tree import BeamTree, rank_within_rows
from genrec_spec.core.catalogue_drafter import CatalogueDrafter
from genrec_spec.core.constraints import Catalogue
from genrec_spec.data_pipelines.trie import PrefixTrie
from genrec_spec.models.derived import DerivedCache
from genrec_spec.recsys.decoders.beam import Beams, extend, start_beams
from genrec_spec.recsys.decoders.dense import item_log_probs
from genrec_spec.recsys.decoders.heads import item_scores
from genrec_spec.recsys.decoders.nezha import head_beams
from genrec_spec.recsys.item_index import top_items, use_index
from genrec_spec.recsys.scoring import NodeSet, TrieIndex, item_prefixes, prefix_nodes
from genrec_spec.recsys.target import RecommenderTarget

# The "items" draft through the index retrieves this many items per drafted prefix of a length
# (the prefixes of the items of highest logit hold most of the mass).
DRAFT_ITEMS_PER_PREFIX = 2
# (trie, item codes) -> the distinct longer prefixes of every item (ascending), and the column of
# each (length, item) among them: the exact "items" draft's, the same for every decode
_DEEPER = DerivedCache()
# catalogue -> each scorable recsys trie prefix's catalogue state (`RecommenderDrafter._plan`)
_STATES = DerivedCache()


def draft_member(
    trie: PrefixTrie,
    index: TrieIndex,
    batch: int,
    draft: str,
    draft_codes: Tensor | None,  # [B, R, L] int64 Semantic IDs of items whose prefixes are drafted
) -> NodeSet:  # the trie nodes to score in the first pass
    nodes = [torch.zeros(batch, 0, dtype=torch.long, device=trie.device)]  # [B, *] each
    if draft == "frontier":  # every length-1 prefix
        nodes.append(torch.arange(1, trie.level_starts[2], device=trie.device).expand(batch, -1))
    if draft_codes is not None:
        nodes.append(prefix_nodes(trie, draft_codes).flatten(1))
    return index.rowwise(torch.cat(nodes, dim=1))


def head_draft(
    model,  # SemanticIdRecommender with a draft head
    state,  # HistoryState of B users
    beams: Beams,  # [B, W] the exact level-0 beams
    trie: PrefixTrie,
    width: int,  # the draft beam's width
) -> NodeSet:  # the level-0 beams and every prefix the draft beam keeps
    """The "nezha" draft: the draft head's beam (`nezha.head_beams`) from the exact level-0
    beams down to prefixes of length L - 1, guessing the target's beams of levels 1..L-2."""
    found = [beams, *head_beams(model, state, beams, trie, width, model.num_levels - 1)]
    return TrieIndex.of(trie).rowwise(torch.cat([b.nodes for b in found], dim=1))


def item_draft(
    model,  # SemanticIdRecommender trained with the item objective
    state,  # HistoryState of B users
    beams: Beams,  # [B, W] the exact level-0 beams
    trie: PrefixTrie,
    width: int,  # prefixes drafted per prefix length
    item_search: str = "auto",  # "exact", "index" or "auto" (`item_index.use_index`)
) -> NodeSet:  # the level-0 beams and the most probable deeper prefixes
    """The "items" draft: at every prefix length 2..L-1 the `width` prefixes under which the
    item objective (`dense`'s distribution) puts the most probability (the caller drops those
    whose next code is forced). On a model whose code levels are tied to that objective a
    prefix's beam score is close to the log of that mass, so these are the prefixes the beam
    tends to keep. The mass comes from the exact [B, D] x [D, I] product, or, through the item
    index, from the `DRAFT_ITEMS_PER_PREFIX` x `width` items of highest logit (the rest of the
    catalogue counted as no mass): what is drafted changes, never the decode's result."""
    if not use_index(model, item_search):
        return _most_probable_prefixes(
            model, trie, beams, item_log_probs(model, state).exp(), width
        )
    deeper = item_prefixes(trie, model.item_codes)[:, 1:]  # [I, L-2] their longer prefixes
    found = top_items(model, state.hidden, DRAFT_ITEMS_PER_PREFIX * width)  # [B, R]
    probs = (found.scores - found.scores[:, :1]).exp().nan_to_num(0.0)  # [B, R]; pads: 0
    nodes = deeper[found.items.clamp(min=0)].flatten(1)  # [B, R (L-2)] item-major
    spread = probs[:, :, None].expand(-1, -1, deeper.shape[1]).flatten(1)  # the same order
    found_nodes, column = torch.unique(nodes, return_inverse=True)
    # The mass of each prefix found (columns: the distinct prefixes, ascending), per row
    mass = probs.new_zeros(probs.shape[0], len(found_nodes)).scatter_add_(1, column, spread)
    return _top_mass(trie, beams, found_nodes, mass, width)


def heads_draft(
    model,  # SemanticIdRecommender with parallel level heads
    state,  # HistoryState of B users
    beams: Beams,  # [B, W] the exact level-0 beams
    trie: PrefixTrie,
    width: int,  # prefixes drafted per prefix length
) -> NodeSet:  # the level-0 beams and the most probable deeper prefixes
    """The "heads" draft: the "items" draft's prefixes of most mass, the mass from the parallel
    level heads' item distribution (`heads.item_scores`: the product of an item's per-level
    probabilities, every level predicted from the history state at once). The heads predict
    each level without the codes above it, so where a model's deeper levels hang on the earlier
    ones their guesses miss more than the item objective's; they need no item objective."""
    return _most_probable_prefixes(model, trie, beams, item_scores(model, state).exp(), width)


def _most_probable_prefixes(
    model,  # SemanticIdRecommender
    trie: PrefixTrie,
    beams: Beams,  # [B, W] the exact level-0 beams
    probs: Tensor,  # [B, I] a probability of every catalogue item
    width: int,  # prefixes drafted per prefix length
) -> NodeSet:
    """The level-0 beams and, at every prefix length 2..L-1, the `width` prefixes holding the
    most of `probs`."""
    deeper = item_prefixes(trie, model.item_codes)[:, 1:]  # [I, L-2] their longer prefixes
    found_nodes, column = _DEEPER.get(  # [1, (L-2) I] columns, length-major
        trie,
        (trie.edge_keys, model.item_codes),
        lambda: torch.unique(deeper.T.reshape(1, -1), return_inverse=True),
    )
    # The mass of each prefix found, per row, a prefix length at a time: no [B, (L-2) I] copy
    # of the probabilities (a large catalogue's batch would not fit)
    mass = probs.new_zeros(probs.shape[0], len(found_nodes))  # [B, U]
    for columns in column.view(*deeper.T.shape):  # [I] each item's prefix of one length
        mass.scatter_add_(1, columns.expand_as(probs), probs)
    return _top_mass(trie, beams, found_nodes, mass, width)


def _top_mass(
    trie: PrefixTrie,
    beams: Beams,  # [B, W] the exact level-0 beams
    found_nodes: Tensor,  # [U] the distinct prefixes some item's mass falls under, ascending
    mass: Tensor,  # [B, U] each row's mass under each of them
    width: int,
) -> NodeSet:
    """The level-0 beams and, at every prefix length 2..L-1, the `width` found prefixes of each
    row with the most mass (and any)."""
    index = TrieIndex.of(trie)
    length = index.level[found_nodes] + 1  # [U] each prefix's length
    picked = [beams.nodes]
    for depth in range(2, trie.levels):
        at = (length == depth).nonzero().squeeze(1)  # [U_d] the columns of this length
        top = mass[:, at].topk(min(width, len(at)), dim=1)
        picked.append(torch.where(top.values > 0, found_nodes[at][top.indices], -1))  # mass > 0
    return index.rowwise(torch.cat(picked, dim=1))


# Drafts made after the history pass: name -> (model, state, level-0 beams, trie, width) -> the
# prefixes drafted (a `NodeSet`).
AFTER_HISTORY = {"nezha": head_draft, "items": item_draft, "heads": heads_draft}


def after_history_draft(
    model,  # SemanticIdRecommender
    state,  # HistoryState of B users
    beams: Beams,  # [B, W] the exact level-0 beams
    trie: PrefixTrie,
    kind: str,  # one of AFTER_HISTORY
    width: int,  # "items", "heads": prefixes per length; "nezha": the draft head's beam width
    item_search: str,  # "items": "exact", "index" or "auto"
) -> NodeSet:
    """The draft of `kind` made from the encoded histories (both engines')."""
    options = {"item_search": item_search} if kind == "items" else {}
    return AFTER_HISTORY[kind](model, state, beams, trie, width, **options)


@dataclass
class RecommenderDrafter:
    """``spec_beam``'s draft (module docstring) for the target's model. It remembers, within a
    decode, whether it has made the draft that follows the history pass: one decode at a time."""

    target: RecommenderTarget
    catalogue: Catalogue  # the target's (core token trie)
    trie: PrefixTrie  # the model's items (recsys trie), what the drafts are made over
    width: int  # W, the search's beams: the "items" and "nezha" drafts start from the top W
    kind: str  # "items", "heads", "nezha", "frontier" or "none" (`spec_beam.resolve_draft`)
    draft_width: int  # "items", "heads": prefixes per length; "nezha": the draft head's width
    item_search: str  # "items": "exact", "index" or "auto"
    lookahead: int  # descendant levels of the beams every pass after the history's drafts
    draft_codes: Tensor | None = None  # [B, R, L] codes of items whose prefixes are drafted
    after_history_made: bool = False

    def begin(self, tokens: Tensor, lengths: Tensor) -> None:
        """``BeamDrafter.begin``: a decode starts, its after-history draft not made yet."""
        self.after_history_made = False

    def draft(self, tree: BeamTree, rows: Tensor, nodes: Tensor, budget: int, cache) -> None:
        """``BeamDrafter.draft``: before the history pass (the target's state is not made yet)
        the drafts it can score; at the next pass the drafts that read the history's state, and
        the lookahead at every pass after it."""
        if cache.state is None:
            if self.kind == "frontier" or self.draft_codes is not None:
                member = draft_member(self.trie, TrieIndex.of(self.trie), tree.batch, self.kind,
                                      self.draft_codes)  # fmt: skip
                self._plan(tree, self._closed(member, budget))
            return
        if not self.after_history_made and self.kind in AFTER_HISTORY:
            self.after_history_made = True
            busy = torch.unique(rows)  # [b] the rows still searching, ascending
            state = cache.state if len(busy) == tree.batch else cache.state.rows(busy)
            member = self._after_history(state)
            member = self._closed(member, budget)
            self._plan(tree, TrieIndex.of(self.trie).node_set(busy[member.rows], member.nodes))
        if self.lookahead:
            fanout = self.catalogue.trie.widest
            below = CatalogueDrafter(self.catalogue, depth=self.lookahead, fanout=fanout)
            below.draft(tree, rows, nodes, budget, cache)

    def _after_history(self, state) -> NodeSet:  # of state's rows
        """The draft made from the encoded histories ("items", "heads", "nezha"). The NEZHA
        head's beam starts from the exact level-0 beams; the other drafts would only add them,
        and here they are the frontier, planned already: none is given."""
        trie, level0 = self.trie, state.level0_log_probs[:, None]  # [b, 1, V0]
        beams = start_beams(level0.shape[0], trie)
        if self.kind == "nezha":
            beams = extend(beams, level0, trie, 0, self.width)
        else:  # [b, 0] each: no beams
            none = beams.nodes[:, :0]
            beams = Beams(code=none, nodes=none, scores=beams.scores[:, :0], origin=none)
        return after_history_draft(self.target.model, state, beams, trie, self.kind,
                                   self.draft_width, self.item_search)  # fmt: skip

    def _closed(self, member: NodeSet, budget: int) -> NodeSet:
        """The members whose next code is not free, and their ancestors; past the budget a row
        keeps its shallowest (ancestors first)."""
        index = TrieIndex.of(self.trie)
        member = index.with_ancestors(index.scored(member, index.to_score(self.target.model)))
        return member.where(rank_within_rows(member.rows) < budget)

    def _plan(self, tree: BeamTree, member: NodeSet) -> None:
        """Plan the members (closed under ancestors) below the roots in one ``add``, each as
        the tree's existing node of its prefix where it has one (found by its catalogue state,
        ``BeamTree.with_state``: no lookup a level at a time)."""
        if not len(member):
            return
        index = TrieIndex.of(self.trie)
        rows, nodes = member.rows, member.nodes  # [K] each, (row, node) ascending
        states = self._states()[nodes]  # [K] each member's catalogue state
        core = tree.with_state(rows, states)  # [K] each member's core node; -1: not planned
        new = core < 0
        core[new] = tree.numbers(rows[new])
        parent = index.parent[nodes]  # [K] its trie parent (0: the root, core node 0)
        above = member.position(rows * member.stride + parent)[0]  # (every ancestor a member)
        parents = torch.where(parent > 0, core[above], 0)
        tokens = index.code[nodes] + self.target.offsets[index.level[nodes]]
        tree.add(rows[new], parents[new], tokens[new], states[new])

    def _states(self) -> Tensor:  # [scorable] int64
        """The catalogue state (core trie node) of each scorable prefix of the recsys trie,
        made once per trie and catalogue."""
        return _STATES.get(
            # Keyed on the catalogue object (made once per model), not on its tables: those may
            # be inference tensors, which keep no version to compare
            self.catalogue,
            (self.trie.edge_keys,),
            lambda: _catalogue_states(self.trie, self.catalogue, self.target.offsets),
        )


def _catalogue_states(trie: PrefixTrie, catalogue: Catalogue, offsets: Tensor) -> Tensor:
    """``RecommenderDrafter._states``: the catalogue trie stepped by each prefix's last code, a
    level at a time (recsys node ids grow with the level: parents are stepped first)."""
    index = TrieIndex.of(trie)
    states = torch.zeros(index.scorable, dtype=torch.long, device=trie.device)
    starts = trie.level_starts  # code level l's nodes: starts[l + 1] .. starts[l + 2] - 1
    for level in range(trie.levels - 1):  # the scorable ones
        at = torch.arange(starts[level + 1], starts[level + 2], device=trie.device)
        tokens = index.code[at] + offsets[level]
        states[at] = catalogue.trie.step(states[index.parent[at]], tokens)
    return states

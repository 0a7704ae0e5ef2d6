"""The recommender's drafts (``spec_beam``'s "items", "heads", "nezha", "frontier" and the
prefixes of given items) as trie node sets, for both engines (``recsys.spec_levels`` scores
them): what can be drafted before the histories are read (the frontier, given items) is scored
in the history pass; the drafts read from the encoded histories ride on the first follow-up.
"""

from __future__ import annotations

import itertools

import torch
from torch import Tensor

from genrec_spec.data_pipelines.trie import PrefixTrie
from genrec_spec.models.derived import DerivedCache
from genrec_spec.recsys.decoders.beam import extend, start_beams
from genrec_spec.recsys.decoders.dense import item_log_probs
from genrec_spec.recsys.decoders.heads import item_scores
from genrec_spec.recsys.decoders.nezha import head_beams
from genrec_spec.recsys.item_index import top_items, use_index
from genrec_spec.recsys.scoring import NodeSet, TrieIndex, item_prefixes, prefix_nodes

# The "items" draft through the index retrieves this many items per drafted prefix of a length
# (the prefixes of the items of highest logit hold most of the mass).
DRAFT_ITEMS_PER_PREFIX = 2
# (trie, item codes) -> the distinct longer prefixes of every item (ascending), and the column of
# each (length, item) among them: the exact "items" draft's, the same for every decode
_DEEPER = DerivedCache()


def draft_member(
    trie: PrefixTrie,
    index: TrieIndex,
    batch: int,
    draft: str,
    draft_codes: Tensor | None,  # [B, R, L] int64 Semantic IDs of items whose prefixes are drafted
) -> NodeSet:  # the trie nodes to score in the first pass
    nodes = []  # [B, *] each
    if draft == "frontier":  # every length-1 prefix
        nodes.append(torch.arange(1, trie.level_starts[2], device=trie.device).expand(batch, -1))
    if draft_codes is not None:
        nodes.append(prefix_nodes(trie, draft_codes).flatten(1))
    if not nodes:  # (a draft made after the history pass)
        return NodeSet(torch.zeros(0, dtype=torch.long, device=trie.device), index.scorable)
    return index.rowwise(torch.cat(nodes, dim=1))


def head_draft(
    model,  # SemanticIdRecommender with a draft head
    state,  # HistoryState of B users
    level0: Tensor,  # [B, W] the exact level-0 beams' nodes (-1: none)
    trie: PrefixTrie,
    width: int,  # the draft beam's width
) -> NodeSet:  # the level-0 beams and every prefix the draft beam keeps
    """The "nezha" draft: the draft head's beam (`nezha.head_beams`) from the exact level-0
    beams (made again here, with their scores, from the histories' level-0 log-probs) down to
    prefixes of length L - 1, guessing the target's beams of levels 1..L-2."""
    start = start_beams(len(level0), trie)
    beams = extend(start, state.level0_log_probs[:, None], trie, 0, level0.shape[1])
    found = [beams, *head_beams(model, state, beams, trie, width, model.num_levels - 1)]
    return TrieIndex.of(trie).rowwise(torch.cat([b.nodes for b in found], dim=1))


def item_draft(
    model,  # SemanticIdRecommender trained with the item objective
    state,  # HistoryState of B users
    level0: Tensor,  # [B, W] the exact level-0 beams' nodes (-1: none)
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
            model, trie, level0, item_log_probs(model, state).exp(), width
        )
    deeper = item_prefixes(trie, model.item_codes)[:, 1:]  # [I, L-2] their longer prefixes
    found = top_items(model, state.hidden, DRAFT_ITEMS_PER_PREFIX * width)  # [B, R]
    probs = (found.scores - found.scores[:, :1]).exp().nan_to_num(0.0)  # [B, R]; pads: 0
    nodes = deeper[found.items.clamp(min=0)].flatten(1)  # [B, R (L-2)] item-major
    spread = probs[:, :, None].expand(-1, -1, deeper.shape[1]).flatten(1)  # the same order
    found_nodes, column = torch.unique(nodes, return_inverse=True)
    # The mass of each prefix found (columns: the distinct prefixes, ascending), per row
    mass = probs.new_zeros(probs.shape[0], len(found_nodes)).scatter_add_(1, column, spread)
    return _top_mass(trie, level0, found_nodes, mass, width)


def heads_draft(
    model,  # SemanticIdRecommender with parallel level heads
    state,  # HistoryState of B users
    level0: Tensor,  # [B, W] the exact level-0 beams' nodes (-1: none)
    trie: PrefixTrie,
    width: int,  # prefixes drafted per prefix length
) -> NodeSet:  # the level-0 beams and the most probable deeper prefixes
    """The "heads" draft: the "items" draft's prefixes of most mass, the mass from the parallel
    level heads' item distribution (`heads.item_scores`: the product of an item's per-level
    probabilities, every level predicted from the history state at once). The heads predict
    each level without the codes above it, so where a model's deeper levels hang on the earlier
    ones their guesses miss more than the item objective's; they need no item objective."""
    return _most_probable_prefixes(model, trie, level0, item_scores(model, state).exp(), width)


def _most_probable_prefixes(
    model,  # SemanticIdRecommender
    trie: PrefixTrie,
    level0: Tensor,  # [B, W] the exact level-0 beams' nodes (-1: none)
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
    return _top_mass(trie, level0, found_nodes, mass, width)


def _top_mass(
    trie: PrefixTrie,
    level0: Tensor,  # [B, W] the exact level-0 beams' nodes (-1: none)
    found_nodes: Tensor,  # [U] the distinct prefixes some item's mass falls under, ascending
    mass: Tensor,  # [B, U] each row's mass under each of them
    width: int,
) -> NodeSet:
    """The level-0 beams and, at every prefix length 2..L-1, the `width` found prefixes of each
    row with the most mass (and any)."""
    # A trie's node ids grow with the prefix length, and found_nodes ascend: the prefixes of
    # each length 2..L-1 are one run of the columns.
    starts = found_nodes.new_tensor(trie.level_starts[2 : trie.levels + 1])
    bounds = torch.searchsorted(found_nodes, starts).tolist()
    picked = [level0]
    for start, end in itertools.pairwise(bounds):
        top = mass[:, start:end].topk(min(width, end - start), dim=1)
        at = found_nodes[start:end][top.indices]
        picked.append(torch.where(top.values > 0, at, -1))  # (mass > 0)
    return TrieIndex.of(trie).rowwise(torch.cat(picked, dim=1))


# Drafts made after the history pass: name -> (model, state, level-0 beams' nodes, trie, width) ->
# the prefixes drafted (a `NodeSet`).
AFTER_HISTORY = {"nezha": head_draft, "items": item_draft, "heads": heads_draft}


def after_history_draft(
    model,  # SemanticIdRecommender
    state,  # HistoryState of B users
    level0: Tensor,  # [B, W] the exact level-0 beams' nodes (-1: none)
    trie: PrefixTrie,
    kind: str,  # one of AFTER_HISTORY
    width: int,  # "items", "heads": prefixes per length; "nezha": the draft head's beam width
    item_search: str,  # "items": "exact", "index" or "auto"
) -> NodeSet:
    """The draft of `kind` made from the encoded histories (both engines')."""
    options = {"item_search": item_search} if kind == "items" else {}
    return AFTER_HISTORY[kind](model, state, level0, trie, width, **options)

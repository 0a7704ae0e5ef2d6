"""Exact scoring of Semantic-ID prefixes against user histories, in one pass.

Candidate scoring (MTGR-style) and speculative beam search both ask the same question: what are
the target's log-probs at a set of code prefixes (trie nodes) of each user? This module answers it.

- `TrieIndex`: per trie node its parent, code and level; `prefix_nodes`: the trie nodes of
  items' prefixes.
- `prefix_tree(index, member)`: a set of trie nodes per row (a [B, nodes] membership mask),
  closed under ancestors, laid out as one padded tree per row in the node order of the trie
  (parents first), ready for the model.
- `score(model, values, offsets, candidates)`: the exact log-likelihood of every candidate
  item, all candidates' distinct prefixes as one tree over the shared history root, scored in
  ONE forward with the history (`model.encode_history_and_tree`).

An item's log-likelihood is log p(c_0 | history) + sum_l log p(c_{l+1} | history, c_0..c_l):
the full code tuple under the model, without renormalising over valid codes (the same number
`beam` ranks by).

Shape letters: B users, M history items, C candidates, N tree nodes, I items, L code levels,
V codes, T history tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from genrec_spec.data_pipelines.trie import PrefixTrie
from genrec_spec.models.derived import DerivedCache
from genrec_spec.models.recsys.errors import RecommenderInputError
from genrec_spec.recsys.decoders.beam import item_trie

_INDEXES = DerivedCache()  # PrefixTrie -> its TrieIndex
_ITEM_PREFIXES = DerivedCache()  # PrefixTrie -> its items' prefix nodes


@dataclass(frozen=True)
class TrieIndex:
    """Node tables of a `PrefixTrie` (node 0 is the root; node ids grow with prefix length, so
    a parent's id is always smaller than its children's)."""

    parent: Tensor  # [n] int64 parent node of each node; -1 for the root
    code: Tensor  # [n] int64 last code of each node's prefix (0 for the root)
    level: Tensor  # [n] int64 level of that code (prefix length - 1; -1 for the root)
    scorable: int  # nodes 0..scorable-1 have a next level to score (prefix length <= L-1)
    choice: Tensor  # [scorable] bool, the node has more than one child (`PrefixTrie.has_choice`)

    @classmethod
    def of(cls, trie: PrefixTrie) -> TrieIndex:
        """The trie's node tables, built once per trie (not once per decode call)."""
        return _INDEXES.get(trie, (trie.edge_keys, trie.child_codes), lambda: cls._build(trie))

    @classmethod
    def _build(cls, trie: PrefixTrie) -> TrieIndex:
        nodes = torch.arange(len(trie.child_codes) + 1, device=trie.device)
        # Edge e leads to node e + 1 (see PrefixTrie); its key is parent * stride + code.
        parent = torch.cat([nodes[:1] - 1, trie.edge_keys // trie.stride])
        code = torch.cat([nodes[:1] * 0, trie.child_codes.long()])
        starts = torch.tensor(trie.level_starts[1:], device=trie.device)
        level = torch.bucketize(nodes, starts, right=True) - 1
        scorable = trie.level_starts[trie.levels]
        return cls(parent, code, level, scorable, trie.has_choice(nodes[:scorable]))

    def to_score(self, model) -> Tensor:  # [scorable] bool
        """The nodes whose next level the model must score: those with a choice when its forced
        codes are free (`forced_codes_free`: log-prob 0), else all."""
        if model.forced_codes_free:
            return self.choice
        return torch.ones_like(self.choice)

    def with_ancestors(self, member: Tensor) -> Tensor:  # [B, >= scorable] bool -> [B, scorable]
        """The membership mask closed under ancestors (the root excluded)."""
        member = member[:, : self.scorable].clone()
        member[:, 0] = False
        for _ in range(int(self.level[self.scorable - 1])):  # prefix lengths above 1
            rows, nodes = torch.nonzero(member, as_tuple=True)
            above = self.parent[nodes]
            member[rows[above > 0], above[above > 0]] = True
        return member


def prefix_nodes(
    trie: PrefixTrie,
    codes: Tensor,  # [..., L] int64 full Semantic IDs of catalogue items
) -> Tensor:  # [..., L-1] int64 trie node of each item's prefix of length 1..L-1
    flat = codes.reshape(-1, codes.shape[-1])
    node, out = trie.root(flat.shape[0]), []
    for level in range(trie.levels - 1):
        node = trie.child(node, flat[:, level])
        out.append(node)
    return torch.stack(out, dim=1).reshape(*codes.shape[:-1], trie.levels - 1)


def node_mask(
    nodes: Tensor,  # [B, N] int64 trie nodes per row, each < scorable; -1 = none
    scorable: int,
) -> Tensor:  # [B, scorable] bool, True at each row's nodes
    spare = torch.zeros(nodes.shape[0], scorable + 1, dtype=torch.bool, device=nodes.device)
    return spare.scatter_(1, torch.where(nodes >= 0, nodes, scorable), True)[:, :scorable]


def item_prefixes(trie: PrefixTrie, item_codes: Tensor) -> Tensor:  # [I] ... -> [I, L-1]
    """`prefix_nodes` of a whole catalogue's codes, computed once per trie and code table."""
    return _ITEM_PREFIXES.get(
        trie, (trie.edge_keys, item_codes), lambda: prefix_nodes(trie, item_codes)
    )


@dataclass(frozen=True)
class PrefixTree:
    """Some trie nodes of each row as one padded tree (what `score_tree` takes)."""

    nodes: Tensor  # [B, N] int64 trie node of each tree node; -1 = padding
    codes: Tensor  # [B, N] int64
    levels: Tensor  # [B, N] int64 code level (0..L-2)
    parents: Tensor  # [B, N] int64 tree index of the parent; -1 = child of the history root
    slots: Tensor  # [B, scorable] int64 tree index of each trie node; -1 = not in the tree

    @property
    def real_nodes(self) -> int:
        return int((self.nodes >= 0).sum())


def prefix_tree(index: TrieIndex, member: Tensor) -> PrefixTree:
    """member: [B, >= scorable] bool, the trie nodes wanted per row; their ancestors are added
    (a node's score depends on its whole prefix). Padding nodes are harmless level-0 roots."""
    batch = member.shape[0]
    if not bool(member[:, 1 : index.scorable].any()):  # nothing wanted (a draft made later)
        none = torch.zeros(batch, 0, dtype=torch.long, device=member.device)
        unscored = torch.full((batch, index.scorable), -1, dtype=torch.long, device=member.device)
        return PrefixTree(nodes=none, codes=none, levels=none, parents=none, slots=unscored)
    member = index.with_ancestors(member)
    slots = member.long().cumsum(dim=1) - 1  # [B, scorable] position among the row's nodes
    rows, nodes = torch.nonzero(member, as_tuple=True)  # row-major, ascending node ids
    width = int(member.sum(dim=1).max()) if batch else 0
    tree_nodes = torch.full((batch, width), -1, dtype=torch.long, device=member.device)
    tree_nodes[rows, slots[rows, nodes]] = nodes
    safe = tree_nodes.clamp(min=0)
    parent = index.parent[safe]  # [B, N] trie node of the parent (0 = the root)
    parents = torch.where(
        (tree_nodes >= 0) & (parent > 0), slots.gather(1, parent.clamp(min=0)), -1
    )
    return PrefixTree(
        nodes=tree_nodes,
        codes=torch.where(tree_nodes >= 0, index.code[safe], 0),
        levels=torch.where(tree_nodes >= 0, index.level[safe], 0),
        parents=parents,
        slots=torch.where(member, slots, -1),
    )


def check_candidates(model, candidates: Tensor, batch: int) -> None:
    if candidates.dim() != 2 or candidates.shape[0] != batch or candidates.is_floating_point():
        raise RecommenderInputError(
            f"candidates must be an integer tensor [B, C] with B = {batch} history rows, got "
            f"{tuple(candidates.shape)} {candidates.dtype}",
            "pass one row of candidate item indices per history",
        )
    if candidates.numel() and (
        int(candidates.min()) < 0 or int(candidates.max()) >= model.num_items
    ):
        raise RecommenderInputError(
            f"candidate item indices must lie in [0, {model.num_items})",
            "map raw item ids to item indices (items.parquet item_index) first",
        )


@torch.no_grad()
def score(
    model,  # SemanticIdRecommender
    values: Tensor,  # [M] int64 history item indices, oldest first within a row
    offsets: Tensor,  # [B+1] int64
    candidates: Tensor,  # [B, C] int64 item indices (repeats allowed)
    *,
    trie: PrefixTrie | None = None,  # the catalogue's trie; None = item_trie(model)
) -> Tensor:  # [B, C] float32 log-likelihood of each candidate
    """Every candidate's exact log-likelihood, in one forward pass per batch."""
    check_candidates(model, candidates, offsets.numel() - 1)
    if trie is None:
        trie = item_trie(model)
    index = TrieIndex.of(trie)
    batch, count = candidates.shape
    codes = model.item_codes[candidates]  # [B, C, L]
    paths = prefix_nodes(trie, codes)  # [B, C, L-1] trie node of each candidate's prefixes
    member = torch.zeros(batch, index.scorable, dtype=torch.bool, device=candidates.device)
    member.scatter_(1, paths.flatten(1), True)
    # Prefixes whose next code is forced give it log-prob 0 (`TrieIndex.to_score`): not scored.
    tree = prefix_tree(index, member & index.to_score(model))
    state, out = model.encode_history_and_tree(
        values, offsets, tree.codes, tree.levels, tree.parents
    )
    total = state.level0_log_probs.gather(1, codes[:, :, 0])  # [B, C]
    if not out.shape[1]:  # every deeper code of every candidate is forced
        return total
    rows = torch.arange(batch, device=candidates.device)[:, None]
    for level in range(1, model.num_levels):
        at = tree.slots.gather(1, paths[:, :, level - 1])  # [B, C] tree node; -1: forced
        total += out[rows, at.clamp(min=0), codes[:, :, level]].masked_fill(at < 0, 0.0)
    return total

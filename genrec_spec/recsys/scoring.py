"""Exact scoring of Semantic-ID prefixes against user histories, in one pass.

Candidate scoring (MTGR-style) and speculative beam search both ask the same question: what are
the target's log-probs at a set of code prefixes (trie nodes) of each user? This module answers it.

- `TrieIndex`: per trie node its parent, code and level; `prefix_nodes`: the trie nodes of
  items' prefixes.
- `NodeSet`: a set of trie nodes per row, kept sparse (sorted keys), so its work follows its
  members, never the trie's size (a [B, trie nodes] mask is gigabytes at millions of items).
- `prefix_tree(index, member, batch)`: such a set, closed under ancestors, laid out as one
  padded tree per row in the node order of the trie (parents first), ready for the model.
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
from functools import cached_property

import torch
from torch import Tensor

from genrec_spec.core.beam_tree import rank_within_rows
from genrec_spec.data_pipelines.trie import PrefixTrie
from genrec_spec.models.derived import DerivedCache
from genrec_spec.models.recsys.errors import RecommenderInputError
from genrec_spec.models.recsys.times import HistoryTimes
from genrec_spec.recsys.inference import inference
from genrec_spec.recsys.item_trie import item_trie

_INDEXES = DerivedCache()  # PrefixTrie -> its TrieIndex
_ITEM_PREFIXES = DerivedCache()  # PrefixTrie -> its items' prefix nodes


@dataclass(frozen=True)
class NodeSet:
    """Trie nodes per row: the sorted distinct keys row * stride + node (stride above every
    node id a set holds). Rows ascend with the keys, and within a row the node ids, so a row's
    parents come before their children."""

    keys: Tensor  # [K] int64, ascending
    stride: int

    @classmethod
    def of(cls, rows: Tensor, nodes: Tensor, stride: int) -> NodeSet:
        """rows, nodes: the same shape, any order and repeats; nodes of -1 (and any past the
        stride, which a key could not tell from the next row's) are left out."""
        keep = (nodes >= 0) & (nodes < stride)
        return cls(torch.unique(rows[keep] * stride + nodes[keep]), stride)

    @classmethod
    def rowwise(cls, nodes: Tensor, stride: int) -> NodeSet:  # nodes [B, N], -1 pads
        rows = torch.arange(nodes.shape[0], device=nodes.device)[:, None].expand_as(nodes)
        return cls.of(rows, nodes, stride)

    @cached_property
    def rows(self) -> Tensor:  # [K]
        return self.keys // self.stride

    @cached_property
    def nodes(self) -> Tensor:  # [K]
        return self.keys % self.stride

    def __len__(self) -> int:
        return len(self.keys)

    def position(self, keys: Tensor) -> tuple[Tensor, Tensor]:  # [...] -> 2 x [...]
        """Where each key sits in the set and whether it is there at all."""
        if not len(self.keys):
            return torch.zeros_like(keys), torch.zeros_like(keys, dtype=torch.bool)
        at = torch.searchsorted(self.keys, keys).clamp(max=len(self.keys) - 1)
        return at, self.keys[at] == keys

    def find(self, nodes: Tensor) -> tuple[Tensor, Tensor]:  # [B, ...] -> 2 x [B, ...]
        """`position` of each row's nodes (row b's in nodes[b]; nodes of -1 are not there)."""
        rows = torch.arange(nodes.shape[0], device=nodes.device)
        rows = rows.view(-1, *[1] * (nodes.dim() - 1))
        at, found = self.position(rows * self.stride + nodes.clamp(min=0))
        return at, found & (nodes >= 0)

    def value_at(self, values: Tensor, nodes: Tensor) -> Tensor:  # [K], [B, ...] -> [B, ...]
        """values (one per member, in the set's order) at each row's nodes; -1 where absent."""
        if not len(values):
            return torch.full_like(nodes, -1)
        at, found = self.find(nodes)
        return torch.where(found, values[at], -1)

    def __or__(self, other: NodeSet) -> NodeSet:
        return NodeSet(torch.unique(torch.cat([self.keys, other.keys])), self.stride)

    def __sub__(self, other: NodeSet) -> NodeSet:
        return NodeSet(self.keys[~other.position(self.keys)[1]], self.stride)

    def where(self, keep: Tensor) -> NodeSet:  # keep [K] bool
        return NodeSet(self.keys[keep], self.stride)


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

    def with_ancestors(self, member: NodeSet) -> NodeSet:
        """The set closed under ancestors, the root excluded."""
        member = member.where(member.nodes > 0)
        rows, above = member.rows, member.nodes
        keys = [member.keys]
        for _ in range(int(self.level[self.scorable - 1])):  # prefix lengths above 1
            above = self.parent[above].clamp(min=0)  # the root's parent: the root again
            keys.append(rows * member.stride + above)
        closed = NodeSet(torch.unique(torch.cat(keys)), member.stride)
        return closed.where(closed.nodes > 0)

    def node_set(self, rows: Tensor, nodes: Tensor) -> NodeSet:
        """A `NodeSet` of this trie's scorable nodes (rows, nodes the same shape; -1 pads)."""
        return NodeSet.of(rows, nodes, self.scorable)

    def rowwise(self, nodes: Tensor) -> NodeSet:  # nodes [B, N] < scorable, -1 pads
        return NodeSet.rowwise(nodes, self.scorable)

    def scored(self, member: NodeSet, to_score: Tensor) -> NodeSet:
        """The members whose next level is scored (`to_score` [scorable] bool)."""
        return member.where(to_score[member.nodes])


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
    members: NodeSet  # the trie nodes in the tree
    slots: Tensor  # [K] int64 the tree index of each member, in the set's order

    @property
    def real_nodes(self) -> int:
        return len(self.members)

    def slot_of(self, nodes: Tensor) -> Tensor:  # [B, ...] trie nodes -> [B, ...], -1: absent
        return self.members.value_at(self.slots, nodes)


def prefix_tree(index: TrieIndex, member: NodeSet, batch: int) -> PrefixTree:
    """member: the trie nodes wanted in each of `batch` rows; their ancestors are added (a
    node's score depends on its whole prefix). Padding nodes are harmless level-0 roots."""
    device = member.keys.device
    if not len(member):  # nothing wanted (a draft made later)
        none = torch.zeros(batch, 0, dtype=torch.long, device=device)
        return PrefixTree(none, none, none, none, members=member, slots=none.flatten())
    member = index.with_ancestors(member)
    rows, nodes = member.rows, member.nodes  # row-major, ascending node ids: parents first
    slots = rank_within_rows(rows)  # [K] each member's tree index
    width = int(slots.max()) + 1

    def table(values: Tensor, pad: int) -> Tensor:  # [K] -> [B, N]
        out = torch.full((batch, width), pad, dtype=torch.long, device=device)
        out[rows, slots] = values
        return out

    parent = index.parent[nodes]  # trie node of each member's parent (0 = the root)
    # Every ancestor is a member: a parent other than the root is found at its key.
    above = member.position(rows * member.stride + parent)[0]
    return PrefixTree(
        nodes=table(nodes, -1),
        codes=table(index.code[nodes], 0),
        levels=table(index.level[nodes], 0),
        parents=table(torch.where(parent > 0, slots[above], -1), -1),
        members=member,
        slots=slots,
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


@inference
def score(
    model,  # SemanticIdRecommender
    values: Tensor,  # [M] int64 history item indices, oldest first within a row
    offsets: Tensor,  # [B+1] int64
    candidates: Tensor,  # [B, C] int64 item indices (repeats allowed)
    *,
    trie: PrefixTrie | None = None,  # the catalogue's trie; None = item_trie(model)
    times: HistoryTimes | None = None,  # a time-aware model's (`models.recsys.times`)
) -> Tensor:  # [B, C] float32 log-likelihood of each candidate
    """Every candidate's exact log-likelihood, in one forward pass per batch."""
    check_candidates(model, candidates, offsets.numel() - 1)
    if trie is None:
        trie = item_trie(model)
    index = TrieIndex.of(trie)
    batch, count = candidates.shape
    codes = model.item_codes[candidates]  # [B, C, L]
    paths = prefix_nodes(trie, codes)  # [B, C, L-1] trie node of each candidate's prefixes
    # Prefixes whose next code is forced give it log-prob 0 (`TrieIndex.to_score`): not scored.
    member = index.scored(index.rowwise(paths.flatten(1)), index.to_score(model))
    tree = prefix_tree(index, member, batch)
    state, out = model.encode_history_and_tree(
        values, offsets, tree.codes, tree.levels, tree.parents, times
    )
    total = state.level0_log_probs.gather(1, codes[:, :, 0])  # [B, C]
    if not out.shape[1]:  # every deeper code of every candidate is forced
        return total
    rows = torch.arange(batch, device=candidates.device)[:, None]
    for level in range(1, model.num_levels):
        at = tree.slot_of(paths[:, :, level - 1])  # [B, C] tree node; -1: forced
        total += out[rows, at.clamp(min=0), codes[:, :, level]].masked_fill(at < 0, 0.0)
    return total

"""The prefix trie of valid Semantic IDs, as flat tensors with batched lookups.

Decoding over Semantic IDs may only emit code tuples that name an item. The trie answers, for a
batch of partial IDs at once and without host syncs: which codes may come next
(`allowed_mask`, used to mask logits), where a code leads (`child`), whether a prefix exists
(`contains`) and which item a full ID names (`item_of`).

Layout. Node ids are global and breadth-first: node 0 is the root (the empty prefix), then the
distinct length-1 prefixes in sorted order, then the length-2 prefixes, ... so level l holds the
ids `level_starts[l] .. level_starts[l + 1] - 1`. Children are CSR: node n's child codes are
`child_codes[child_offsets[n] : child_offsets[n + 1]]`, sorted. Because both nodes and edges
are numbered in sorted prefix order, the child reached by edge e is node e + 1 (edge e is the
(e + 1)-th non-root prefix), so no child-id array is stored. `edge_keys = parent * stride + code`
is sorted too, which turns `child` into one `searchsorted`.

Storage. The arrays grow with the catalogue, so they are kept narrow: offsets and item indices as
int32 (a trie past int32's node count is refused), codes in the smallest dtype holding the
largest codebook size. `edge_keys` stays int64: parent * stride outgrows int32 long before the
node count does. Lookups return int64 (what `gather`, `scatter` and indexing take): readers
upcast what they gather from these arrays, a few entries per row, not the arrays.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from genrec_spec.data_pipelines.errors import DataError

INDEX_LIMIT = torch.iinfo(torch.int32).max  # most nodes a trie may have (its ids are int32)


@dataclass(frozen=True)
class PrefixTrie:
    codebook_sizes: tuple[int, ...]
    """Codes per level (length L); `allowed_mask` at level l is `codebook_sizes[l]` wide."""
    level_starts: tuple[int, ...]
    """First node id of each level, length L + 2 (the last entry is the node count)."""
    max_children: tuple[int, ...]
    """Most children of any node of each level 0..L-1 (bounds the gather in allowed_mask)."""
    stride: int
    """max(codebook_sizes): key multiplier in `edge_keys`."""
    child_offsets: torch.Tensor  # [nodes + 1] int32, starts at 0
    child_codes: torch.Tensor  # [nodes - 1] int16 or wider (`code_dtype`), sorted per node
    edge_keys: torch.Tensor  # [nodes - 1] int64, parent * stride + code, sorted
    leaf_items: torch.Tensor  # [I] int32, item index of leaf node level_starts[L] + j

    @property
    def levels(self) -> int:
        return len(self.codebook_sizes)

    @property
    def device(self) -> torch.device:
        return self.child_codes.device

    @classmethod
    def from_codes(
        cls,
        codes: torch.Tensor,  # [I, L] int64, one unique ID per item
        codebook_sizes: tuple[int, ...] | None = None,
    ) -> PrefixTrie:
        """Build the trie of the item IDs; sizes default to max code + 1 per level."""
        if codes.dim() != 2 or codes.shape[0] == 0 or codes.shape[1] == 0:
            raise DataError(
                f"item codes must be a non-empty [items, levels] table, got {tuple(codes.shape)}",
                "pass SemanticIds.codes",
            )
        codes = codes.long()
        n, levels = codes.shape
        if codebook_sizes is None:
            codebook_sizes = tuple(int(v) + 1 for v in codes.max(0).values)
        if len(codebook_sizes) != levels or codes.min() < 0:
            raise DataError(
                f"codes have {levels} levels but codebook_sizes={codebook_sizes}, "
                f"min code {int(codes.min())}",
                "pass non-negative codes and one codebook size per level",
            )
        too_big = codes >= torch.tensor(codebook_sizes, device=codes.device)
        if too_big.any():
            level = int(too_big.any(0).nonzero()[0])
            raise DataError(
                f"level {level} has code {int(codes[:, level].max())} "
                f">= its codebook size {codebook_sizes[level]}",
                "pass the codebook sizes the codes were built with",
            )

        # Sort items lexicographically by their codes (stable sorts, last level first).
        order = torch.arange(n, device=codes.device)
        for level in reversed(range(levels)):
            order = order[torch.sort(codes[order, level], stable=True).indices]
        rows = codes[order]  # [I, L]
        # new_prefix[i, l]: row i starts a new length-(l+1) prefix (differs from row i-1 there).
        differs = torch.ones(n, levels, dtype=torch.bool, device=codes.device)
        differs[1:] = rows[1:] != rows[:-1]
        new_prefix = differs.cummax(dim=1).values  # [I, L]
        if not new_prefix[:, -1].all():
            raise DataError(
                f"{int((~new_prefix[:, -1]).sum())} items share a Semantic ID with another item",
                "build IDs with a collision level (build_semantic_ids adds one)",
            )

        level_starts = [0, 1]
        parent = torch.zeros(n, dtype=torch.long, device=codes.device)  # [I] node at level l
        edge_parents, edge_codes, max_children = [], [], []
        for level in range(levels):
            starts = new_prefix[:, level]  # [I]
            edge_parents.append(parent[starts])
            edge_codes.append(rows[starts, level])
            max_children.append(int(torch.bincount(parent[starts]).max()))
            # Node of each row at level + 1: the running count of new prefixes at this level.
            parent = level_starts[-1] + starts.long().cumsum(0) - 1
            level_starts.append(level_starts[-1] + int(starts.sum()))
        if level_starts[-1] > INDEX_LIMIT:  # every item is a leaf node, so the items fit too
            raise DataError(
                f"the trie of {n} items has {level_starts[-1]} nodes, more than its int32 "
                f"node ids hold ({INDEX_LIMIT})",
                "build the trie over fewer items (a part of the catalogue)",
            )

        edge_parent = torch.cat(edge_parents)  # [nodes - 1]
        child_codes = torch.cat(edge_codes)  # [nodes - 1]
        counts = torch.bincount(edge_parent, minlength=level_starts[-1])  # [nodes]
        child_offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
        stride = max(codebook_sizes)
        leaf_items = torch.empty_like(order)
        leaf_items[parent - level_starts[-2]] = order
        return cls(
            codebook_sizes=tuple(codebook_sizes),
            level_starts=tuple(level_starts),
            max_children=tuple(max_children),
            stride=stride,
            child_offsets=child_offsets.int(),
            child_codes=child_codes.to(code_dtype(stride)),
            edge_keys=edge_parent * stride + child_codes,
            leaf_items=leaf_items.int(),
        )

    def to(self, device: torch.device | str) -> PrefixTrie:
        """The same trie with its tensors on `device`."""
        moved = {
            f.name: getattr(self, f.name).to(device)
            if isinstance(getattr(self, f.name), torch.Tensor)
            else getattr(self, f.name)
            for f in fields(self)
        }
        return PrefixTrie(**moved)

    def root(self, batch: int) -> torch.Tensor:  # [B] int64, all 0
        return torch.zeros(batch, dtype=torch.long, device=self.device)

    def child(
        self,
        node: torch.Tensor,  # [B] int64, -1 = invalid
        code: torch.Tensor,  # [B] int64
    ) -> torch.Tensor:  # [B] int64, -1 where node is invalid or has no such child
        key = node * self.stride + code
        pos = torch.searchsorted(self.edge_keys, key).clamp(max=len(self.edge_keys) - 1)
        # Out-of-range codes would alias another parent's key, so they are ruled out first.
        found = (node >= 0) & (code >= 0) & (code < self.stride) & (self.edge_keys[pos] == key)
        return torch.where(found, pos + 1, -1)

    def has_choice(
        self,
        node: torch.Tensor,  # [...] int64, -1 = invalid
    ) -> torch.Tensor:  # [...] bool, True where the node has more than one child
        """Whether a prefix's next code is a choice; with one child it is forced."""
        safe = node.clamp(min=0)
        return (node >= 0) & (self.child_offsets[safe + 1] - self.child_offsets[safe] > 1)

    def allowed_mask(
        self,
        node: torch.Tensor,  # [B] int64 nodes at `level` (0 = root); -1 = invalid
        level: int,
    ) -> torch.Tensor:  # [B, V] bool, V = codebook_sizes[level]; True = a valid next code
        """The codes that extend each prefix to a valid one; all False for an invalid node or
        a node of another level."""
        width = self.codebook_sizes[level]
        at_level = (node >= self.level_starts[level]) & (node < self.level_starts[level + 1])
        safe = torch.where(at_level, node, 0)
        first, end = self.child_offsets[safe].long(), self.child_offsets[safe + 1]  # [B]
        # Gather a fixed-width window of child slots; slots past a node's children (and rows of
        # invalid nodes) scatter into a spare column that is dropped.
        slot = first[:, None] + torch.arange(self.max_children[level], device=node.device)
        real = (slot < end[:, None]) & at_level[:, None]  # [B, max_children]
        code = self.child_codes[slot.clamp(max=len(self.child_codes) - 1)].long()
        mask = torch.zeros(len(node), width + 1, dtype=torch.bool, device=node.device)
        mask.scatter_(1, torch.where(real, code, width), True)
        return mask[:, :width]

    def node_of(
        self,
        prefixes: torch.Tensor,  # [B, l] int64, 0 <= l <= L
    ) -> torch.Tensor:  # [B] int64 node of each prefix, -1 if it is no item's prefix
        if prefixes.dim() != 2 or prefixes.shape[1] > self.levels:
            raise DataError(
                f"prefixes must be [batch, length <= {self.levels}], got {tuple(prefixes.shape)}",
                "pass one row of codes per prefix",
            )
        node = self.root(len(prefixes))
        for level in range(prefixes.shape[1]):
            node = self.child(node, prefixes[:, level].long())
        return node

    def contains(self, prefixes: torch.Tensor) -> torch.Tensor:
        # prefixes: [B, l] int64 -> [B] bool, True where the prefix starts some item's ID
        return self.node_of(prefixes) >= 0

    def item_of(
        self,
        full_codes: torch.Tensor,  # [B, L] int64
    ) -> torch.Tensor:  # [B] int64 item index, -1 where the ID names no item
        if full_codes.dim() != 2 or full_codes.shape[1] != self.levels:
            raise DataError(
                f"full IDs must be [batch, {self.levels}], got {tuple(full_codes.shape)}",
                "pass complete Semantic IDs (every level, the collision code included)",
            )
        node = self.node_of(full_codes)
        leaf = (node - self.level_starts[-2]).clamp(min=0)
        return torch.where(node >= 0, self.leaf_items[leaf].long(), -1)


def code_dtype(largest: int) -> torch.dtype:
    """The narrowest of int16, int32 and int64 that holds `largest` (a codebook size)."""
    for dtype in (torch.int16, torch.int32):
        if largest <= torch.iinfo(dtype).max:
            return dtype
    return torch.int64

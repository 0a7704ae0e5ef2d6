"""The recommender's next-code distributions: level 0 from the history state, level l + 1 at a
prefix node of level l, and the item objective they may read.

A level's logits come from its code head; with the item objective (`ItemObjectiveConfig`) level 0
may instead be the item softmax summed over each level-0 cluster (`level0`), and levels 1.. may
add, at each prefix node, the log of the item objective's mass on the items under each child
(`tied_levels`), normalised over the prefix's children only. The tied draft head reads the same
child masses (`draft_item_logits`).

`CodeLevels` is a part of `SemanticIdRecommender` (a mixin): it reads the model's config,
item_codes, codebook_sizes, code_heads, node_item_query and item embedding table.

Shape letters: B users, N tree nodes, n nodes of one level, D model width, I items, T the
items of n prefixes' windows, V codes of a level, L code levels.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from genrec_spec.data_pipelines.jagged import spell_out_ranges
from genrec_spec.models.derived import DerivedCache
from genrec_spec.models.recsys.heads import children_log_softmax
from genrec_spec.models.recsys.item_prefixes import ItemPrefixIndex

_PREFIX_INDEXES = DerivedCache()  # item_codes table -> its items sorted by code tuple
_UNIT_ITEM_KEYS = DerivedCache()  # item embedding table -> its rows at unit length


class CodeLevels:
    """The next-code distributions of `SemanticIdRecommender` (module docstring)."""

    def item_scores(self, hidden: Tensor) -> Tensor:
        """hidden [B, D] (a HistoryState's) -> [B, I] SASRec-style next-item logits."""
        return self.item_query(hidden) @ self.item_keys().T

    def item_query(self, hidden: Tensor) -> Tensor:  # [..., D]
        """The state's side of an item logit: itself, or unit length over the temperature."""
        temperature = self.config.item_objective.temperature
        return F.normalize(hidden, dim=-1) / temperature if temperature else hidden

    def item_keys(self) -> Tensor:  # [I, D]
        """Every item's side of an item logit: its embedding row, or with a temperature the
        row at unit length, normalised once per weight version outside autograd (a decode
        calls it once per level pass)."""
        table = self.embeddings.embeddings["t_item"].weight
        if not self.config.item_objective.temperature:
            return table
        if torch.is_grad_enabled():  # training: the keys carry the gradient to the table
            return F.normalize(table, dim=-1)
        return _UNIT_ITEM_KEYS.get(table, (table,), lambda: F.normalize(table, dim=-1))

    def level0_logits(self, hidden: Tensor) -> Tensor:
        """hidden [N, D] -> [N, V0] logits of the next item's level-0 code: its code head's, or
        with level0_from_items the item logits' log-sum-exp over each level-0 cluster. A code
        no item has gets -inf."""
        if not self.config.level0_from_items:
            return self.code_heads[0](hidden)
        item_logits = self.item_scores(hidden)  # [N, I]
        top = item_logits.max(dim=-1, keepdim=True).values.detach()  # [N, 1] for stability
        mass = item_logits.new_zeros(item_logits.shape[0], self.codebook_sizes[0])
        mass = mass.index_add(1, self.item_codes[:, 0], (item_logits - top).exp())
        return mass.log() + top

    def _next_level_log_probs(
        self,
        h: Tensor,  # [B, N, D]
        levels: Tensor,  # [B, N]
        prefixes: Tensor | None,  # [B, N, L-1] each node's codes of levels 0..its level
        roots: Tensor,  # [B, D] each row's history state
    ) -> Tensor:  # [B, N, Vmax] log-probs of level + 1, -inf padded
        """Only the levels present are run (one host sync: free on CPU, and it skips most of the
        per-level ops of a small tree)."""
        out_shape = levels.shape
        vmax = max(self.codebook_sizes[1:])
        out = h.new_full((levels.numel(), vmax), float("-inf"))  # [B*N, Vmax]
        h, levels = h.flatten(0, 1), levels.flatten()  # [B*N, D], [B*N]
        prefixes = None if prefixes is None else prefixes.flatten(0, 1)  # [B*N, L-1]
        # Tied levels with a residual: each row's history-state query, normalised once.
        root_query = node_row = None
        if self.node_item_query is not None:
            root_query = self.item_query(roots)  # [B, D]
            node_row = torch.arange(out_shape[0], device=h.device).repeat_interleave(out_shape[1])
        counts = torch.bincount(levels, minlength=self.num_levels - 1).tolist()
        for level, count in enumerate(counts):
            if not count:
                continue
            # One level only: every node, no selection (a view, no index copies).
            rows = slice(None) if count == levels.numel() else levels == level
            prefix = None if prefixes is None else prefixes[rows, : level + 1]
            query = None if root_query is None else root_query[node_row[rows]]  # [n, D]
            scored = self._level_log_probs(h[rows], level + 1, prefix, query)
            out[rows, : self.codebook_sizes[level + 1]] = scored
        return out.unflatten(0, out_shape)

    def _level_log_probs(
        self,
        h: Tensor,  # [n, D] states of prefix nodes of length `level`
        level: int,  # >= 1, the level predicted
        prefixes: Tensor | None,  # [n, level] the nodes' prefixes (tied levels only)
        root_query: Tensor | None,  # [n, D] item query of each node's history state (residual)
    ) -> Tensor:  # [n, V_level]
        logits = self.code_heads[level](h)
        if self.config.tied_levels is not None:
            # The node's item query: from its own state, or (with a residual) the history
            # state's plus the node's correction.
            if root_query is None:
                query = self.item_query(h)  # [n, D]
            else:
                query = root_query + self.node_item_query(h)

            def item_logits(owner: Tensor, items: Tensor) -> Tensor:  # [T] each -> [T]
                # (on CPU F.embedding gathers faster than table[items])
                rows = F.embedding(items, self.item_keys())  # [T, D]
                return (query[owner] * rows).sum(dim=1)

            child_logits = self._item_child_logits(item_logits, level, prefixes)
            return children_log_softmax(logits + child_logits)
        return logits.log_softmax(dim=-1)

    def draft_item_logits(self, scores: Tensor, prefixes: Tensor) -> Tensor:
        """scores [B, I] the rows' item logits (`item_scores` of their history states, computed
        once per decode), prefixes [B, W, level] -> [B, W, V_level]: what the tied draft head
        adds to its logits (draft_tied), the item objective's log-mass under each child of each
        prefix."""
        batch, width, level = prefixes.shape

        def item_logits(owner: Tensor, items: Tensor) -> Tensor:  # [T] each -> [T]
            return scores[owner // width, items]  # prefix row b * W + w reads row b's scores

        logits = self._item_child_logits(item_logits, level, prefixes.reshape(-1, level))
        return logits.unflatten(0, (batch, width))

    def prefix_index(self) -> ItemPrefixIndex:
        """The items sorted by code tuple, each prefix's items one window of them: built once
        per `item_codes` table (and again when it is rewritten)."""
        codes = self.item_codes
        return _PREFIX_INDEXES.get(
            codes, (codes,), lambda: ItemPrefixIndex.from_codes(codes, self.codebook_sizes)
        )

    def _item_child_logits(
        self, item_logits_of: Callable[[Tensor, Tensor], Tensor], level: int, prefixes: Tensor
    ) -> Tensor:
        """prefixes [n, level] -> [n, V_level]: log of the item objective's mass (its logits,
        `item_logits_of(owner [T], items [T]) -> [T]` of each item for its prefix row's state,
        exponentiated) on the items under each child of the prefix; -inf for codes no item under
        the prefix has. Each row reads the window of the code-sorted item table that holds its
        prefix's items, the T items of all windows as one flat list: windows differ in size by
        an order of magnitude (a few large clusters), so padding each to the widest would read
        several times the items."""
        index = self.prefix_index()
        start, end = index.runs(prefixes)  # [n]
        rows, counts = len(prefixes), end - start
        # [T] each item's prefix row and its place in the sorted table (run start .. end - 1)
        owner, slot = spell_out_ranges(start, counts)
        item_logits = item_logits_of(owner, index.order[slot])  # [T]
        top = item_logits.new_full((rows,), float("-inf")).scatter_reduce(
            0, owner, item_logits.detach(), "amax"
        )  # [n] each row's largest logit, for stability
        top = top.masked_fill(top.isinf(), 0.0)
        vocab = self.codebook_sizes[level]
        mass = item_logits.new_zeros(rows * vocab).scatter_add(
            0, owner * vocab + index.sorted_codes[slot, level], (item_logits - top[owner]).exp()
        )
        mass = mass.view(rows, vocab)
        # No log of an empty child's 0 mass: its gradient would be 0 / 0.
        logged = mass.clamp_min(torch.finfo(mass.dtype).tiny).log() + top[:, None]
        return logged.masked_fill(mass == 0, float("-inf"))

    def _node_prefixes(self, codes: Tensor, levels: Tensor, parents: Tensor) -> Tensor | None:
        """codes, levels, parents [B, N] -> [B, N, L-1]: each node's codes at levels 0..its
        level, read up its ancestors (None unless the tied levels need them)."""
        if self.config.tied_levels is None:
            return None
        depth = self.num_levels - 1
        prefixes = codes.new_zeros(*codes.shape, depth + 1)  # slot `depth`: discarded writes
        node = torch.arange(codes.shape[1], device=codes.device).expand_as(codes)
        for _ in range(depth):
            real = node >= 0
            safe = node.clamp(min=0)
            slot = torch.where(real, levels.gather(1, safe), depth)
            prefixes.scatter_(2, slot[..., None], codes.gather(1, safe)[..., None])
            node = torch.where(real, parents.gather(1, safe), -1)
        return prefixes[..., :depth]

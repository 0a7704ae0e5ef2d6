"""The catalogue sorted by Semantic ID, so the items under any code prefix are one contiguous run.

The recommender's item-tied code levels (`ItemObjectiveConfig.tied_levels`) score a prefix
node's children by the item objective's mass on the items under each child. Sorting the items by
their code tuples (read as one mixed-radix number, level 0 most significant) turns "the items
under prefix (c0 .. c_l)" into the run of keys in [key(c0 .. c_l, 0 ..), key(c0 .. c_l + 1, 0 ..)),
found with two `searchsorted` calls for a whole batch of prefixes; `widths` bounds each run, so
a node gathers a fixed-width window of the sorted table instead of scoring the whole catalogue.

Shape letters: I items, L code levels, n prefixes, W most items under one prefix.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class ItemPrefixIndex:
    order: Tensor  # [I] int64 item ids, sorted by code tuple
    sorted_codes: Tensor  # [I, L] int64 code tuples of `order`'s items
    keys: Tensor  # [I] int64 ascending mixed-radix key of each sorted code tuple
    radix: Tensor  # [L] int64 key weight of one code step at each level
    widths: tuple[int, ...]  # [L] most items sharing a prefix of length l + 1

    @classmethod
    def from_codes(cls, item_codes: Tensor, codebook_sizes: list[int]) -> ItemPrefixIndex:
        """item_codes [I, L] int64 (collision code last), codebook_sizes [L]."""
        sizes = torch.tensor(codebook_sizes, dtype=torch.long, device=item_codes.device)
        # radix[l] = product of the codebook sizes below level l (256**3 * a collision codebook
        # of a few hundred stays far inside int64).
        radix = torch.cat([sizes.flip(0)[:-1].cumprod(0).flip(0), sizes.new_ones(1)])
        keys, order = (item_codes * radix).sum(dim=1).sort()
        widths = tuple(
            int(torch.unique_consecutive(keys // radix[level], return_counts=True)[1].max())
            for level in range(len(codebook_sizes))
        )
        return cls(order, item_codes[order], keys, radix, widths)

    def runs(self, prefixes: Tensor) -> tuple[Tensor, Tensor]:
        """prefixes [n, l] codes of levels 0..l-1 (l >= 1) -> (start [n], end [n]) int64: the
        sorted items under each prefix are order[start:end] (empty for a prefix no item has)."""
        depth = prefixes.shape[1]
        low = (prefixes * self.radix[:depth]).sum(dim=1)  # [n]
        start = torch.searchsorted(self.keys, low)
        end = torch.searchsorted(self.keys, low + self.radix[depth - 1])
        return start, end

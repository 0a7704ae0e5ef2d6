"""Token trees the Semantic-ID recommender reads: one training tree per user, prefix forests.

The recommender reads a user's history as a chain of tokens (a BOS token, then one token per
item) and decodes the next item's codes level by level: the last history token predicts level
0, a code token of level l predicts level l + 1. Code tokens see the whole history before them
and their own earlier levels, never siblings: the shared-context tree mask.

Training layout (`train_layout`): one tree per user row holds the history chain AND, for up to P
sampled history positions t, a branch of the next item's code tokens (levels 0..L-2) hanging off
history token t. One forward pass with the tree mask then trains next-item prediction at every
history position (level 0, SASRec-style) and the deeper levels at the sampled positions:

    nodes [0, T)                       history tokens (BOS + inputs), parents t - 1 (BOS: -1)
    node T + p * (L-1) + l             code token of level l of branch p, parent: its history
                                       anchor (l = 0) or the previous code token

Prefix forest (`prefix_forest`): the distinct code prefixes of a set of items as one tree over
the history root, so one pass yields the exact log-likelihood of every item in the set.

Shape letters: B users, M history items in the batch, T history tokens per row (BOS included),
P branches per row, L code levels (collision code included), C candidate items, N tree nodes.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import Tensor

from genrec_spec.models.recsys.errors import RecommenderInputError
from genrec_spec.models.recsys.times import HistoryTimes, token_times


@dataclass(frozen=True)
class TrainLayout:
    """One training batch laid out as one tree per row (module docstring)."""

    hist_items: Tensor  # [M] int64 input items (each window without its last item), row-major
    hist_offsets: Tensor  # [B+1] int64 row bounds of hist_items
    next_items: Tensor  # [B, T] int64 item each history token must predict; -1 = padding
    branch_anchor: Tensor  # [B, P] int64 history token each branch hangs off; -1 = no branch
    parents: Tensor  # [B, T + P * (L-1)] int64 the whole row as one tree, -1 = a root
    # A history token's time as a key and the time of the item it predicts ([B, T] int64 each,
    # `models.recsys.times`); None for windows without timestamps
    key_times: Tensor | None = None
    query_times: Tensor | None = None

    @property
    def num_history_tokens(self) -> int:  # T
        return self.next_items.shape[1]

    def visibility(self) -> Tensor:  # [B, N, N] bool, N = T + P * (L-1)
        """``ancestor_mask(parents)`` built straight from the layout's structure (a test checks
        they are equal): a history token sees the history up to itself, a code token the
        history up to its anchor and the earlier levels of its own branch; padding and empty
        branches see only themselves. A few [B, N, N] comparisons instead of log2(N) gathers
        (those were a large part of a training step)."""
        batch, tokens = self.next_items.shape
        branches = self.branch_anchor.shape[1]
        levels = (self.parents.shape[1] - tokens) // branches
        device = self.parents.device
        node = torch.arange(self.parents.shape[1], device=device)  # [N]
        time = node[:tokens]
        has_branch = (self.branch_anchor >= 0).repeat_interleave(levels, dim=1)  # [B, P*(L-1)]
        # Per node: the last history token it sees (-1: none), its branch (-1: none), level.
        sees_upto = torch.cat(
            [
                torch.where(self.next_items >= 0, time, -1),
                self.branch_anchor.repeat_interleave(levels, dim=1),
            ],
            dim=1,
        )  # [B, N]
        branch_of = (node[tokens:] - tokens) // levels  # [P*(L-1)]
        branch = torch.cat(
            [
                torch.full((batch, tokens), -1, device=device),
                torch.where(has_branch, branch_of, -1),
            ],
            dim=1,
        )  # [B, N]
        level = torch.where(node < tokens, 0, (node - tokens) % levels)  # [N]
        history_col = torch.where(node < tokens, node, node.numel())  # code tokens: never
        visible = history_col[None, None, :] <= sees_upto[:, :, None]
        visible |= (
            (branch[:, :, None] == branch[:, None, :])
            & (branch[:, :, None] >= 0)
            & (level[None, None, :] <= level[None, :, None])
        )
        return visible | torch.eye(node.numel(), dtype=torch.bool, device=device)

    def to(self, device: torch.device | str) -> TrainLayout:
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        return TrainLayout(**{k: v if v is None else v.to(device) for k, v in moved.items()})


def train_layout(
    window_values: Tensor,  # [M'] int64 item windows of B users, oldest first within a row
    window_offsets: Tensor,  # [B+1] int64; every window holds at least 1 item
    branch_levels: int,  # L - 1: code tokens per branch
    branches_per_row: int,  # P: positions per row that get a branch (fewer if the row is short)
    generator: torch.Generator,
    window_times: Tensor | None = None,  # [M'] int64 timestamps of the window items, or None
) -> TrainLayout:
    """Lay out B training windows: window x_0..x_{n-1} gives tokens BOS, x_0..x_{n-2}, token t
    predicting x_t, and branches at min(P, n) positions drawn uniformly without replacement.
    With `window_times`, the tokens' times: the history x_0..x_{n-2} predicted at x_{n-1}'s time
    (`models.recsys.times.token_times`)."""
    lengths = window_offsets[1:] - window_offsets[:-1]  # [B] n_b
    if bool((lengths < 1).any()):
        raise RecommenderInputError(
            f"{int((lengths < 1).sum())} training windows hold no item",
            "drop users with an empty train sequence first",
        )
    batch, tokens = lengths.numel(), int(lengths.max())
    device = window_values.device
    time = torch.arange(tokens, device=device)  # [T]
    valid = time[None, :] < lengths[:, None]  # [B, T]
    next_items = torch.full((batch, tokens), -1, dtype=torch.long, device=device)
    next_items[valid] = window_values.long()

    # Inputs: every window without its last item (the last item is only a target).
    is_last = torch.zeros(window_values.numel(), dtype=torch.bool, device=device)
    is_last[window_offsets[1:] - 1] = True
    hist_items = window_values[~is_last].long()
    hist_offsets = window_offsets - torch.arange(batch + 1, device=device)

    # Branch anchors: the P smallest of uniform keys over the valid positions of each row.
    branches = min(branches_per_row, tokens)
    keys = torch.rand(batch, tokens, generator=generator).to(device)
    keys = keys.masked_fill(~valid, 2.0)
    anchor = keys.topk(branches, dim=1, largest=False).indices.sort(dim=1).values  # [B, P]
    anchor = torch.where(anchor < lengths[:, None], anchor, -1)

    hist_parents = torch.where(valid & (time > 0), time - 1, -1).expand(batch, -1)  # [B, T]
    node = tokens + torch.arange(branches * branch_levels, device=device).view(branches, -1)
    first = anchor[:, :, None]  # [B, P, 1] level-0 code token hangs off its history anchor
    rest = (node[None, :, 1:] - 1).expand(batch, -1, -1)  # [B, P, L-2] previous code token
    branch_parents = torch.cat([first, torch.where(first >= 0, rest, -1)], dim=2)
    key_times = query_times = None
    if window_times is not None:
        history = HistoryTimes(window_times[~is_last], window_times[is_last])
        key_times, query_times = token_times(history, hist_offsets, tokens)
    return TrainLayout(
        hist_items=hist_items,
        hist_offsets=hist_offsets,
        next_items=next_items,
        branch_anchor=anchor,
        parents=torch.cat([hist_parents, branch_parents.reshape(batch, -1)], dim=1),
        key_times=key_times,
        query_times=query_times,
    )


@dataclass(frozen=True)
class PrefixForest:
    """The distinct prefixes (lengths 1..L-1) of C items' codes as tree nodes, level by level."""

    codes: Tensor  # [N] int64 last code of each node's prefix
    levels: Tensor  # [N] int64 level of that code (0..L-2)
    parents: Tensor  # [N] int64 node of the prefix one shorter; -1 for level 0
    item_nodes: Tensor  # [C, L-1] int64 node of each item's prefix of length l + 1


def prefix_forest(codes: Tensor) -> PrefixForest:  # codes: [C, L] int64
    """Deduplicate the items' prefixes so a shared prefix is scored once; nodes of level l come
    before those of level l + 1, so parents always precede their children."""
    count, levels = codes.shape
    node_codes, node_levels, node_parents, item_nodes = [], [], [], []
    start = 0
    parent = torch.full((count,), -1, dtype=torch.long, device=codes.device)  # [C]
    for level in range(levels - 1):
        # A prefix is (parent node, code): unique on that pair instead of the whole prefix.
        key = torch.stack([parent, codes[:, level].long()], dim=1)  # [C, 2]
        unique, inverse = torch.unique(key, dim=0, return_inverse=True)
        node_parents.append(unique[:, 0])
        node_codes.append(unique[:, 1])
        node_levels.append(torch.full_like(unique[:, 0], level))
        parent = start + inverse
        item_nodes.append(parent)
        start += unique.shape[0]
    return PrefixForest(
        codes=torch.cat(node_codes),
        levels=torch.cat(node_levels),
        parents=torch.cat(node_parents),
        item_nodes=torch.stack(item_nodes, dim=1),
    )

"""Draft-tree construction and topology helpers (ancestors, depths, root-to-node paths).

Trees are batched and padded: ``parents`` is [B, N] with parents[:, 0] == -1 and every parent
index smaller than its child's. Rows with fewer nodes are padded with invalid leaves under the
root (token 0, valid False): the target scores them harmlessly and acceptance never takes them.
All helpers are loop-free over the batch; only ``topology`` reads values (to validate).
"""

from __future__ import annotations

import torch
from torch import Tensor

from genrec_spec.kernels import ancestor_mask
from genrec_spec.types import DraftTree


def topology(parents: Tensor, validate: bool = True) -> tuple[Tensor, Tensor]:
    """parents [B, N] -> (ancestors [B, N, N] bool, depth [B, N] int64).

    ancestors[b, i, j] is True when node j is node i or one of its ancestors: exactly the tree
    keys node i attends to. One call of the kernels' pointer-doubling op; validate=True checks
    the parents first (one host sync), which a tree already scored by a target can skip."""
    ancestors = ancestor_mask(parents, validate=validate)
    return ancestors, ancestors.sum(-1) - 1


def paths(ancestors: Tensor, depth: Tensor) -> Tensor:  # [B, N, N], [B, N] -> [B, N, N]
    """paths[b, i, d] is the ancestor of node i at depth d (the root at d = 0, node i itself at
    d = depth[i]); -1 past the node's depth. Inputs from ``topology``."""
    batch, n = depth.shape
    # Ancestors of one node have distinct depths: scatter node j into column depth[j].
    column = torch.where(ancestors, depth[:, None, :], n)  # [B, N, N]
    out = torch.full((batch, n, n + 1), -1, dtype=torch.long, device=depth.device)
    source = torch.arange(n, device=depth.device).expand(batch, n, n)
    out.scatter_(2, column, source)
    return out[:, :, :n]


def root_only(roots: Tensor) -> DraftTree:  # roots [B]
    """The empty draft: plain autoregressive decoding scores just the root."""
    return DraftTree(tokens=roots[:, None], parents=torch.full_like(roots[:, None], -1))


def chain(
    roots: Tensor, drafts: Tensor, valid: Tensor | None = None, draft_probs: Tensor | None = None
) -> DraftTree:
    """A chain root -> drafts[:, 0] -> drafts[:, 1] ... (parents i - 1).

    roots [B], drafts [B, K], valid [B, K] bool (a row's valid drafts must be a prefix),
    draft_probs [B, K, V] (the draft distribution each token was sampled from).
    """
    batch, k = drafts.shape
    tokens = torch.cat([roots[:, None], drafts], dim=1)
    parents = torch.arange(-1, k, device=drafts.device).expand(batch, k + 1)
    if valid is not None:
        valid = torch.cat([valid.new_ones(batch, 1), valid], dim=1)
    if draft_probs is not None:
        draft_probs = torch.cat(
            [draft_probs.new_zeros(batch, 1, draft_probs.shape[2]), draft_probs], dim=1
        )
    return DraftTree(
        tokens=tokens, parents=parents.contiguous(), draft_probs=draft_probs, valid=valid
    )


def from_lists(
    tokens: list[list[int]], parents: list[list[int]], device: torch.device | str = "cpu"
) -> DraftTree:
    """Pad per-row node lists (each starting with the root, parent -1) into one DraftTree."""
    n = max(len(row) for row in tokens)
    pad = [n - len(row) for row in tokens]
    padded_tokens = [row + [0] * p for row, p in zip(tokens, pad, strict=True)]
    padded_parents = [row + [0] * p for row, p in zip(parents, pad, strict=True)]
    valid = [[True] * len(row) + [False] * p for row, p in zip(tokens, pad, strict=True)]
    return DraftTree(
        tokens=torch.tensor(padded_tokens, dtype=torch.long, device=device),
        parents=torch.tensor(padded_parents, dtype=torch.long, device=device),
        valid=torch.tensor(valid, dtype=torch.bool, device=device),
    )


def static_tree(choices: list[tuple[int, ...]]) -> tuple[Tensor, Tensor, Tensor]:
    """A fixed tree topology from Medusa-style choices: each choice is the path of child ranks
    from the root, e.g. [(0,), (1,), (0, 0)] = the two best children of the root and the best
    child of the first. Returns parents [N], ranks [N] (rank among siblings: which candidate
    fills the node) and depth [N], in breadth-first order (parents before children)."""
    ordered = sorted(set(choices), key=lambda c: (len(c), c))
    index = {(): 0}
    parents, ranks, depth = [-1], [0], [0]
    for choice in ordered:
        if not choice or choice[:-1] not in index or min(choice) < 0:
            raise ValueError(
                f"tree choice {choice} is not a path of ranks below an existing node; list "
                "every prefix of a path too, e.g. (0,) before (0, 1)"
            )
        index[choice] = len(parents)
        parents.append(index[choice[:-1]])
        ranks.append(choice[-1])
        depth.append(len(choice))
    return torch.tensor(parents), torch.tensor(ranks), torch.tensor(depth)


def widths_to_choices(widths: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Choices of the tree where every node at depth d has widths[d] children."""
    level: list[tuple[int, ...]] = [()]
    choices = []
    for width in widths:
        level = [path + (rank,) for path in level for rank in range(width)]
        choices += level
    return choices


def prepend_chain(lead: Tensor, tree: DraftTree) -> DraftTree:
    """Hang a tree under a chain of uncached tokens: lead [B, M] -> tree root. Used by drafters
    that must re-feed tokens they have not cached yet; node i of ``tree`` becomes M + i."""
    batch, m = lead.shape
    if m == 0:
        return tree
    lead_parents = torch.arange(-1, m - 1, device=lead.device).expand(batch, m)
    parents = torch.where(tree.parents < 0, m - 1, tree.parents + m)
    valid = tree.node_valid()
    return DraftTree(
        tokens=torch.cat([lead, tree.tokens], dim=1),
        parents=torch.cat([lead_parents, parents], dim=1),
        valid=torch.cat([torch.ones_like(lead, dtype=torch.bool), valid], dim=1),
    )

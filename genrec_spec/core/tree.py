"""Draft-tree construction and topology helpers (ancestors, depths, root-to-node paths).

Trees are batched and padded: ``parents`` is [B, N] with parents[:, 0] == -1 and every parent
index smaller than its child's. Rows with fewer nodes are padded with invalid leaves under the
root (token 0, valid False): the target scores them harmlessly and acceptance never takes them.
All helpers are loop-free over the batch; only ``topology`` reads values (to validate).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from genrec_spec.core.types import DecodeInputError, DraftTree
from genrec_spec.kernels import ancestor_mask


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
            raise DecodeInputError(
                f"tree choice {choice} is not a path of ranks below an existing node",
                "list every prefix of a path too, e.g. (0,) before (0, 1)",
            )
        index[choice] = len(parents)
        parents.append(index[choice[:-1]])
        ranks.append(choice[-1])
        depth.append(len(choice))
    return torch.tensor(parents), torch.tensor(ranks), torch.tensor(depth)


@dataclass(frozen=True)
class StaticLevel:
    """One draft level of a static tree (``static_tree``'s breadth-first order, where each depth
    is contiguous): the frontier nodes [frontier, scored) get children, the new nodes
    [scored, end)."""

    frontier: int
    scored: int
    end: int
    width: int  # candidates drawn per frontier node (the largest child rank + 1)
    pick: Tensor  # [end - scored] index of each new node's candidate in [F * width]
    parent: Tensor  # [end - scored] parent node of each new node


def static_levels(parents: Tensor, ranks: Tensor, depth: Tensor) -> list[StaticLevel]:
    """The levels that grow a static tree (parents, ranks, depth [N] from ``static_tree``) one
    draft forward at a time."""
    levels = []
    for level in range(1, int(depth.max()) + 1):
        frontier, scored = int((depth < level - 1).sum()), int((depth < level).sum())
        new = torch.arange(scored, int((depth <= level).sum()))
        width = int(ranks[new].max()) + 1
        pick = (parents[new] - frontier) * width + ranks[new]
        levels.append(StaticLevel(frontier, scored, scored + len(new), width, pick, parents[new]))
    return levels


def top_m_tree(
    roots: Tensor,  # [B]
    tokens: Tensor,  # [B, C] candidate tokens, every parent before its children
    scores: Tensor,  # [B, C] float, strictly lower than the parent's score
    parents: Tensor,  # [B, C] int64 candidate index of the parent, -1 = child of the root
    m: int,  # draft nodes kept per row
) -> DraftTree:  # N = 1 + min(m, C) nodes, in candidate order
    """EAGLE-2's rerank: keep the m candidates with the highest scores (cumulative draft
    log-probabilities) of each row. Since scores fall strictly from parent to child, the kept
    set holds every kept node's parent; kept in candidate order, parents come before children."""
    batch, count = tokens.shape
    m = min(m, count)
    kept = scores.topk(m, dim=1).indices.sort(dim=1).values  # [B, m] candidate indices
    node = torch.zeros_like(tokens)  # [B, C] node index of each kept candidate
    node.scatter_(1, kept, torch.arange(1, m + 1, device=tokens.device).expand(batch, m))
    parent = parents.gather(1, kept)  # [B, m] candidate index, -1 = the root
    node_parents = torch.where(parent < 0, 0, node.gather(1, parent.clamp_min(0)))
    return DraftTree(
        tokens=torch.cat([roots[:, None], tokens.gather(1, kept)], dim=1),
        parents=torch.cat([torch.full_like(roots[:, None], -1), node_parents], dim=1),
    )


def widths_to_choices(widths: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Choices of the tree where every node at depth d has widths[d] children."""
    level: list[tuple[int, ...]] = [()]
    choices = []
    for width in widths:
        level = [path + (rank,) for path in level for rank in range(width)]
        choices += level
    return choices


def likely_choices(
    rank_acceptance: Sequence[float], nodes: int, max_depth: int
) -> list[tuple[int, ...]]:
    """Static-tree choices: the ``nodes`` rank paths most likely accepted when a node's r-th
    ranked child is accepted with probability ``rank_acceptance[r]`` at any depth (a drafter
    whose accuracy holds with depth, as EAGLE's roughly does), at most ``max_depth`` deep. Found
    best first, so every path comes after its prefix; ties go to the smaller ranks."""
    ranks = [(r, p) for r, p in enumerate(rank_acceptance) if p > 0]
    heap = [(-p, (r,)) for r, p in ranks]
    heapq.heapify(heap)
    choices: list[tuple[int, ...]] = []
    while heap and len(choices) < nodes:
        minus_p, path = heapq.heappop(heap)
        choices.append(path)
        if len(path) < max_depth:
            for r, p in ranks:
                heapq.heappush(heap, (minus_p * p, path + (r,)))
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

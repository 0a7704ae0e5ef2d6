"""Exact item log-likelihoods from the recommender: every candidate item scored at once.

An item's log-likelihood is the sum over its code levels of log p(code | history, earlier
codes). The candidates' distinct code prefixes form a prefix forest over the history root
(`layout.prefix_forest`); each forest node is one code token, and its output gives the
log-probs of its children's codes. Every prefix is scored once however many items share it,
in tree-attention passes of at most `chunk` scored nodes (plus their ancestors as context).

`constrained=True` scores under the prefix-trie constraint of the candidate set: at every node
the log-probs are renormalised over the codes of its children in the set (log_softmax of the
logits restricted to valid codes; with the whole catalogue as candidates this is exactly what a
trie-constrained beam search ranks by). A node with a single child then contributes log 1 = 0
and is not even run through the model, which skips most nodes of a real catalogue.
`constrained=False` gives the model's raw log-likelihood (log-probs over whole codebooks).

Shape letters: B users, C candidates, N forest nodes, E = N + C edges (node n's incoming edge
is edge n, item c's last code is edge N + c), V codes.
"""

from __future__ import annotations

import torch
from torch import Tensor

from genrec_spec.models.recsys.errors import RecommenderInputError
from genrec_spec.models.recsys.layout import prefix_forest


@torch.no_grad()
def item_log_likelihoods(
    model,  # SemanticIdRecommender
    state,  # HistoryState from model.encode_history
    items: Tensor,  # [C] int64 candidate item indices, shared by all rows, no repeats
    *,
    constrained: bool = True,
    chunk: int = 32,  # scored nodes per tree pass; small trees keep the [B, N, N] mask cheap
) -> Tensor:  # [B, C] log-likelihood of each candidate
    if items.dim() != 1 or items.numel() == 0 or items.unique().numel() != items.numel():
        raise RecommenderInputError(
            f"items must be a non-empty 1-D tensor of distinct item indices [C], got shape "
            f"{tuple(items.shape)}",
            "pass each item to score once",
        )
    codes = model.item_codes[items]  # [C, L]
    order = torch.arange(len(items), device=codes.device)
    for level in reversed(range(codes.shape[1])):  # lexicographic, so subtrees are contiguous
        order = order[torch.sort(codes[order, level], stable=True).indices]
    codes = codes[order]
    forest = prefix_forest(codes)
    nodes, batch = len(forest.codes), state.lengths.numel()

    # Edge e = (parent node, code): the nodes' own incoming edges, then the items' last codes.
    edge_parent = torch.cat([forest.parents, forest.item_nodes[:, -1]])  # [E], -1 = root
    edge_code = torch.cat([forest.codes, codes[:, -1]])  # [E]
    edge_lp = state.level0_log_probs.new_zeros(batch, len(edge_parent))  # [B, E]

    at_root = edge_parent < 0
    root_lp = state.level0_log_probs[:, edge_code[at_root]]  # [B, roots]
    edge_lp[:, at_root] = (
        root_lp - root_lp.logsumexp(dim=1, keepdim=True) if constrained else root_lp
    )

    children = torch.bincount(edge_parent[~at_root], minlength=nodes)  # [N]
    scored = torch.nonzero(children >= (2 if constrained else 1)).squeeze(1)
    # Visit scored nodes subtree by subtree (first item under each node, then level).
    first_item = torch.full((nodes,), len(items), device=codes.device)
    for level in range(forest.item_nodes.shape[1]):
        first_item.scatter_reduce_(
            0, forest.item_nodes[:, level], torch.arange(len(items), device=codes.device), "amin"
        )
    scored = scored[torch.argsort(first_item[scored] * codes.shape[1] + forest.levels[scored])]

    for part in scored.split(chunk):
        context = part
        for _ in range(codes.shape[1] - 2):  # add every ancestor as context
            up = forest.parents[context]
            context = torch.cat([context, up[up >= 0]])
        context = context.unique()  # sorted: levels in order, parents before children
        local_parents = torch.where(
            forest.parents[context] >= 0, torch.searchsorted(context, forest.parents[context]), -1
        )
        out = model.score_tree(
            state,
            forest.codes[context].expand(batch, -1),
            forest.levels[context].expand(batch, -1),
            local_parents.expand(batch, -1),
        )  # [B, n, Vmax]
        edges = torch.nonzero(torch.isin(edge_parent, part)).squeeze(1)  # [e]
        row = torch.searchsorted(context, edge_parent[edges])  # [e] local node of each parent
        raw = out[:, row, edge_code[edges]]  # [B, e]
        if constrained:
            allowed = torch.zeros(out.shape[1:], dtype=torch.bool, device=out.device)
            allowed[row, edge_code[edges]] = True
            lse = out.masked_fill(~allowed, float("-inf")).logsumexp(dim=-1)  # [B, n]
            raw = raw - lse[:, row]
        edge_lp[:, edges] = raw

    score = edge_lp[:, nodes:].clone()  # [B, C] the items' last codes
    for level in range(forest.item_nodes.shape[1]):
        score += edge_lp[:, forest.item_nodes[:, level]]
    out = torch.empty_like(score)
    out[:, order] = score
    return out

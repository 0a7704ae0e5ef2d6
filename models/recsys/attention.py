"""The recommender's two attention rules, over a dense mask, a decoding tree and the training
layout; the model holds the rule of its blocks (``attention_rule``) and every pass calls it.

- ``"transformer"`` blocks: softmax attention (``F.scaled_dot_product_attention``, and the
  shared-context tree-attention op ``kernels.tree_attention`` at decode time).
- ``"hstu"`` blocks (HSTU, Zhai et al., 2024, "Actions Speak Louder than Words"): *pointwise*
  attention. A visible key weighs its value by SiLU(q . k) / n, n a constant (the most tokens a
  history holds), with no softmax across the keys. A token's output is then a plain masked sum,
  so a tree node's output is its history part plus its ancestors' part, each summed apart: the
  tree form needs no log-sum-exp merge and no kernel of its own. With
  ``RecommenderConfig.relative_bias`` each block adds a learned bias of the query's distance to
  the key, b[i - j], to q . k before the SiLU (HSTU's relative attention bias, positions only).
  A code token sits at the position of the item it spells (its anchor's + 1): distance 0 to its
  own ancestors, anchor + 1 - j to history token j, at training and at decode time alike. With
  ``RecommenderConfig.time_bias`` a second table adds a learned number per time bucket of the
  pair (``models.recsys.times``: the time the query predicts minus the key's).

Training and decoding call the same rule on the same visible keys (training's tree mask, the
decoders' history + ancestors), so a node's output at decode time is its training-time output up
to float rounding, under either rule. Pointwise training reads the training layout's structure
(``pointwise_layout_attention``) instead of its dense mask: the sums over the history, over the
history up to a branch's anchor and over a branch's own code tokens are computed apart, about
half the [N, N] products of the dense mask, most of whose entries are masked.

Shape letters: B rows, H heads, M queries, K keys, S root (history) keys, N tree nodes,
Dh head width.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from genrec_spec.kernels import TreePlan, tree_attention
from genrec_spec.models.recsys.errors import RecommenderInputError
from genrec_spec.models.recsys.layout import TrainLayout
from genrec_spec.models.recsys.times import time_gaps

# Pointwise tree attention gathers each node's keys (itself and its ancestors) in trees of more
# nodes than this and masks all N below it: masking costs N x Dh a query, gathering A x Dh (A at
# most the code levels) plus a fixed cost of its own, so small trees mask and wide beams' trees
# gather (the crossover, measured: docs/results/recsys-speed.md).
GATHER_MIN_NODES = 128
# A block's relative bias tables: over distances [R] and over time buckets [129] (None: a
# position bias alone). Only HSTU blocks have them.
BiasTables = tuple[Tensor, Tensor | None]
# q, k, v [B, H, *, Dh], the block's bias tables (None: no bias) -> [B, H, M, Dh]
Attend = Callable[[Tensor, Tensor, Tensor, BiasTables | None], Tensor]


def bias_pairs(
    tables: BiasTables | None, distance: Tensor | None, gap: Tensor | None = None
) -> Tensor | None:
    """Each (query, key) pair's entry in a block's combined bias table (`pair_bias`): its
    distance (query position minus key position, [..., M, K] int64) clamped into the position
    table, times the time table's size plus its time bucket (gap: ``times.time_gaps``) where
    there is a time table. Every block's tables have the same sizes, so a pass computes this
    once for all its blocks (from any block's tables). None without tables."""
    if tables is None:
        return None
    position, time = tables
    index = distance.clamp(0, len(position) - 1)
    if time is None:
        return index
    if gap is None:  # the model checks its inputs' times; this guards callers
        raise ValueError("a time bias needs the pairs' time buckets")
    return index * len(time) + gap


def pair_bias(tables: BiasTables | None, pairs: Tensor | None) -> Tensor | None:
    """The bias of each pair (`bias_pairs`) as [..., 1, M, K] (one for every head):
    position[distance], plus time[gap] with a time table, read from one table of every
    (distance, bucket) sum with ``index_select`` (a clamp and two indexed reads a block cost
    several times more over a history's [T, T] pairs)."""
    if tables is None:
        return None
    position, time = tables
    table = position if time is None else (position[:, None] + time).flatten()  # [R (x G)]
    return table.index_select(0, pairs.flatten()).view(pairs.shape).unsqueeze(-3)


def relative_bias(
    tables: BiasTables | None, distance: Tensor | None, gap: Tensor | None = None
) -> Tensor | None:
    """The bias of each (query, key) pair as [..., 1, M, K] (one bias for every head):
    position[distance] with the distance (query position minus key position, [..., M, K] int64)
    clamped into the table, plus time[gap] with a time table (gap: the pairs' time buckets,
    ``times.time_gaps``). None without tables (blocks without a bias: their passes need not
    compute the distances). A pass of many blocks computes `bias_pairs` once instead."""
    return pair_bias(tables, bias_pairs(tables, distance, gap))


def own_bias(tables: BiasTables | None) -> Tensor | None:
    """The bias of a code token's pairs with its own branch (itself and its ancestors): they sit
    at one position and ask for one time, distance 0 and time bucket 0."""
    if tables is None:
        return None
    position, time = tables
    return position[0] if time is None else position[0] + time[0]


def tree_biases(
    tables: list[BiasTables | None], distance: Tensor | None, gap: Tensor | None = None
) -> list[tuple[Tensor, Tensor] | None]:
    """Every block's biases of a tree pass, each block's (`relative_bias` of the nodes' pairs
    with the history keys [B, 1, 1, S], `own_bias`), from its tables (None for blocks without):
    the blocks' tables are stacked and read once a kind (looked up block by block, a tree pass
    of a deep model made tens of small calls). ``distance`` and ``gap`` [B, 1, S] as
    `relative_bias` takes them."""
    if tables[0] is None:
        return [None] * len(tables)
    position = torch.stack([table[0] for table in tables])  # [layers, R]
    history = position[:, distance.clamp(0, position.shape[1] - 1)]  # [layers, B, 1, S]
    own = position[:, 0]  # [layers]
    if tables[0][1] is not None:
        if gap is None:  # the model checks its inputs' times; this guards callers
            raise ValueError("a time bias needs the pairs' time buckets")
        time = torch.stack([table[1] for table in tables])  # [layers, 129]
        history = history + time[:, gap]
        own = own + time[:, 0]
    return list(zip(history.unsqueeze(-3).unbind(0), own.unbind(0), strict=True))


def tree_distance(root_lens: Tensor, root_size: int) -> Tensor:  # [B] -> [B, 1, S]
    """Each tree node's distance to each of its row's S history keys: nodes sit at the position
    of the item they spell, root_lens (a pass builds it once for all its layers)."""
    return root_lens[:, None, None] - torch.arange(root_size, device=root_lens.device)


def _no_bias(tables: BiasTables | Tensor | None) -> None:
    if tables is not None:  # RecommenderConfig refuses the combination; this guards callers
        raise ValueError("softmax attention takes no relative position bias (HSTU blocks do)")


class SoftmaxRule:
    """Transformer blocks' attention: SDPA, and the tree-attention op at decode time."""

    def __init__(self, backend: str) -> None:
        self.backend = backend  # the tree-attention op's (``kernels.tree_attention``)

    def dense(
        self,
        q: Tensor,  # [B, H, M, Dh]
        k: Tensor,  # [B, H, K, Dh]
        v: Tensor,  # [B, H, K, Dh]
        visible: Tensor | None = None,  # [B, 1, M, K] bool: True where query i sees key j
        causal: bool = False,
        bias: Tensor | None = None,  # [B or 1, 1, M, K] added to q . k (`relative_bias`)
    ) -> Tensor:  # [B, H, M, Dh]
        _no_bias(bias)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, is_causal=causal)

    def tree(
        self, q, k_root, v_root, root_lens, k_tree, v_tree, plan, biases=None
    ) -> Tensor:  # fmt: skip
        """Tree nodes ([B, H, M, Dh]) over a row's history keys and values ([B, H, S, Dh],
        root_lens [B] real) and the tree's own ([B, H, N, Dh]), with the pass's ``TreePlan``;
        ``biases`` the block's (`tree_biases`: over the history keys, and over its own)."""
        _no_bias(biases)
        return tree_attention(
            q, k_root, v_root, root_lens, k_tree, v_tree, plan.parents,
            backend=self.backend, plan=plan,
        )  # fmt: skip

    def layout(self, layout: TrainLayout, dtype: torch.dtype) -> Attend:
        """Attention under a training layout's tree mask: an additive float mask (SDPA's CPU
        kernel runs faster with it than with a bool mask), built once for all layers."""
        hidden = ~layout.visibility()[:, None]  # [B, 1, N, N]
        visible = torch.zeros(hidden.shape, dtype=dtype, device=hidden.device)
        visible.masked_fill_(hidden, float("-inf"))

        def attend(q: Tensor, k: Tensor, v: Tensor, tables: BiasTables | None) -> Tensor:
            _no_bias(tables)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=visible)

        return attend


class PointwiseRule:
    """HSTU blocks' attention (module docstring), every weight divided by ``norm``."""

    def __init__(self, norm: float, relative: bool = False, timed: bool = False) -> None:
        self.norm = norm  # n: the most tokens a history holds
        self.relative = relative  # the blocks have a relative position bias
        self.timed = timed  # and a time bias (`models.recsys.times`)

    def dense(self, q, k, v, visible=None, causal=False, bias=None) -> Tensor:
        """As ``SoftmaxRule.dense``."""
        return pointwise_attention(q, k, v, visible, self.norm, causal, bias)

    def tree(
        self, q, k_root, v_root, root_lens, k_tree, v_tree, plan, biases=None
    ) -> Tensor:  # fmt: skip
        """As ``SoftmaxRule.tree``; reads only the plan's visibility. Every node sits at its
        row's position root_lens (the next item's), so its distance to history key j is
        root_lens - j (`tree_distance`) and to its ancestors 0; it asks for its row's query
        time, as its ancestors do (the distances and buckets of `tree_biases`)."""
        history, own = biases or (None, None)
        return pointwise_tree_attention(
            q, k_root, v_root, k_tree, v_tree, plan, self.norm, history, own
        )

    def layout(self, layout: TrainLayout, dtype: torch.dtype) -> Attend:
        """Attention under a training layout's visibility, read from its structure
        (``pointwise_layout_attention``) instead of its dense mask."""
        tokens, anchors = layout.num_history_tokens, layout.branch_anchor  # anchors [B, P]
        chain = (layout.parents.shape[1] - tokens) // anchors.shape[1]  # code tokens a branch
        time = torch.arange(tokens, device=anchors.device)
        anchor_of = anchors.repeat_interleave(chain, dim=1)[:, :, None]  # [B, P * C, 1]
        seen = time <= anchor_of  # [B, P * C, T]
        # Distances for a relative position bias: history token i to j, i - j; a code token
        # (at its anchor + 1) to j
        distances = (time[:, None] - time, anchor_of + 1 - time) if self.relative else None
        gaps = (None, None)  # the same pairs' time buckets, for a time bias
        if self.timed:
            if layout.key_times is None:
                raise RecommenderInputError(
                    "this model's attention reads time (model.time_bias) but the training "
                    "batch has no timestamps",
                    "train on data with times (`PreparedData.with_times`)",
                )
            key, query = layout.key_times, layout.query_times  # [B, T] each
            code_query = query.gather(1, anchor_of[:, :, 0].clamp(min=0))  # [B, P * C]
            gaps = (time_gaps(query, key), time_gaps(code_query, key))

        pairs = []  # the two parts' `bias_pairs`, made with the first block's tables

        def attend(q: Tensor, k: Tensor, v: Tensor, tables: BiasTables | None) -> Tensor:
            biases = None
            if tables is not None:
                if not pairs:
                    pairs.extend(
                        bias_pairs(tables, d, g) for d, g in zip(distances, gaps, strict=True)
                    )
                history, codes = (pair_bias(tables, p) for p in pairs)
                biases = (history, codes, own_bias(tables))
            return pointwise_layout_attention(q, k, v, seen, chain, self.norm, biases)

        return attend


def pointwise_attention(
    q: Tensor,  # [B, H, M, Dh]
    k: Tensor,  # [B, H, K, Dh]
    v: Tensor,  # [B, H, K, Dh]
    visible: Tensor | None,  # [B or 1, H or 1, M, K] bool: True where query i sees key j
    norm: float,  # n: every weight is divided by it
    causal: bool = False,  # query i sees keys 0..i (queries and keys of the same M tokens)
    bias: Tensor | float | None = None,  # [B or 1, 1, M, K] (or one number) added to q . k
) -> Tensor:  # [B, H, M, Dh]
    """HSTU's attention: sum over the visible keys of SiLU(q . k + bias) / n times their
    values."""
    scores = q @ k.transpose(-1, -2)  # [B, H, M, K]
    weights = F.silu(scores if bias is None else scores + bias)
    if causal:
        weights = weights.tril()
    if visible is not None:
        weights = torch.where(visible, weights, 0.0)
    return (weights @ v) / norm


def pointwise_tree_attention(
    q: Tensor,  # [B, H, M, Dh] the last M tree nodes' queries
    k_root: Tensor,  # [B, H, S, Dh] the history's keys (finite in the padding)
    v_root: Tensor,  # [B, H, S, Dh]
    k_tree: Tensor,  # [B, H, N, Dh]
    v_tree: Tensor,  # [B, H, N, Dh]
    plan: TreePlan,  # the tree's (``kernels.prepare_tree``): which keys each query sees
    norm: float,
    history_bias: Tensor | None = None,  # [B, 1, M or 1, S] added to q . k of the history keys
    tree_bias: Tensor | None = None,  # one number added to q . k of the tree's own keys
) -> Tensor:  # [B, H, M, Dh]
    """Pointwise attention of tree nodes over their row's history and their own ancestors (the
    tree-attention op's visibility, ``kernels.tree_attention``), as two sums. A node sees
    itself and at most a few ancestors: over a tree of more than ``GATHER_MIN_NODES`` nodes
    their keys are gathered (``pointwise_ancestor_attention``), below it all N are masked."""
    history = pointwise_attention(
        q, k_root, v_root, plan.root_visible[:, None, None, :], norm, bias=history_bias
    )
    if k_tree.shape[2] > GATHER_MIN_NODES:
        own = pointwise_ancestor_attention(q, k_tree, v_tree, *plan.ancestor_rows, norm, tree_bias)
    else:
        own = pointwise_attention(q, k_tree, v_tree, plan.visible[:, None], norm, bias=tree_bias)
    return history + own


def pointwise_ancestor_attention(
    q: Tensor,  # [B, H, M, Dh] the last M tree nodes' queries
    k: Tensor,  # [B, H, N, Dh] the tree's keys
    v: Tensor,  # [B, H, N, Dh]
    # [B, M, A] each: the nodes each query sees as rows of [B * N], and which are real
    # (``TreePlan.ancestor_rows``, made once a pass for every layer)
    rows: Tensor,
    real: Tensor,
    norm: float,
    bias: Tensor | None = None,  # one number added to every q . k
) -> Tensor:  # [B, H, M, Dh]
    """``pointwise_attention`` of each query over the A keys it sees, gathered: A x Dh work a
    query instead of N x Dh over a mask."""
    batch, heads, n, width = k.shape
    keys = k.transpose(1, 2).reshape(batch * n, heads, width)[rows]  # [B, M, A, H, Dh]
    values = v.transpose(1, 2).reshape(batch * n, heads, width)[rows]
    scores = (keys * q.transpose(1, 2)[:, :, None]).sum(-1)  # [B, M, A, H]
    weights = F.silu(scores if bias is None else scores + bias)
    weights = weights.masked_fill(~real[..., None], 0.0)
    return ((weights[..., None] * values).sum(2) / norm).transpose(1, 2)


def pointwise_layout_attention(
    q: Tensor,  # [B, H, N, Dh] a training layout's tokens: T history tokens, then P branches
    k: Tensor,  # [B, H, N, Dh] of C code tokens each (``models.recsys.layout.TrainLayout``)
    v: Tensor,  # [B, H, N, Dh]
    branch_history: Tensor,  # [B, P * C, T] bool: the history tokens each code token sees
    chain: int,  # C
    norm: float,
    # the relative biases (`relative_bias`) of the history tokens' pairs [1 or B, 1, T, T],
    # the code tokens' over the history [B, 1, P * C, T] and within a branch (one number)
    biases: tuple[Tensor, Tensor, Tensor] | None = None,
) -> Tensor:  # [B, H, N, Dh]
    """Pointwise attention under the training layout's visibility: a history token sees the
    history up to itself (causal), a code token the history up to its branch's anchor and its
    own branch's code tokens up to itself. Padding and empty branches see more than under the
    dense mask (which shows them only themselves); nothing reads their outputs and no real token
    sees them, so every real token's output is the dense mask's."""
    tokens = branch_history.shape[2]
    qh, kh, vh = q[:, :, :tokens], k[:, :, :tokens], v[:, :, :tokens]
    qc, kc, vc = (t[:, :, tokens:].unflatten(2, (-1, chain)) for t in (q, k, v))  # [B,H,P,C,Dh]
    history_bias, code_bias, own_bias = biases or (None, None, None)
    history = pointwise_attention(qh, kh, vh, None, norm, causal=True, bias=history_bias)
    codes = pointwise_attention(
        q[:, :, tokens:], kh, vh, branch_history[:, None], norm, bias=code_bias
    )
    own = pointwise_attention(qc, kc, vc, None, norm, causal=True, bias=own_bias)  # a branch's
    return torch.cat([history, codes + own.flatten(2, 3)], dim=2)

"""The recommender's two attention rules, over a dense mask, a decoding tree and the training
layout; the model holds the rule of its blocks (``attention_rule``) and every pass calls it.

- ``"transformer"`` blocks: softmax attention (``F.scaled_dot_product_attention``, and the
  shared-context tree-attention op ``kernels.tree_attention`` at decode time).
- ``"hstu"`` blocks (HSTU, Zhai et al., 2024, "Actions Speak Louder than Words"): *pointwise*
  attention. A visible key weighs its value by SiLU(q . k) / n, n a constant (the most tokens a
  history holds), with no softmax across the keys. A token's output is then a plain masked sum,
  so a tree node's output is its history part plus its ancestors' part, each summed apart: the
  tree form needs no log-sum-exp merge and no kernel of its own.

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

from genrec_spec.kernels import tree_attention
from genrec_spec.models.recsys.layout import TrainLayout

Attend = Callable[[Tensor, Tensor, Tensor], Tensor]  # q, k, v [B, H, *, Dh] -> [B, H, M, Dh]


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
    ) -> Tensor:  # [B, H, M, Dh]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, is_causal=causal)

    def tree(self, q, k_root, v_root, root_lens, k_tree, v_tree, plan) -> Tensor:
        """Tree nodes ([B, H, M, Dh]) over a row's history keys and values ([B, H, S, Dh],
        root_lens [B] real) and the tree's own ([B, H, N, Dh]), with the pass's ``TreePlan``."""
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
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=visible)


class PointwiseRule:
    """HSTU blocks' attention (module docstring), every weight divided by ``norm``."""

    def __init__(self, norm: float) -> None:
        self.norm = norm  # n: the most tokens a history holds

    def dense(self, q, k, v, visible=None, causal=False) -> Tensor:  # as SoftmaxRule.dense
        return pointwise_attention(q, k, v, visible, self.norm, causal)

    def tree(self, q, k_root, v_root, root_lens, k_tree, v_tree, plan) -> Tensor:
        """As ``SoftmaxRule.tree``; reads only the plan's visibility."""
        return pointwise_tree_attention(
            q, k_root, v_root, root_lens, k_tree, v_tree, plan.visible, self.norm
        )

    def layout(self, layout: TrainLayout, dtype: torch.dtype) -> Attend:
        """Attention under a training layout's visibility, read from its structure
        (``pointwise_layout_attention``) instead of its dense mask."""
        tokens, anchors = layout.num_history_tokens, layout.branch_anchor  # anchors [B, P]
        chain = (layout.parents.shape[1] - tokens) // anchors.shape[1]  # code tokens a branch
        time = torch.arange(tokens, device=anchors.device)
        seen = time <= anchors.repeat_interleave(chain, dim=1)[:, :, None]  # [B, P * C, T]
        return lambda q, k, v: pointwise_layout_attention(q, k, v, seen, chain, self.norm)


def pointwise_attention(
    q: Tensor,  # [B, H, M, Dh]
    k: Tensor,  # [B, H, K, Dh]
    v: Tensor,  # [B, H, K, Dh]
    visible: Tensor | None,  # [B or 1, H or 1, M, K] bool: True where query i sees key j
    norm: float,  # n: every weight is divided by it
    causal: bool = False,  # query i sees keys 0..i (queries and keys of the same M tokens)
) -> Tensor:  # [B, H, M, Dh]
    """HSTU's attention: sum over the visible keys of SiLU(q . k) / n times their values."""
    weights = F.silu(q @ k.transpose(-1, -2))  # [B, H, M, K]
    if causal:
        weights = weights.tril()
    if visible is not None:
        weights = weights.masked_fill(~visible, 0.0)
    return (weights @ v) / norm


def pointwise_tree_attention(
    q: Tensor,  # [B, H, M, Dh] the last M tree nodes' queries
    k_root: Tensor,  # [B, H, S, Dh] the history's keys (finite in the padding)
    v_root: Tensor,  # [B, H, S, Dh]
    root_lens: Tensor,  # [B] real history keys per row
    k_tree: Tensor,  # [B, H, N, Dh]
    v_tree: Tensor,  # [B, H, N, Dh]
    visible: Tensor,  # [B, M, N] bool: query i sees tree node j (itself or an ancestor)
    norm: float,
) -> Tensor:  # [B, H, M, Dh]
    """Pointwise attention of tree nodes over their row's history and their own ancestors (the
    tree-attention op's visibility, ``kernels.tree_attention``), as two masked sums."""
    seen = torch.arange(k_root.shape[2], device=q.device) < root_lens[:, None]  # [B, S]
    history = pointwise_attention(q, k_root, v_root, seen[:, None, None, :], norm)
    return history + pointwise_attention(q, k_tree, v_tree, visible[:, None], norm)


def pointwise_layout_attention(
    q: Tensor,  # [B, H, N, Dh] a training layout's tokens: T history tokens, then P branches
    k: Tensor,  # [B, H, N, Dh] of C code tokens each (``models.recsys.layout.TrainLayout``)
    v: Tensor,  # [B, H, N, Dh]
    branch_history: Tensor,  # [B, P * C, T] bool: the history tokens each code token sees
    chain: int,  # C
    norm: float,
) -> Tensor:  # [B, H, N, Dh]
    """Pointwise attention under the training layout's visibility: a history token sees the
    history up to itself (causal), a code token the history up to its branch's anchor and its
    own branch's code tokens up to itself. Padding and empty branches see more than under the
    dense mask (which shows them only themselves); nothing reads their outputs and no real token
    sees them, so every real token's output is the dense mask's."""
    tokens = branch_history.shape[2]
    qh, kh, vh = q[:, :, :tokens], k[:, :, :tokens], v[:, :, :tokens]
    qc, kc, vc = (t[:, :, tokens:].unflatten(2, (-1, chain)) for t in (q, k, v))  # [B,H,P,C,Dh]
    history = pointwise_attention(qh, kh, vh, None, norm, causal=True)
    codes = pointwise_attention(q[:, :, tokens:], kh, vh, branch_history[:, None], norm)
    own = pointwise_attention(qc, kc, vc, None, norm, causal=True)  # each branch's own tokens
    return torch.cat([history, codes + own.flatten(2, 3)], dim=2)

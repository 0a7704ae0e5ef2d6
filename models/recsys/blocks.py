"""What the recommender's passes share: its blocks (the pre-norm transformer block, or HSTU's;
attention itself is the caller's, the one thing that differs between training, prefill and tree
scoring) and the state an encoded history leaves for tree scoring.

Shape letters: B users, T history tokens (BOS included), N tokens of a pass, D model width,
H heads, V0 level-0 codes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from genrec_spec.models.recsys.config import RecommenderConfig
from genrec_spec.models.recsys.times import NUM_TIME_BUCKETS


@dataclass
class HistoryState:
    """What `encode_history` leaves for `score_tree`: the per-layer K/V cache of the history."""

    keys: Tensor  # [layers, B, H, T, D/H]
    values: Tensor  # [layers, B, H, T, D/H]
    lengths: Tensor  # [B] int64 history tokens per row (BOS included): the root length
    hidden: Tensor  # [B, D] final hidden state of the last history token (input of the heads)
    level0_log_probs: Tensor  # [B, V0] log-probs of the next item's level-0 code
    truncated: Tensor  # [B] bool, True where the history was longer than max_len
    # [B, 1, T] int64 time bucket of each row's query time to each history key, what a tree
    # node's time bias reads (`models.recsys.times`); None for models without one
    query_gaps: Tensor | None = None

    def rows(self, index: Tensor) -> HistoryState:  # index [b] int64 -> the state of b rows
        return HistoryState(
            keys=self.keys[:, index],
            values=self.values[:, index],
            lengths=self.lengths[index],
            hidden=self.hidden[index],
            level0_log_probs=self.level0_log_probs[index],
            truncated=self.truncated[index],
            query_gaps=None if self.query_gaps is None else self.query_gaps[index],
        )


class Block(nn.Module):
    """Pre-norm transformer block; attention itself is done by the caller (`attend`), which is
    what differs between training, prefill and tree scoring."""

    def __init__(self, config: RecommenderConfig) -> None:
        super().__init__()
        self.heads = config.heads
        self.norm1 = nn.LayerNorm(config.dim)
        self.qkv = nn.Linear(config.dim, 3 * config.dim)
        self.proj = nn.Linear(config.dim, config.dim)
        self.norm2 = nn.LayerNorm(config.dim)
        self.ffn = nn.Sequential(
            nn.Linear(config.dim, config.ffn_mult * config.dim),
            nn.GELU(),
            nn.Linear(config.ffn_mult * config.dim, config.dim),
        )
        self.drop = nn.Dropout(config.dropout)

    def bias_tables(self) -> None:
        """A transformer block has no relative bias (`HstuBlock.bias_tables`)."""
        return None

    def forward(self, x: Tensor, attend, keep: Tensor | None = None) -> Tensor:
        """x: [B, N, D] -> [B, N, D]. With `keep` ([B, N'] token indices) -> [B, N', D]: only
        those tokens' outputs, their queries attending over every token's keys and values (a
        last block whose other outputs nobody reads)."""
        q, k, v = self.qkv(self.norm1(x)).unflatten(-1, (3, self.heads, -1)).permute(2, 0, 3, 1, 4)
        x, q = _kept(keep, x, q)
        out = attend(q, k, v, None).transpose(1, 2).flatten(2)  # [B, H, N, Dh] -> [B, N, D]
        x = x + self.drop(self.proj(out))
        return x + self.drop(self.ffn(self.norm2(x)))


class HstuBlock(nn.Module):
    """HSTU's block (Zhai et al., 2024): U, V, Q, K = SiLU(f1(norm(x))); the attention
    (pointwise, `attention.pointwise_attention`, done by the caller's `attend`) of Q, K over V;
    x + f2(norm(attention) * U). No feed-forward: the U gate is its nonlinearity, so a block
    holds 5 D^2 weights against the transformer block's 12 D^2 (feed-forward 4 D wide). With
    `config.relative_bias` it holds HSTU's relative position bias, one learned number per
    distance 0..max_len + 1 shared by its heads (`attention.relative_bias`), and with
    `config.time_bias` one per time bucket (`models.recsys.times`)."""

    def __init__(self, config: RecommenderConfig) -> None:
        super().__init__()
        self.heads = config.heads
        self.norm1 = nn.LayerNorm(config.dim)
        self.uvqk = nn.Linear(config.dim, 4 * config.dim)
        self.norm2 = nn.LayerNorm(config.dim)
        self.proj = nn.Linear(config.dim, config.dim)
        self.drop = nn.Dropout(config.dropout)
        self.relative_bias = self.time_bias = None
        if config.relative_bias:  # HSTU's initialisation of its bias weights
            self.relative_bias = nn.Parameter(torch.randn(config.max_len + 2) * 0.02)
        if config.time_bias:
            self.time_bias = nn.Parameter(torch.randn(NUM_TIME_BUCKETS + 1) * 0.02)

    def bias_tables(self) -> tuple[Tensor, Tensor | None] | None:
        """The relative bias tables (`attention.BiasTables`: position, time or None), None
        without a bias."""
        return None if self.relative_bias is None else (self.relative_bias, self.time_bias)

    def forward(self, x: Tensor, attend, keep: Tensor | None = None) -> Tensor:
        """As `Block.forward`."""
        u, v, q, k = F.silu(self.uvqk(self.norm1(x))).chunk(4, dim=-1)  # [B, N, D] each
        q, k, v = (t.unflatten(-1, (self.heads, -1)).transpose(1, 2) for t in (q, k, v))
        x, q, u = _kept(keep, x, q, u)
        out = attend(q, k, v, self.bias_tables())  # [B, H, N', Dh]
        out = out.transpose(1, 2).flatten(2)  # [B, N', D]
        return x + self.drop(self.proj(self.norm2(out) * u))


def _kept(keep: Tensor | None, x: Tensor, q: Tensor, *tokens: Tensor) -> tuple[Tensor, ...]:
    """x [B, N, D], q [B, H, N, Dh] and other [B, N, D] tensors at the `keep` ([B, N']) tokens
    only (all of them when keep is None)."""
    if keep is None:
        return (x, q, *tokens)
    rows = keep[..., None].expand(-1, -1, x.shape[-1])  # [B, N', D]
    q = q.gather(2, keep[:, None, :, None].expand(-1, q.shape[1], -1, q.shape[-1]))
    return (x.gather(1, rows), q, *(t.gather(1, rows) for t in tokens))

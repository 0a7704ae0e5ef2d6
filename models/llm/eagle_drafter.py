"""EAGLE's feature drafter (Li et al., 2024): one Llama decoder layer that predicts the target's
next feature from (its current feature, the next token).

The feature f_t is the target's hidden state at position t that its LM head reads: the
final-normed state, hidden layer ``n_layers`` (what EAGLE reads too: the base LlamaModel's
output, before ``lm_head``). The drafter's input at position t is the pair (f_t, x_{t+1}),
x_{t+1} the token after t, and its output there is the predicted feature of position t + 1:

    g_t = Block(W_fc [f_t ; E x_{t+1}] + b_fc)        # attends to the pairs before t (KV cache)
    f_{t+1} ~ g_t,   logits of x_{t+2} = W_lm g_t

E and W_lm are the target's token embedding and LM head, shared and frozen (non-persistent
buffers: checkpoints hold the fc layer, the block and the draft vocabulary). The block is
``models.llm.llama``'s TransformerBlock at the target's widths, with a one-layer StaticKVCache of
its own: a forward leaves its K/V pending and the caller commits the pairs it keeps, exactly as the
target's cache works. While drafting, a pair's feature may be the drafter's own prediction.

EAGLE-3 (Li et al., 2025) reads several target layers instead of one: with ``fused`` = k > 1 an
input fusion ``fuse`` maps the concatenated features of k layers (low, mid, high) [.., k D] to
one feature [.., D], the f_t above: a linear layer, then an RMSNorm, as EAGLE-3 normalises the
fused state (the fused layers' residual streams are not normalised: their norms grow with depth
and have large outliers, where the final-normed state's do not; unnormalised, the untrained
drafter starts from a much higher loss). The drafter's
outputs live in that fused space: while drafting (and in training-time test) a predicted
feature is fed back as is, unfused.

Draft vocabulary: ``vocab_ids`` restricts the drafter's LM head to a subset of tokens (the most
frequent ones): on a CPU the LM head costs more than the decoder layer (SmolLM2: 28M of ~32M
multiply-adds per position at V = 49,152), and tokens outside the subset are simply never
drafted. Exactness does not depend on it: the target verifies every draft.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from genrec_spec.models.llm.cpu_linear import linear
from genrec_spec.models.llm.kv_cache import StaticKVCache
from genrec_spec.models.llm.llama import (
    LlamaConfig,
    LlamaError,
    RMSNorm,
    TransformerBlock,
    begin_tree_pass,
    rope_tables,
)

IGNORE = -100  # vocab_index of a token outside the draft vocabulary


class FeatureDrafter(nn.Module):
    """What the feature drafters share (EAGLE's one layer, ``mtp_drafter``'s MTP modules): the
    target's token embedding and LM head, shared and frozen (the head restricted to the draft
    vocabulary), RoPE tables at the target's widths, one-layer KV caches, and one decoder-layer
    pass over (feature, token) pairs."""

    def __init__(
        self,
        config: LlamaConfig,  # the target's (widths, RoPE, norm eps, max_seq_len)
        embedding: Tensor,  # [V, D] the target's token embeddings (by reference, frozen)
        lm_head: Tensor,  # [V, D] the target's output projection (by reference, frozen)
        vocab_ids: Tensor | None = None,  # [V'] int64 ascending: the draft vocabulary; None = all
    ) -> None:
        super().__init__()
        self.config = replace(config, n_layers=1)
        vocab = config.vocab_size
        ids = torch.arange(vocab, device=lm_head.device) if vocab_ids is None else vocab_ids
        self.register_buffer("vocab_ids", ids.long(), persistent=True)  # [V']
        index = torch.full((vocab,), IGNORE, dtype=torch.long, device=lm_head.device)
        index[ids] = torch.arange(len(ids), device=lm_head.device)
        self.register_buffer(
            "vocab_index", index, persistent=False
        )  # [V] position in V', or IGNORE
        head = lm_head if vocab_ids is None else lm_head[ids]
        self.register_buffer("embedding", embedding.detach(), persistent=False)  # [V, D]
        self.register_buffer("draft_head", head.detach(), persistent=False)  # [V', D]
        # Plain attributes, as in the Llama: fp32 whatever the weights' dtype.
        self._rope_cos, self._rope_sin = rope_tables(self.config, "cpu")

    def new_cache(self, batch_size: int, max_len: int) -> StaticKVCache:
        """An empty one-layer cache for ``batch_size`` rows of up to ``max_len`` pairs."""
        if max_len > self.config.max_seq_len:
            raise LlamaError(
                f"max_len {max_len} exceeds the target's max_seq_len {self.config.max_seq_len}",
                "ask for a shorter cache",
            )
        return StaticKVCache(
            1,
            batch_size,
            self.config.n_kv_heads,
            max_len,
            self.config.head_dim,
            dtype=self.draft_head.dtype,
            device=self.draft_head.device,
        )

    def _rope(self, device: torch.device) -> tuple[Tensor, Tensor]:
        if self._rope_cos.device != device:
            self._rope_cos, self._rope_sin = rope_tables(self.config, device)
        return self._rope_cos, self._rope_sin

    def layer_pass(
        self,
        fc: nn.Module,  # [.., 2 D] -> [.., D]: the pair's projection
        block: TransformerBlock,  # the decoder layer (layer 0 of a one-layer cache)
        features: Tensor,  # [B, N, D] each pair's feature (as the projection reads it)
        embedded: Tensor,  # [B, N, D] each pair's token embedding (as the projection reads it)
        cache: StaticKVCache,  # from new_cache; its committed pairs precede these
        parents: Tensor | None,  # [B, N] int64 tree of the pairs, -1 = after the cache
    ) -> Tensor:  # [B, N, D] the layer's outputs
        """One pass over N pairs per row (a chain when ``parents`` is None), leaving their K/V
        pending in ``cache`` (commit the ones to keep). Differentiable: training runs it over
        whole sequences with a fresh cache."""
        rope = self._rope(features.device)
        plan, cos, sin = begin_tree_pass(cache, features.shape[1], parents, rope)
        return block(fc(torch.cat([features, embedded], dim=-1)), cos, sin, cache, plan)

    def embed(self, tokens: Tensor) -> Tensor:  # [..] int64 -> [.., D] the target's embeddings
        return F.embedding(tokens, self.embedding)

    def logits(self, features: Tensor) -> Tensor:  # [..., D] -> [..., V'] over the draft vocab
        return linear(features, self.draft_head)

    def top_tokens(
        self,
        features: Tensor,  # [B, F, D] predicted features
        width: int,  # W children per feature
    ) -> tuple[Tensor, Tensor]:  # log-probabilities [B, F, W] (over V'), token ids [B, F, W]
        """The W (<= V') most likely next tokens after each feature, best first."""
        log_probs = self.logits(features).float().log_softmax(-1)
        top = log_probs.topk(width, dim=-1)
        return top.values, self.vocab_ids[top.indices]


class EagleDrafter(FeatureDrafter):
    def __init__(
        self,
        config: LlamaConfig,  # the target's (widths, RoPE, norm eps, max_seq_len)
        embedding: Tensor,  # [V, D] the target's token embeddings (by reference, frozen)
        lm_head: Tensor,  # [V, D] the target's output projection (by reference, frozen)
        vocab_ids: Tensor | None = None,  # [V'] int64 ascending: the draft vocabulary; None = all
        fused: int = 1,  # target layers whose features it reads (EAGLE-3: 3)
    ) -> None:
        super().__init__(config, embedding, lm_head, vocab_ids)
        dim, dtype = config.dim, lm_head.dtype
        # One layer needs no fusion: Identity keeps EAGLE-1's state dict (and checkpoints) as is.
        self.fuse = (
            nn.Sequential(nn.Linear(fused * dim, dim), RMSNorm(dim, config.norm_eps)).to(dtype)
            if fused > 1
            else nn.Identity()
        )
        self.fc = nn.Linear(2 * dim, dim, dtype=dtype)
        self.block = TransformerBlock(self.config, layer=0).to(dtype)

    def forward(
        self,
        features: Tensor,  # [B, N, D] f_t of each pair (the target's, or a predicted one)
        tokens: Tensor,  # [B, N] int64 x_{t+1} of each pair
        cache: StaticKVCache,  # from new_cache; its committed pairs precede these
        parents: Tensor | None = None,  # [B, N] int64 tree of the pairs, -1 = after the cache
    ) -> Tensor:  # [B, N, D] predicted features f_{t+1}
        """``layer_pass`` over the pairs (f_t, x_{t+1})."""
        return self.layer_pass(self.fc, self.block, features, self.embed(tokens), cache, parents)

    def forward_with(
        self,
        features: Tensor,  # [B, N, D] f_t of each pair
        tokens: Tensor,  # [B, N] int64 x_{t+1} of each pair
        positions: Tensor,  # [B, N] int64 each pair's position (its RoPE)
        attend: Callable[[Tensor, Tensor, Tensor], Tensor],  # q, k, v -> [B, N, Hq, Dh]
    ) -> Tensor:  # [B, N, D] predicted features f_{t+1}
        """``forward`` with ``attend`` as the layer's attention instead of the cache's tree
        attention: it gets the pairs' q [B, N, Hq, Dh] and k, v [B, N, Hkv, Dh] (RoPE applied)
        and may attend to keys a training loop keeps (EAGLE-3's training-time test)."""
        cos, sin = self._rope(features.device)
        cos, sin = cos[positions][:, :, None], sin[positions][:, :, None]  # [B, N, 1, Dh]
        attention = self.block.attention

        def attention_output(h: Tensor) -> Tensor:  # [B, N, D] normed input -> [B, N, D]
            return attention.wo(attend(*attention.qkv(h, cos, sin)).flatten(2))

        x = self.fc(torch.cat([features, self.embed(tokens)], dim=-1))
        return self.block.around(x, attention_output)

"""Early exit with a trained exit head (self-speculative drafting, as in LayerSkip): the draft is
the target's own first n layers, then a small trained head, then the target's LM head.

    h_n = layers[:n](E x)                       # the target's layers, shared and frozen
    g = h_n + FeedForward(RMSNorm_in(h_n))      # trained: a Llama feed-forward block, no attention
    logits = W_lm[V'] RMSNorm_out(g)            # RMSNorm_out trained, from the target's final norm

Plain early exit (the target's final norm and LM head right on h_n) agrees with SmolLM2-135M's
next token only a few percent of the time: the middle layers' states are not yet in the LM
head's basis. The head maps them there; it starts as plain early exit (the block's output
projection is zero, RMSNorm_out is the target's final norm) and learns from the target's own
next-token distributions (``llm.training.layerskip``).

The draft needs no cache of its own: the target's committed K/V of layers 0..n-1 are exactly
what the truncated model computes, so a draft pass runs on the target's cache
(``Llama.forward_layers``), leaving pending entries in those layers only, which the target's
next pass overwrites. Drafting costs about n / L of a target forward plus the head.

Draft vocabulary: as EAGLE's drafter (``models.llm.eagle_drafter``), ``vocab_ids`` restricts the
head to a subset of frequent tokens, because on a CPU the full LM head (SmolLM2: 28M of ~134M
weights per forward) would cost as much as 8 of its layers. Exactness never depends on it.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor, nn

from genrec_spec.models.llm.cpu_linear import linear
from genrec_spec.models.llm.kv_cache import StaticKVCache
from genrec_spec.models.llm.llama import (
    FeedForward,
    Llama,
    LlamaConfig,
    LlamaError,
    RMSNorm,
)


class ExitHead(nn.Module):
    """The trained part: RMSNorm, a feed-forward residual block and the output norm (and the
    draft vocabulary, a persistent buffer); the LM head rows are the target's, not saved."""

    def __init__(
        self,
        config: LlamaConfig,  # the target's (widths, norm eps)
        final_norm: Tensor,  # [D] the target's final norm weight: RMSNorm_out's start
        lm_head: Tensor,  # [V, D] the target's output projection (by reference, frozen)
        hidden_dim: int,  # the block's inner width
        vocab_ids: Tensor | None = None,  # [V'] int64 ascending: the draft vocabulary; None = all
    ) -> None:
        super().__init__()
        dtype = lm_head.dtype
        self.vocab_size = config.vocab_size
        self.norm_in = RMSNorm(config.dim, config.norm_eps).to(dtype)
        self.feed_forward = FeedForward(replace(config, hidden_dim=hidden_dim)).to(dtype)
        nn.init.zeros_(self.feed_forward.w2.weight)  # starts as plain early exit
        self.norm_out = RMSNorm(config.dim, config.norm_eps).to(dtype)
        with torch.no_grad():
            self.norm_out.weight.copy_(final_norm)
        ids = (
            torch.arange(config.vocab_size, device=lm_head.device)
            if vocab_ids is None
            else vocab_ids
        )
        self.register_buffer("vocab_ids", ids.long().to(lm_head.device))  # [V'] persistent
        head = lm_head if vocab_ids is None else lm_head[ids]
        self.register_buffer("draft_head", head.detach(), persistent=False)  # [V', D]

    def forward(self, hidden: Tensor) -> Tensor:  # [..., D] hidden layer n -> [..., V'] logits
        x = hidden + self.feed_forward(self.norm_in(hidden))
        return linear(self.norm_out(x), self.draft_head)

    def full_logits(self, hidden: Tensor) -> Tensor:  # [..., D] -> [..., V] fp32
        """Logits over the whole vocabulary, -inf outside the draft vocabulary: what samplers
        and acceptance rules expect of a draft."""
        logits = self(hidden).float()
        full = logits.new_full((*logits.shape[:-1], self.vocab_size), float("-inf"))
        return full.index_copy_(-1, self.vocab_ids, logits)


class EarlyExit(nn.Module):
    """The draft model: the target's first ``n_layers`` layers and an exit head, scoring trees
    on the target's own cache. It reads as a Llama to ``NativeTarget`` (``config``,
    ``tok_embeddings``, ``new_cache``, ``forward``, ``encode``), whose caches hold all of the
    target's layers."""

    def __init__(self, target: Llama, head: ExitHead, n_layers: int) -> None:
        super().__init__()
        if not 1 <= n_layers < target.config.n_layers:
            raise LlamaError(
                f"n_layers={n_layers}",
                f"an early exit keeps 1 .. {target.config.n_layers - 1} of the target's "
                f"{target.config.n_layers} layers",
            )
        self.target, self.head, self.n_layers = target, head, n_layers
        self.config = target.config  # vocabulary and context are the target's

    @property
    def tok_embeddings(self) -> nn.Embedding:
        return self.target.tok_embeddings

    def new_cache(
        self, batch_size: int, max_len: int, dtype: torch.dtype | None = None
    ) -> StaticKVCache:
        """A cache of the target (all its layers): drafts share the target's."""
        return self.target.new_cache(batch_size, max_len, dtype)

    @torch.no_grad()
    def forward(
        self,
        tokens: Tensor,  # [B, N] int64
        cache: StaticKVCache,  # the target's
        parents: Tensor | None = None,  # [B, N] int64, -1 = child of the committed root
        *,
        hidden_layers: tuple[int, ...] = (),  # Llama.forward's; the draft exposes none
    ) -> Tensor:  # [B, N, V] fp32 logits, -inf outside the draft vocabulary
        _no_hidden_states(hidden_layers)
        return self.head.full_logits(
            self.target.forward_layers(tokens, cache, parents, n_layers=self.n_layers)
        )

    @torch.no_grad()
    def encode(
        self,
        tokens: Tensor,  # [B, N] int64, a chain (a prompt)
        cache: StaticKVCache,  # the target's
        *,
        hidden_layers: tuple[int, ...] = (),  # Llama.encode's; the draft exposes none
    ) -> dict[int, Tensor]:  # {}: no hidden states
        """``forward`` without the exit head: its layers' K/V become pending (a prefill)."""
        _no_hidden_states(hidden_layers)
        self.target.forward_layers(tokens, cache, None, n_layers=self.n_layers)
        return {}

    def relative_cost(self) -> float:
        """Weights one draft forward reads relative to one target forward (at batch 1 on a CPU
        a forward's time is mostly reading its weights once): the first n layers and the head
        against all layers and the full LM head."""
        config = self.config
        layer = sum(p.numel() for p in self.target.layers[0].parameters())
        head = sum(p.numel() for p in self.head.parameters()) + self.head.draft_head.numel()
        full = config.n_layers * layer + config.vocab_size * config.dim
        return (self.n_layers * layer + head) / full


def _no_hidden_states(hidden_layers: tuple[int, ...]) -> None:
    if hidden_layers:
        raise LlamaError(
            "an early-exit draft exposes no hidden states",
            "draft with it through a proposer that reads none (LayerSkipProposer)",
        )

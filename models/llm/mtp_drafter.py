"""DeepSeek-V3's sequential multi-token prediction (MTP) modules (DeepSeek-AI, 2024, §2.2), trained
after the fact on a frozen target and used as its drafter.

K modules, one per depth, each with its own projection and decoder layer. Module k (1 .. K) at
position i reads the previous depth's state h^{k-1}_i and the token x_{i+k}; h^0_i = f_i is the
target's feature at position i (its final-normed hidden state, the LM head's input: EAGLE's
feature):

    h^k_i = Block_k(W_k [RMSNorm(h^{k-1}_i) ; RMSNorm(E x_{i+k})])
    logits of x_{i+k+1} = W_lm h^k_i

Block_k attends causally over module k's own sequence (its states at positions <= i, a
one-layer KV cache per module). E and W_lm are the target's embedding and LM head, shared and
frozen (``FeatureDrafter``: the head over the draft vocabulary, as EAGLE's).

Two choices, each of which gave lower held-out losses and higher chain acceptance on SmolLM2:
W_k starts as [I, 0.1 W] (W random), so an untrained module passes the previous depth's state
on with a little of the token and its logits start at a sane scale; and the shared head reads
h^k as EAGLE's reads its output, without the final RMSNorm that DeepSeek-V3's output head has
(an RMSNorm with the target's final-norm weights made the untrained modules' logits as sharp
as the target's in random directions).

Unlike EAGLE (one layer applied recurrently to its own predicted features), depth k has a
module of its own, trained on depth k's targets. From the target's feature f_i (x_{i+1} the
root, not yet scored), the chain h^1_i, h^2_i, ... drafts x_{i+2}, x_{i+3}, ...: module k's
token input x_{i+k} is the depth k - 1 draft. ``proposers.mtp`` keeps the K caches in step with
the target.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from genrec_spec.models.llm.eagle_drafter import FeatureDrafter
from genrec_spec.models.llm.kv_cache import StaticKVCache
from genrec_spec.models.llm.llama import LlamaConfig, RMSNorm, TransformerBlock


class MTPModule(nn.Module):
    """One depth's weights: the input norms, the projection W_k and the decoder layer."""

    def __init__(self, config: LlamaConfig, dtype: torch.dtype) -> None:
        super().__init__()
        dim, eps = config.dim, config.norm_eps
        self.feature_norm = RMSNorm(dim, eps).to(dtype)
        self.token_norm = RMSNorm(dim, eps).to(dtype)
        self.fc = nn.Linear(2 * dim, dim, bias=False, dtype=dtype)
        with torch.no_grad():  # [I, 0.1 W]: pass the previous depth's state on (docstring)
            self.fc.weight[:, :dim].copy_(torch.eye(dim))
            self.fc.weight[:, dim:].mul_(0.1)
        self.block = TransformerBlock(config, layer=0).to(dtype)


class MTPDrafter(FeatureDrafter):
    def __init__(
        self,
        config: LlamaConfig,  # the target's (widths, RoPE, norm eps, max_seq_len)
        embedding: Tensor,  # [V, D] the target's token embeddings (by reference, frozen)
        lm_head: Tensor,  # [V, D] the target's output projection (by reference, frozen)
        depths: int = 3,  # K modules: drafts up to K tokens past the root
        vocab_ids: Tensor | None = None,  # [V'] int64 ascending: the draft vocabulary; None = all
    ) -> None:
        super().__init__(config, embedding, lm_head, vocab_ids)
        self.layers = nn.ModuleList(MTPModule(self.config, lm_head.dtype) for _ in range(depths))

    @property
    def depths(self) -> int:
        return len(self.layers)

    def forward(
        self,
        depth: int,  # k in 1 .. K: which module
        features: Tensor,  # [B, N, D] h^{k-1} of each position (h^0: the target's f)
        tokens: Tensor,  # [B, N] int64 x_{i+k} of each position
        cache: StaticKVCache,  # module k's (new_cache); its committed positions precede these
        parents: Tensor | None = None,  # [B, N] int64 tree of the positions, -1 = after the cache
    ) -> Tensor:  # [B, N, D] h^k: the states that draft x_{i+k+1}
        """Module k over N positions per row (a chain when ``parents`` is None), leaving their
        K/V pending in ``cache``."""
        layer = self.layers[depth - 1]
        features, embedded = layer.feature_norm(features), layer.token_norm(self.embed(tokens))
        return self.layer_pass(layer.fc, layer.block, features, embedded, cache, parents)

    def teacher_forced(
        self,
        features: Tensor,  # [R, T, D] the target's f_i at positions 0 .. T - 1
        tokens: Tensor,  # [R, T] int64 x_{i+1}: the token after each position
    ) -> list[Tensor]:  # per depth k = 1 .. K: h^k [R, T - k + 1, D] at positions 0 .. T - k
        """Every module over whole sequences (fresh caches), each fed the previous depth's states
        and the true tokens: module k at position i reads h^{k-1}_i and x_{i+k} = tokens[i+k-1].
        Depths past the sequence's length are left out. Differentiable (training)."""
        rows, length = tokens.shape
        states, out = features, []
        for depth in range(1, min(self.depths, length) + 1):
            n = length - depth + 1
            states = self(depth, states[:, :n], tokens[:, depth - 1 :], self.new_cache(rows, n))
            out.append(states)
        return out

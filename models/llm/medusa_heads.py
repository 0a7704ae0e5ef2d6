"""Medusa-1 draft heads (Cai et al., 2024): K residual blocks on the target's last hidden state.

Head k (k = 1..K) reads the hidden state h at position t (the input of the target's LM head)
and predicts the token at t + 1 + k:

    logits_k(h) = W_lm . (h + SiLU(W_k h + b_k))

W_lm is the target's own LM head, shared and frozen (a non-persistent buffer: checkpoints
hold only W_k and b_k). W_k and b_k start at zero, so every head starts as the target's LM
head itself. The target's LM head is "head 0": it already predicts t + 1.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from genrec_spec.models.llm.cpu_linear import linear
from genrec_spec.models.llm.llama import LlamaError


class MedusaHeads(nn.Module):
    def __init__(
        self,
        lm_head: Tensor,  # [V, D] the target's output projection (by reference, never trained)
        num_heads: int,  # K
    ) -> None:
        super().__init__()
        if num_heads < 1:
            raise LlamaError(f"num_heads={num_heads}", "Medusa needs at least one head")
        dim = lm_head.shape[1]
        # W_k [K, D_out, D_in] and b_k [K, D]: zero, so each head starts as the LM head itself
        self.weight = nn.Parameter(torch.zeros(num_heads, dim, dim, dtype=lm_head.dtype))
        self.bias = nn.Parameter(torch.zeros(num_heads, dim, dtype=lm_head.dtype))
        self.register_buffer("lm_head", lm_head.detach(), persistent=False)  # [V, D]

    @property
    def num_heads(self) -> int:
        return self.weight.shape[0]

    def features(
        self,
        hidden: Tensor,  # [B, N, D] the target's last hidden states
        depth: int | None = None,  # heads 1..depth run (all K when None)
    ) -> Tensor:  # [B, N, depth, D]
        """The residual blocks' outputs: the inputs of the shared LM head."""
        weight, bias = self.weight[:depth], self.bias[:depth]  # [k, D, D], [k, D]
        update = torch.einsum("bnd,ked->bnke", hidden, weight) + bias  # [B, N, k, D]
        return hidden[:, :, None] + F.silu(update)

    def forward(
        self,
        hidden: Tensor,  # [B, N, D] the target's last hidden states
        depth: int | None = None,  # heads 1..depth run (all K when None)
    ) -> Tensor:  # [B, N, depth, V] logits; [..., k - 1, :] predicts the token k + 1 ahead
        """Every head's next-token logits through the target's LM head."""
        return linear(self.features(hidden, depth), self.lm_head)

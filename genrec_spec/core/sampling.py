"""Logits -> next-token distribution (temperature, top-k, top-p) and seeded sampling.

The same ``probabilities`` shapes the target's and the draft's logits, so a draft sampled from
its processed distribution is verified against the target's processed distribution: the
speculative output is then exactly distributed as plain sampling with these settings.
"""

from __future__ import annotations

import torch
from torch import Tensor

from genrec_spec.core.types import SamplingParams


def probabilities(logits: Tensor, sampling: SamplingParams) -> Tensor:  # [..., V] -> [..., V]
    """Processed next-token distribution in float32. Greedy (temperature 0) gives one-hot on the
    argmax (first index on ties), so acceptance rules need no greedy special case."""
    logits = logits.float()
    if sampling.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / sampling.temperature
    vocab = logits.shape[-1]
    if 0 < sampling.top_k < vocab:
        kth = logits.topk(sampling.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # Mass strictly before each token: a token is kept while that mass is below top_p, so
        # the most likely token is always kept and the kept set is the smallest reaching top_p.
        before = sorted_probs.cumsum(-1) - sorted_probs
        drop_sorted = before >= sampling.top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def sample(probs: Tensor, generator: torch.Generator | None) -> Tensor:  # [B, V] -> [B]
    """One token per row, by the exponential race (argmax of p / Exp(1)): exact, batched, and
    free of host syncs; a NaN row yields a garbage index instead of raising mid-step (the decode
    loop checks for NaN once per step)."""
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return (probs / noise).argmax(-1)


def sample_without_replacement(
    probs: Tensor, k: int, generator: torch.Generator | None
) -> tuple[Tensor, Tensor, Tensor]:
    """k distinct tokens per row drawn one after another without replacement (Gumbel-top-k,
    which equals sequential sampling with the drawn tokens removed and renormalised).

    probs [B, V] -> tokens [B, k], conditional [B, k, V] (the distribution token j was drawn
    from: probs minus tokens < j, renormalised), valid [B, k] (False once probs has no mass
    left, e.g. fewer than k tokens survive top-k / top-p).
    """
    noise = torch.empty_like(probs).exponential_(generator=generator)
    keys, tokens = (probs / noise).topk(k, dim=-1)
    valid = keys > 0
    removed = torch.zeros_like(probs)
    conditional = []
    for j in range(k):
        remaining = probs * (1 - removed)
        conditional.append(remaining / remaining.sum(-1, keepdim=True).clamp_min(1e-30))
        removed = removed.scatter(-1, tokens[:, j : j + 1], 1.0)
    return tokens, torch.stack(conditional, dim=1), valid

"""Ranking metrics for next-item recommendation with one held-out item per user.

Every metric at every cut-off K comes from one rank tensor: the 1-based position of the
user's target item in the recommended list, 0 when the list misses it. With a single
relevant item:

- HR@K (hit rate) = 1 if 1 <= rank <= K else 0. Recall@K is the same number (one relevant
  item, so recall is 0 or 1), reported under ``hr@K`` only.
- NDCG@K = 1 / log2(rank + 1) if 1 <= rank <= K else 0 (the ideal DCG is 1: the target
  at rank 1).
- MRR = 1 / rank if rank >= 1 else 0, over the *whole* recommended list (not cut at
  max(ks)): it is MRR@(list length). Pass a list as long as the largest K you report.

Scores are averaged over users. ``per_user_metrics`` keeps the [B] per-user values for
bootstrap confidence intervals and paired tests between decoders.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from genrec_spec.recsys.errors import MetricInputError

DEFAULT_KS = (10, 50, 200)


def ranks_from_topk(
    topk_items: Tensor,  # [B, K] recommended item ids, best first
    targets: Tensor,  # [B] held-out item id per user
) -> Tensor:  # [B] int64, 1-based rank of the target, 0 when it is not in the list
    """Rank of each user's target in their recommended list.

    A list should not repeat an item (beam search over unique Semantic IDs cannot); if it
    does, the first occurrence counts.
    """
    if topk_items.dim() != 2 or targets.dim() != 1 or topk_items.shape[0] != targets.shape[0]:
        raise MetricInputError(
            f"ranks_from_topk needs topk_items [B, K] and targets [B] with the same B, got "
            f"shapes {tuple(topk_items.shape)} and {tuple(targets.shape)}",
            "pass one recommended list and one target item per user",
        )
    hits = topk_items == targets[:, None]  # [B, K]
    # argmax returns the first maximal index, i.e. the first occurrence of the target.
    first_hit = hits.long().argmax(dim=1) + 1  # [B]
    return torch.where(hits.any(dim=1), first_hit, torch.zeros_like(first_hit))


def _check(ranks: Tensor, ks: Sequence[int], max_k: int | None) -> None:
    """Reject inputs whose metrics would be silently wrong."""
    if ranks.dim() != 1 or ranks.numel() == 0 or ranks.is_floating_point():
        raise MetricInputError(
            f"ranks must be a non-empty 1-D integer tensor [B], got dtype {ranks.dtype} and "
            f"shape {tuple(ranks.shape)}",
            "build it with ranks_from_topk(topk_items, targets)",
        )
    if bool((ranks < 0).any()):
        raise MetricInputError(
            f"ranks must be >= 0, got {int(ranks.min())}",
            "pass 1-based ranks, 0 = not retrieved (ranks_from_topk)",
        )
    if len(ks) == 0 or any(k < 1 for k in ks):
        raise MetricInputError(
            f"ks must be a non-empty list of cut-offs >= 1, got {tuple(ks)}",
            "pass cut-offs such as (10, 50, 200)",
        )
    if max_k is not None:
        if max(ks) > max_k:
            raise MetricInputError(
                f"cut-off K = {max(ks)} exceeds the recommended list length {max_k}: @K "
                "metrics would miss every target ranked past the list",
                f"retrieve a top-{max(ks)} list or drop that K",
            )
        if int(ranks.max()) > max_k:
            raise MetricInputError(
                f"a rank exceeds the recommended list length {max_k}: {int(ranks.max())}",
                "pass max_k = the length of the lists the ranks come from",
            )


def per_user_metrics(
    ranks: Tensor,  # [B] 1-based rank, 0 = not retrieved
    ks: Sequence[int] = DEFAULT_KS,
    max_k: int | None = None,
) -> dict[str, Tensor]:  # name -> [B] float64 per-user score
    """Per-user ``hr@K`` and ``ndcg@K`` for every K in ``ks``, and ``mrr``.

    ``max_k`` is the length of the recommended lists the ranks came from; when given, a K
    above it (whose HR would be undercounted) raises instead of returning a wrong number.
    """
    _check(ranks, ks, max_k)
    retrieved = ranks > 0  # [B]
    # Unretrieved users' rank 0 becomes 1 to keep the arithmetic finite; masked out below.
    rank = ranks.clamp(min=1).double()  # [B]
    gain = 1.0 / torch.log2(rank + 1.0)  # [B] DCG of a target at this rank
    reciprocal = torch.where(retrieved, 1.0 / rank, 0.0)  # [B]
    scores = {}
    for k in ks:
        hit = retrieved & (ranks <= k)  # [B]
        scores[f"hr@{k}"] = hit.double()
        scores[f"ndcg@{k}"] = torch.where(hit, gain, 0.0)
    scores["mrr"] = reciprocal
    return scores


def ranking_metrics(
    ranks: Tensor,  # [B] 1-based rank, 0 = not retrieved
    ks: Sequence[int] = DEFAULT_KS,
    max_k: int | None = None,
) -> dict[str, float]:
    """Mean over users of `per_user_metrics`: ``{"hr@10": ..., "ndcg@10": ..., "mrr": ...}``."""
    return {name: float(score.mean()) for name, score in per_user_metrics(ranks, ks, max_k).items()}

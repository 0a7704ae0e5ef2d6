"""Ranking metrics against hand-computed values and a per-user Python loop."""

import math

import pytest
import torch

from genrec_spec.recsys.metrics import per_user_metrics, ranking_metrics, ranks_from_topk

# Four users, lists of 7 items (best first); the targets sit at ranks 3, 1, absent, 7.
TOPK = torch.tensor(
    [
        [7, 3, 9, 1, 4, 0, 2],  # target 9 at rank 3
        [2, 5, 8, 6, 0, 1, 3],  # target 2 at rank 1
        [1, 2, 3, 4, 5, 6, 7],  # target 42 not retrieved -> 0
        [5, 4, 3, 2, 0, 6, 1],  # target 1 at rank 7
    ]
)
TARGETS = torch.tensor([9, 2, 42, 1])


def test_ranks_from_topk():
    assert ranks_from_topk(TOPK, TARGETS).tolist() == [3, 1, 0, 7]
    assert ranks_from_topk(TOPK[:1], TARGETS[:1]).tolist() == [3]  # B = 1
    # A repeated item (not produced by beam search over unique IDs) counts at its first place.
    repeated = torch.tensor([[4, 8, 8], [8, 4, 8]])  # [B, K]
    assert ranks_from_topk(repeated, torch.tensor([8, 8])).tolist() == [2, 1]


def test_ranking_metrics_hand_computed():
    metrics = ranking_metrics(torch.tensor([3, 1, 0, 7]), ks=(1, 3, 7), max_k=7)
    expected = {
        # HR@K: users with 1 <= rank <= K, over 4 users.
        "hr@1": 1 / 4,  # only user 1 (rank 1)
        "hr@3": 2 / 4,  # users 0 and 1
        "hr@7": 3 / 4,  # users 0, 1, 3
        # NDCG@K: 1/log2(rank+1) -> rank 1: 1, rank 3: 1/log2(4) = 1/2, rank 7: 1/log2(8) = 1/3.
        "ndcg@1": 1 / 4,
        "ndcg@3": (1 / 2 + 1) / 4,  # = 0.375
        "ndcg@7": (1 / 2 + 1 + 1 / 3) / 4,  # = 11/24
        # MRR: (1/3 + 1/1 + 0 + 1/7) / 4 = (31/21) / 4 = 31/84.
        "mrr": 31 / 84,
    }
    assert metrics.keys() == expected.keys()
    for name, value in expected.items():
        assert metrics[name] == pytest.approx(value, abs=1e-12), name


def test_per_user_metrics_keep_each_user():
    scores = per_user_metrics(torch.tensor([3, 1, 0, 7]), ks=(3,))
    assert scores["hr@3"].tolist() == [1.0, 1.0, 0.0, 0.0]
    assert scores["ndcg@3"].tolist() == [0.5, 1.0, 0.0, 0.0]
    assert scores["mrr"].tolist() == pytest.approx([1 / 3, 1.0, 0.0, 1 / 7])
    assert all(score.dtype == torch.float64 and score.shape == (4,) for score in scores.values())


def test_k_larger_than_list():
    ranks = torch.tensor([2, 0, 3])  # from lists of length 3
    metrics = ranking_metrics(ranks, ks=(3, 5))
    # Without max_k nothing past rank 3 can be known, so @5 equals @3.
    assert metrics["hr@5"] == metrics["hr@3"] == pytest.approx(2 / 3)
    assert metrics["ndcg@5"] == metrics["ndcg@3"] == pytest.approx((1 / math.log2(3) + 0.5) / 3)
    # With max_k the caller says the lists were 3 long: @5 would be undercounted -> error.
    with pytest.raises(ValueError, match="exceeds the recommended list length 3"):
        ranking_metrics(ranks, ks=(3, 5), max_k=3)


def test_metrics_match_python_loop_on_random_lists():
    generator = torch.Generator().manual_seed(0)
    batch, num_items, list_len, ks = 64, 30, 12, (1, 5, 12)
    topk = torch.stack(
        [torch.randperm(num_items, generator=generator)[:list_len] for _ in range(batch)]
    )  # [B, K] distinct items per row, so ties are impossible
    targets = torch.randint(0, num_items, (batch,), generator=generator)  # [B]
    metrics = ranking_metrics(ranks_from_topk(topk, targets), ks=ks, max_k=list_len)
    ranks = []
    for row, target in zip(topk.tolist(), targets.tolist(), strict=True):
        ranks.append(row.index(target) + 1 if target in row else 0)
    for k in ks:
        assert metrics[f"hr@{k}"] == pytest.approx(sum(0 < r <= k for r in ranks) / batch)
        ndcg = sum(1 / math.log2(r + 1) for r in ranks if 0 < r <= k) / batch
        assert metrics[f"ndcg@{k}"] == pytest.approx(ndcg)
    assert metrics["mrr"] == pytest.approx(sum(1 / r for r in ranks if r) / batch)
    assert 0 < metrics["hr@12"] < 1  # the case exercises both hits and misses


@pytest.mark.parametrize(
    ("ranks", "ks", "message"),
    [
        (torch.tensor([1.0, 2.0]), (1,), "1-D integer"),
        (torch.tensor([], dtype=torch.long), (1,), "non-empty"),
        (torch.tensor([[1, 2]]), (1,), "1-D integer"),
        (torch.tensor([1, -1]), (1,), ">= 0"),
        (torch.tensor([1, 2]), (), "cut-offs >= 1"),
        (torch.tensor([1, 2]), (0, 5), "cut-offs >= 1"),
    ],
)
def test_bad_input_raises(ranks, ks, message):
    with pytest.raises(ValueError, match=message):
        ranking_metrics(ranks, ks=ks)


def test_bad_shapes_and_ranks_past_list_raise():
    with pytest.raises(ValueError, match="same B"):
        ranks_from_topk(TOPK, TARGETS[:3])
    with pytest.raises(ValueError, match="a rank exceeds"):
        ranking_metrics(torch.tensor([1, 9]), ks=(5,), max_k=5)

import json

import numpy as np
import pytest
import torch

from genrec_spec.data_pipelines.errors import DataError
from genrec_spec.data_pipelines.semantic_ids import (
    SemanticIdConfig,
    build_semantic_ids,
    collision_codes,
)


def blobs(n: int, dim: int, seed: int = 0) -> torch.Tensor:  # [n, dim]
    """Clustered points, like item embeddings: 10 centres plus noise."""
    gen = torch.Generator().manual_seed(seed)
    centres = torch.randn(10, dim, generator=gen)
    pick = torch.randint(10, (n,), generator=gen)
    return centres[pick] + 0.3 * torch.randn(n, dim, generator=gen)


def assert_unique_ids(ids, n):
    assert ids.codes.dtype == torch.int64 and ids.codes.shape[0] == n
    assert len(torch.unique(ids.codes, dim=0)) == n
    assert ids.codes.shape[1] == len(ids.codebook_sizes)
    assert (ids.codes >= 0).all()
    assert (ids.codes < torch.tensor(ids.codebook_sizes)).all()


def test_rq_ids_are_unique_and_stats_consistent():
    emb = blobs(300, 16)
    ids = build_semantic_ids(emb, SemanticIdConfig(levels=3, codebook_size=8))
    assert_unique_ids(ids, 300)
    s = ids.stats
    json.dumps(s)  # plain values, ready for a manifest
    assert ids.has_collision_level and ids.codes.shape[1] == 4
    assert ids.codebook_sizes == (8, 8, 8, s["max_items_per_prefix"])
    assert s["collisions_before_code"] == int((ids.codes[:, -1] > 0).sum())
    assert s["unique_prefixes"] == len(torch.unique(ids.codes[:, :3], dim=0))
    assert s["unique_prefixes"] + s["collisions_before_code"] == 300
    assert len(s["utilisation"]) == 3 and all(0 < u <= 1 for u in s["utilisation"])
    assert all(1 <= p <= 8 for p in s["perplexity"])
    assert s["backend"] in ("faiss-cpu", "faiss-gpu")


def test_seeded_builds_are_identical():
    emb = blobs(300, 16)
    for config in (
        SemanticIdConfig(levels=2, codebook_size=16, seed=3),
        SemanticIdConfig(kind="pq", pq_digits=4, codebook_size=16, seed=3, opq=True),
    ):
        a, b = build_semantic_ids(emb, config), build_semantic_ids(emb, config)
        assert torch.equal(a.codes, b.codes)
    other = build_semantic_ids(emb, SemanticIdConfig(levels=2, codebook_size=16, seed=4))
    assert not torch.equal(a.codes, other.codes)


def test_more_rq_levels_quantise_better():
    emb = blobs(300, 16)
    configs = [SemanticIdConfig(levels=k, codebook_size=8) for k in (1, 2, 3)]
    errors = [build_semantic_ids(emb, c).stats["quantization_mse"] for c in configs]
    assert errors[0] > errors[1] > errors[2]


def test_duplicates_get_collision_codes_in_item_order():
    emb = blobs(100, 16)
    emb[[10, 40, 70]] = emb[5].clone()  # four items with one embedding
    for config in (
        SemanticIdConfig(levels=2, codebook_size=8),
        SemanticIdConfig(kind="pq", pq_digits=8, codebook_size=8),
    ):
        ids = build_semantic_ids(emb, config)
        assert_unique_ids(ids, 100)
        assert ids.has_collision_level and ids.codebook_sizes[-1] >= 4
        assert ids.codes[[5, 10, 40, 70], -1].tolist() == [0, 1, 2, 3]
        assert torch.equal(ids.codes[[5, 10, 40, 70], :-1], ids.codes[[5] * 4, :-1])


def test_pq_adds_collision_level_only_when_needed():
    emb = torch.randn(300, 16, generator=torch.Generator().manual_seed(0))  # no clusters
    ids = build_semantic_ids(emb, SemanticIdConfig(kind="pq", pq_digits=8, codebook_size=16))
    assert_unique_ids(ids, 300)
    assert not ids.has_collision_level and ids.codebook_sizes == (16,) * 8
    assert ids.stats["collisions_before_code"] == 0 and ids.stats["max_items_per_prefix"] == 1
    assert len(ids.stats["utilisation"]) == 8


def test_collision_codes_rank_within_groups():
    codes = np.array([[1, 2], [0, 0], [1, 2], [0, 0], [1, 2], [3, 3]])
    assert collision_codes(codes).tolist() == [0, 0, 1, 1, 2, 0]


def test_bad_inputs_raise():
    emb = blobs(50, 16)
    with pytest.raises(DataError, match=r"codebook size 64 .* 50 items.*--codebook-size <= 50"):
        build_semantic_ids(emb, SemanticIdConfig(codebook_size=64))
    with pytest.raises(DataError, match="does not divide"):
        build_semantic_ids(emb, SemanticIdConfig(kind="pq", pq_digits=5, codebook_size=8))
    bad = emb.clone()
    bad[3, 2] = float("nan")
    with pytest.raises(DataError, match="NaN"):
        build_semantic_ids(bad, SemanticIdConfig(codebook_size=8))
    with pytest.raises(DataError, match="non-empty"):
        build_semantic_ids(torch.zeros(0, 16), SemanticIdConfig(codebook_size=8))
    with pytest.raises(DataError, match="kind"):
        SemanticIdConfig(kind="vq")
    with pytest.raises(DataError, match="out of range"):
        SemanticIdConfig(levels=0)

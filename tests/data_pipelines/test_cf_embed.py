"""Collaborative item embeddings: items consumed by the same users land together, items nobody
trained on get zeros, the mix keeps each part's weight, and prepare cuts IDs from the mix."""

import numpy as np
import pytest
import torch

from genrec_spec.data_pipelines.cf_embed import cf_embeddings, mix_embeddings
from genrec_spec.data_pipelines.errors import DataError


def histories(groups: list[tuple[int, list[int]]]) -> tuple[np.ndarray, np.ndarray]:
    """(values, offsets) of ``users`` users per group, each with a random order of its items."""
    rng = np.random.default_rng(0)
    rows = [rng.permutation(items) for users, items in groups for _ in range(users)]
    offsets = np.concatenate([[0], np.cumsum([len(r) for r in rows])])
    return np.concatenate(rows).astype(np.int64), offsets.astype(np.int64)


def test_co_consumed_items_are_close_and_unseen_items_zero():
    """Two communities with disjoint tastes (items 0-4 and 5-9, plus item 10 both like); item 11
    appears in no history."""
    values, offsets = histories([(30, [0, 1, 2, 3, 4, 10]), (30, [5, 6, 7, 8, 9, 10])])
    vectors = cf_embeddings(values, offsets, num_items=12, dim=4)
    assert vectors.shape == (12, 4) and vectors.dtype == torch.float32
    cosine = vectors @ vectors.T  # [I, I]
    assert cosine[:5, :5].min() > 0.99 and cosine[5:10, 5:10].min() > 0.99
    assert cosine[:5, 5:10].abs().max() < 0.05
    torch.testing.assert_close(vectors[:11].norm(dim=1), torch.ones(11))
    assert torch.equal(vectors[11], torch.zeros(4))


def test_mix_weights_each_part():
    text = torch.nn.functional.normalize(torch.randn(5, 6), dim=1)
    cf = torch.nn.functional.normalize(torch.randn(5, 3), dim=1)
    mixed = mix_embeddings(text, cf, 0.25)
    assert mixed.shape == (5, 9)
    torch.testing.assert_close(mixed[:, :6].norm(dim=1) ** 2, torch.full((5,), 0.75))
    torch.testing.assert_close(mixed[:, 6:].norm(dim=1) ** 2, torch.full((5,), 0.25))


def test_rank_out_of_range_is_a_clear_error():
    values, offsets = histories([(3, [0, 1, 2])])
    with pytest.raises(DataError, match="--cf-dim between 1 and 2"):
        cf_embeddings(values, offsets, num_items=3, dim=3)


def test_prepare_with_collaborative_ids(tmp_path):
    """--cf-weight: the saved ID vectors are [text, collaborative] with the asked shares, built
    from training histories only, and the IDs stay unique."""
    import pandas as pd

    from genrec_spec.data_pipelines.prepare import PrepareConfig, prepare

    out = tmp_path / "ml-100k-cf"
    config = PrepareConfig(cf_weight=0.5, cf_dim=32, long_id_digits=0, progress=False)
    manifest = prepare("ml-100k", out, config)
    assert manifest["embedding"]["dim"] == 384 + 32 and manifest["embedding"]["cf_weight"] == 0.5
    assert manifest["semantic_id"]["collisions"] == 0
    emb = torch.from_numpy(np.load(out / "item_embeddings.npy"))
    torch.testing.assert_close(emb[:, :384].norm(dim=1) ** 2, torch.full((len(emb),), 0.5))
    train = pd.read_parquet(out / "train.parquet")
    values = np.concatenate(train["history"].to_list())
    offsets = np.concatenate([[0], np.cumsum(train["history"].map(len))])
    expected = cf_embeddings(values, offsets, len(emb), 32) * 0.5**0.5
    torch.testing.assert_close(emb[:, 384:], expected)

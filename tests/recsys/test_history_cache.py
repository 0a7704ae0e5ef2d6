"""The history cache: every decoder answers the same with it as without it over repeated,
grown, empty and over-long histories; which rows hit; eviction by bytes; a foreign model."""

from __future__ import annotations

import pytest
import torch

from genrec_spec.core.catalogue import TokenTrie
from genrec_spec.recsys.decoders.registry import DECODERS
from genrec_spec.recsys.history_cache import HistoryCache
from genrec_spec.recsys.recommend import RecommendInputError, recommend
from genrec_spec.recsys.target import RecommenderTarget


def _calls(model) -> list[list[list[int]]]:
    """Batches of histories as a service sees them over time: users come back with their
    history grown by a few items, or unchanged; new users; histories past max_len."""
    g = torch.Generator().manual_seed(0)
    users = [torch.randint(0, model.num_items, (30,), generator=g).tolist() for _ in range(5)]
    grown = [0, 2, 5, 9, 11]  # items each user has now
    calls = []
    for step in ([0, 0, 0, 0, 0], [1, 0, 3, 0, 1], [0, 0, 0, 0, 0], [2, 1, 20, 4, 1]):
        grown = [g + s for g, s in zip(grown, step, strict=True)]
        calls.append([u[:n] for u, n in zip(users, grown, strict=True)])
    return calls


@pytest.mark.parametrize(
    "decoder, options",
    [(name, {}) for name in DECODERS] + [("spec_beam", {"draft": "none"})],  # no draft tree
)
def test_cached_lists_equal_uncached(tiny_model, decoder, options):
    model, _ = tiny_model
    cache = HistoryCache(model, max_extend=3)
    for histories in _calls(model):
        want = recommend(model, histories, k=8, decoder=decoder, **options)
        got = recommend(model, histories, k=8, decoder=decoder, history_cache=cache, **options)
        assert torch.equal(got.items, want.items)
        assert torch.allclose(got.scores, want.scores, atol=1e-4)
        assert got.stats.truncated_histories == want.stats.truncated_histories


def test_decodes_through_a_cache_derive_the_models_tables_once(tiny_model, monkeypatch):
    """The core's target and catalogue of a model are made once, not once per request through
    its history cache (a service's every request goes through one)."""
    model, _ = tiny_model
    built = []
    monkeypatch.setattr(RecommenderTarget, "__init__", counted(RecommenderTarget.__init__, built))
    monkeypatch.setattr(TokenTrie, "from_sequences", counted(TokenTrie.from_sequences, built))
    cache = HistoryCache(model)
    for histories in _calls(model):
        for decoder in ("beam", "spec_beam"):
            recommend(model, histories, k=8, decoder=decoder, history_cache=cache)
    assert len(built) <= 2  # one target and one catalogue (none if an earlier test made them)


def counted(function, calls: list):
    def count(*args, **kwargs):
        calls.append(function)
        return function(*args, **kwargs)

    return count


def test_which_rows_hit(tiny_model):
    model, _ = tiny_model
    max_len = model.config.max_len
    cache = HistoryCache(model, max_extend=3)
    long = list(range(max_len + 2))
    state = cache.encode_rows([[1, 2], [], long])
    assert cache.counts == {
        "exact": 0,
        "extended": 0,
        "missed": 3,
        "tokens_encoded": 3 + 1 + max_len + 1,
    }
    # [1, 2, 3] extends [1, 2]; [4, 5] extends [] (BOS); the long one slid: a miss; [1, 2] hits.
    cache.encode_rows([[1, 2, 3], [4, 5], long + [7], [1, 2]])
    assert cache.counts == {
        "exact": 1,
        "extended": 2,
        "missed": 4,
        "tokens_encoded": 3 + 1 + 2 * (max_len + 1) + 3,
    }
    # Four new items are more than max_extend = 3 (a miss); the long one hits exactly.
    cache.encode_rows([[1, 2, 3, 4, 5, 6, 7], long])
    assert cache.counts["missed"] == 5 and cache.counts["exact"] == 2
    assert len(cache) == 7 and state.truncated.tolist() == [False, False, True]


def test_eviction_keeps_the_byte_budget(tiny_model):
    model, _ = tiny_model
    one = HistoryCache(model)
    one.encode_rows([[3, 4, 5]])
    budget = int(2.5 * one.bytes)  # room for two such entries
    cache = HistoryCache(model, max_bytes=budget)
    cache.encode_rows([[1, 2, 3], [2, 3, 4]])
    cache.encode_rows([[1, 2, 3]])  # now the most recently used
    cache.encode_rows([[3, 4, 5]])  # evicts [2, 3, 4]
    assert len(cache) == 2 and cache.bytes <= budget
    cache.encode_rows([[1, 2, 3], [2, 3, 4]])
    assert cache.counts["exact"] == 2 and cache.counts["missed"] == 4


def test_a_cache_of_another_model_is_refused(tiny_model):
    model, data = tiny_model
    other = HistoryCache(type(model)(model.config, data.item_codes, data.codebook_sizes))
    with pytest.raises(RecommendInputError, match="another model"):
        recommend(model, [[1]], k=2, history_cache=other)
    with pytest.raises(ValueError, match="max_bytes"):
        HistoryCache(model, max_bytes=-1)

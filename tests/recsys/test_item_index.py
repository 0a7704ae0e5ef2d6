"""The approximate item index (`recsys.item_index`): its top-K against the exact product in the
model's own geometry (dot product and cosine over a temperature), `dense` through it with its
recall against the exact list, and `spec_beam`'s "items" draft through it, still beam's lists."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from genrec_spec.data_pipelines.trie import PrefixTrie
from genrec_spec.models.recsys.config import ItemObjectiveConfig, RecommenderConfig
from genrec_spec.recsys import item_index as item_index_module
from genrec_spec.recsys.decoders import beam, dense, spec_beam
from genrec_spec.recsys.decoders.spec_beam import same_top_k
from genrec_spec.recsys.errors import DecodeOptionError
from genrec_spec.recsys.item_index import (
    ItemIndex,
    ItemIndexConfig,
    exact_top_items,
    item_index,
    recall_at_k,
    top_items,
    use_index,
)


def _model(build, seed: int, items: int, temperature: float, tied: bool = False):
    """A random model (`build`: the random_recommender fixture) with the item objective over
    `items` items (3 levels + the collision code); `tied`: level 0 and the deeper levels tied
    to it."""
    objective = ItemObjectiveConfig(temperature=temperature, level0=tied)
    if not tied:
        objective = replace(objective, tied_levels=None)
    config = RecommenderConfig(
        dim=16,
        layers=1,
        heads=2,
        max_len=10,
        item_objective=objective,
        parallel_heads=None,
        long_id_heads=None,
        draft_head=None,
    )
    return build(config, seed, (6, 5, 4), items)


def _trie(model) -> PrefixTrie:
    return PrefixTrie.from_codes(model.item_codes, tuple(model.codebook_sizes))


@pytest.mark.parametrize("temperature", [0.0, 0.05])
@pytest.mark.parametrize("kind", ["ivf", "ivf-pq", "ivf-hnsw", "hnsw"])
def test_index_top_k_is_the_exact_top_k_on_a_small_catalogue(
    temperature, kind, random_recommender, uneven_histories, monkeypatch
):
    """With every list probed (IVF; with 4-bit codes, every item rescored: refine_factor x K is
    past the catalogue) or a candidate list past the catalogue (HNSW) the index is exact: the
    same items in the same order with the model's logits, in its geometry (plain dot product, or
    cosine over a temperature). The items go in over several add calls, as at 10^7."""
    monkeypatch.setattr(item_index_module, "ADD_ROWS", 64)
    model = _model(random_recommender, 0, 150, temperature)
    values, offsets = uneven_histories(model, 7, seed=1)
    hidden = model.encode_history(values, offsets).hidden  # [B, D]
    config = ItemIndexConfig(kind=kind, nprobe=1000, ef_search=200, list_items=10)
    found = top_items(model, hidden, 12, config)
    want = exact_top_items(model, hidden, 12)
    assert torch.equal(found.items, want.items)
    assert torch.allclose(found.scores, want.scores, atol=1e-4)
    assert torch.equal(recall_at_k(found.items, want.items), torch.ones(7))


def test_ivf_pq_on_a_catalogue_too_small_for_its_codes():
    """Fewer items than a 4-bit code has values: flat lists, and every list probed is exact."""
    table = torch.nn.functional.normalize(
        torch.randn(10, 16, generator=torch.manual_seed(0)), dim=1
    )
    index = ItemIndex(table, ItemIndexConfig(kind="ivf-pq"))
    found = index.search(table[:3], 4)
    assert torch.equal(found.items, (table[:3] @ table.T).topk(4, dim=1).indices)


def test_exact_top_items_in_row_chunks(random_recommender, uneven_histories, monkeypatch):
    """The exact top-K taken a few rows at a time is the top-K of the whole product."""
    model = _model(random_recommender, 0, 150, 0.05)
    values, offsets = uneven_histories(model, 7, seed=4)
    hidden = model.encode_history(values, offsets).hidden  # [B, D]
    whole = model.item_scores(hidden).topk(12, dim=1)
    monkeypatch.setattr(item_index_module, "EXACT_LOGITS", 2 * model.num_items)  # 2 rows
    chunked = exact_top_items(model, hidden, 12)
    assert torch.equal(chunked.items, whole.indices)
    torch.testing.assert_close(chunked.scores, whole.values)  # products of other row counts


@pytest.mark.parametrize("kind", ["ivf", "ivf-pq", "ivf-hnsw"])
def test_index_recall_on_a_larger_catalogue(kind, random_recommender, uneven_histories):
    """Default settings, a catalogue with several lists not probed: most of the exact top-10."""
    model = _model(random_recommender, 1, 3000, 0.05)
    values, offsets = uneven_histories(model, 16, seed=2)
    recall = dense.index_recall(model, values, offsets, k=10, index_kind=kind)
    assert recall.shape == (16,)
    assert float(recall.mean()) >= 0.5


def test_ivf_hnsw_lists_keep_their_size_as_the_catalogue_grows(random_recommender):
    """ivf-hnsw: about I / list_items lists (its two-level k-means), none far above that size,
    and with a fraction of them probed through the HNSW quantizer most of the exact top-10."""
    faiss = pytest.importorskip("faiss")
    model = _model(random_recommender, 3, 3000, 0.05)
    table = model.item_keys().detach()  # [I, D] the rows the index holds
    query = torch.nn.functional.normalize(table[:40] + 0.1 * torch.randn_like(table[:40]), dim=1)
    for items in (1500, 3000):
        config = ItemIndexConfig(kind="ivf-hnsw", list_items=20, nprobe=16)
        index = ItemIndex(table[:items], config)
        lists = faiss.extract_index_ivf(index.index)
        sizes = [lists.get_list_size(i) for i in range(lists.nlist)]
        assert abs(lists.nlist - items // 20) <= 0.1 * items / 20
        assert sum(sizes) == items and max(sizes) <= 5 * 20
        found = index.search(query, 10)
        exact = (query @ table[:items].T).topk(10, dim=1).indices
        assert float(recall_at_k(found.items, exact).mean()) >= 0.8


def test_index_is_cached_per_item_table(random_recommender):
    model = _model(random_recommender, 2, 200, 0.05)
    first = item_index(model)
    assert item_index(model) is first
    assert item_index(model, ItemIndexConfig(kind="hnsw")) is not first  # another config
    with torch.no_grad():
        model.embeddings.embeddings["t_item"].weight.mul_(2.0)  # an in-place rewrite
    assert item_index(model) is not first


@pytest.mark.parametrize(
    ("temperature", "kind"), [(0.0, "ivf"), (0.05, "ivf"), (0.0, "ivf-pq"), (0.05, "hnsw")]
)
def test_dense_through_the_index_reports_its_recall(
    temperature, kind, random_recommender, uneven_histories
):
    """dense with the index of either kind forced: the index's items with their logits; its
    recall against dense's exact list is what `index_recall` reports."""
    model = _model(random_recommender, 3, 3000, temperature)
    values, offsets = uneven_histories(model, 9, seed=3)
    trie = _trie(model)
    exact = dense.decode(model, values, offsets, k=10, trie=trie, item_search="exact")
    approx = dense.decode(
        model, values, offsets, k=10, trie=trie, item_search="index", index_kind=kind
    )
    assert approx.items.shape == exact.items.shape == (9, 10)
    assert approx.stats.item_index is True and exact.stats.item_index is None
    recall = dense.index_recall(model, values, offsets, k=10, index_kind=kind)
    assert torch.equal(recall_at_k(approx.items, exact.items), recall)
    # The logits rank like the exact log-probs: equal where both lists hold the item.
    logits = model.item_scores(model.encode_history(values, offsets).hidden)
    assert torch.allclose(approx.scores, logits.gather(1, approx.items), atol=1e-4)


def test_auto_uses_the_index_from_the_threshold(random_recommender, uneven_histories):
    model = _model(random_recommender, 4, 150, 0.05)
    assert not use_index(model, "auto")
    assert use_index(model, "auto", ItemIndexConfig(min_items=150))
    assert use_index(model, "index") and not use_index(model, "exact")
    with pytest.raises(DecodeOptionError, match="item_search must be one of"):
        use_index(model, "faiss")
    values, offsets = uneven_histories(model, 2, seed=1)
    with pytest.raises(DecodeOptionError, match="item index kind 'annoy'"):
        dense.decode(model, values, offsets, k=3, trie=_trie(model), index_kind="annoy")
    values, offsets = uneven_histories(model, 2, seed=0)
    with pytest.raises(DecodeOptionError, match="item_search must be one of"):
        spec_beam.decode(model, values, offsets, k=3, trie=_trie(model), item_search="hnsw")
    with pytest.raises(DecodeOptionError, match="is not one of"):
        ItemIndexConfig(kind="flat")


@pytest.mark.parametrize("seed", [0, 1])
def test_spec_beam_with_the_indexed_items_draft_equals_beam(
    seed, random_recommender, uneven_histories
):
    """The index only decides which prefixes the "items" draft proposes: the lists stay beam's,
    whatever it misses (narrow and wide drafts, few and many lists probed)."""
    model = _model(random_recommender, seed, 400, 0.05, tied=True)
    trie = _trie(model)
    values, offsets = uneven_histories(model, 10, seed=seed)
    for k, width in [(1, 1), (5, 10), (30, 45)]:
        want = beam.decode(model, values, offsets, k=k, trie=trie, beam_width=width)
        for draft_width in (1, None, 200):
            got = spec_beam.decode(
                model,
                values,
                offsets,
                k=k,
                trie=trie,
                beam_width=width,
                draft="items",
                draft_width=draft_width,
                item_search="index",
            )
            assert same_top_k(want, got).all(), (k, width, draft_width)
            assert 0.0 < got.stats.draft_hit_rate <= 1.0


def test_ivf_lists_scanned_grow_with_the_catalogue(random_recommender):
    """ivf-pq scans at least min_probe_share of its lists (recall follows the share scanned);
    ivf-hnsw keeps its nprobe (its lists do not grow); a share outside [0, 1] is refused."""
    faiss = pytest.importorskip("faiss")
    table = _model(random_recommender, 3, 3000, 0.05).item_keys().detach()  # [I, D]
    share = ItemIndexConfig(kind="ivf-pq", nprobe=2, min_probe_share=0.25, lists_per_sqrt_item=2)
    probed = faiss.extract_index_ivf(ItemIndex(table, share).index)
    assert probed.nprobe == math.ceil(0.25 * probed.nlist) > 2
    fixed = ItemIndexConfig(kind="ivf-hnsw", nprobe=2, min_probe_share=0.25, list_items=20)
    assert faiss.extract_index_ivf(ItemIndex(table, fixed).index).nprobe == 2
    with pytest.raises(DecodeOptionError, match="min_probe_share"):
        ItemIndexConfig(min_probe_share=1.5)

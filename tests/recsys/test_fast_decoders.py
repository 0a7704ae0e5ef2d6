"""The fast approximate decoders (heads, rpg, nezha, dense) on tiny random models: valid distinct
items, equality with brute-force scoring item by item, the item graph, bad input."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from genrec_spec.data_pipelines.trie import PrefixTrie
from genrec_spec.models.recsys.config import RecommenderConfig
from genrec_spec.models.recsys.recommender import SemanticIdRecommender
from genrec_spec.recsys.decoders import dense, heads, nezha, rpg
from genrec_spec.recsys.decoders.beam import DecodeOptionError

DECODERS = {
    "heads": (heads.decode, {}),
    "heads-head0": (heads.decode, {"level0": "head"}),
    "rpg": (rpg.decode, {}),  # (auto: exact mode on a catalogue this small)
    "rpg-graph": (rpg.decode, {"mode": "graph"}),
    "rpg-narrow": (rpg.decode, {"mode": "graph", "beam": 2, "steps": 1, "degree": 2, "seeds": 3}),
    "rpg-exact": (rpg.decode, {"mode": "exact"}),
    "nezha": (nezha.decode, {}),
    "dense": (dense.decode, {}),
}


def _histories(model, lengths: list[int], seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    values = torch.randint(0, model.num_items, (sum(lengths),), generator=g)
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    return values, offsets


def _trie(model) -> PrefixTrie:
    return PrefixTrie.from_codes(model.item_codes, tuple(model.codebook_sizes))


def _check_valid(items: torch.Tensor, scores: torch.Tensor, num_items: int) -> None:
    """Every row: catalogue items (or -1 pads at the end), no repeats, scores best first."""
    for row, row_scores in zip(items.tolist(), scores, strict=True):
        real = [i for i in row if i >= 0]
        assert row[: len(real)] == real, "pads must come last"
        assert all(0 <= i < num_items for i in real)
        assert len(set(real)) == len(real), f"duplicate item in {row}"
        finite = row_scores[: len(real)]
        assert torch.isfinite(finite).all()
        assert (finite[:-1] >= finite[1:]).all()


@pytest.mark.parametrize("name", sorted(DECODERS))
@pytest.mark.parametrize("k", [1, 7, 40])
def test_valid_distinct_items(tiny_model, name, k):
    model, _ = tiny_model
    decode, options = DECODERS[name]
    values, offsets = _histories(model, [5, 0, 20, 3])  # an empty and a truncated history
    out = decode(model, values, offsets, k=k, trie=_trie(model), **options)
    assert out.items.shape == out.scores.shape == (4, k)
    _check_valid(out.items, out.scores, model.num_items)
    assert out.stats.target_passes == 1
    assert out.stats.truncated_histories == 1
    if not name.endswith("narrow"):  # every item is reachable: nothing is padded
        assert (out.items >= 0).all()


@torch.no_grad()
def _brute_force(model, values, offsets, score_item) -> torch.Tensor:  # [B, I]
    """score_item(state of one user, item) -> float, for every user and item, one at a time."""
    rows = []
    for b in range(len(offsets) - 1):
        history = values[offsets[b] : offsets[b + 1]]
        state = model.encode_history(history, torch.tensor([0, len(history)]))
        rows.append([score_item(state, i) for i in range(model.num_items)])
    return torch.tensor(rows)


def _assert_top_k_equal(out, brute: torch.Tensor, k: int) -> None:
    """The decoder's K distinct items carry the K best brute-force scores (tied items, e.g. two
    items with one long ID, may come in either order)."""
    _check_valid(out.items, out.scores, brute.shape[1])
    assert torch.allclose(out.scores, brute.topk(k, dim=1).values, atol=1e-5)
    assert torch.allclose(brute.gather(1, out.items), out.scores, atol=1e-5)


@pytest.mark.parametrize("level0", ["backbone", "head"])
def test_heads_equal_brute_force(tiny_model, level0):
    model, _ = tiny_model
    values, offsets = _histories(model, [4, 9, 1], seed=3)

    def score(state, item):
        log_probs = model.parallel_heads.log_probs(state.hidden)[0]  # [L, Vmax]
        codes = model.item_codes[item].tolist()
        first = state.level0_log_probs[0] if level0 == "backbone" else log_probs[0]
        return float(first[codes[0]] + sum(log_probs[l, c] for l, c in enumerate(codes) if l))

    out = heads.decode(model, values, offsets, k=12, trie=_trie(model), level0=level0)
    _assert_top_k_equal(out, _brute_force(model, values, offsets, score), 12)


@pytest.mark.parametrize(("catalogue_loss", "source"), [(True, "head"), (False, "backbone")])
def test_heads_auto_level0_follows_how_the_heads_were_trained(
    tiny_model, monkeypatch, catalogue_loss, source
):
    model, _ = tiny_model
    heads_config = replace(model.config.parallel_heads, item_loss=catalogue_loss)
    monkeypatch.setattr(model, "config", replace(model.config, parallel_heads=heads_config))
    values, offsets = _histories(model, [4, 9, 1], seed=3)
    auto = heads.decode(model, values, offsets, k=12, trie=_trie(model))
    chosen = heads.decode(model, values, offsets, k=12, trie=_trie(model), level0=source)
    assert torch.equal(auto.items, chosen.items) and torch.equal(auto.scores, chosen.scores)


def test_dense_equals_brute_force(tiny_model):
    """dense's top-K are the catalogue's best log p(item | history) = log_softmax(h . E)."""
    model, _ = tiny_model
    values, offsets = _histories(model, [5, 0, 8], seed=5)
    table = model.embeddings.embeddings["t_item"].weight  # [I, D]

    def score(state, item):
        return float((state.hidden[0] @ table.T).log_softmax(dim=-1)[item])

    out = dense.decode(model, values, offsets, k=9, trie=_trie(model))
    _assert_top_k_equal(out, _brute_force(model, values, offsets, score), 9)


def _rpg_item_score(model):
    def score(state, item):
        log_probs = model.long_id_heads.log_probs(state.hidden)[0]  # [Q, V]
        return float(sum(log_probs[q, d] for q, d in enumerate(model.long_ids[item].tolist())))

    return score


def test_rpg_exact_equals_brute_force(tiny_model):
    model, _ = tiny_model
    values, offsets = _histories(model, [6, 2, 11], seed=4)
    out = rpg.decode(model, values, offsets, k=10, trie=_trie(model), mode="exact")
    _assert_top_k_equal(out, _brute_force(model, values, offsets, _rpg_item_score(model)), 10)


def test_rpg_auto_walks_the_graph_only_on_large_catalogues(tiny_model, monkeypatch):
    model, _ = tiny_model
    values, offsets = _histories(model, [6, 2], seed=4)
    small = rpg.decode(model, values, offsets, k=5, trie=_trie(model))
    assert small.stats.items_scored_per_user == model.num_items and small.stats.graph_steps is None
    monkeypatch.setattr(rpg.RpgConfig, "graph_min_items", model.num_items)
    large = rpg.decode(model, values, offsets, k=5, trie=_trie(model), seeds=4, degree=3)
    assert large.stats.graph_steps >= 1


def test_rpg_graph_scores_are_exact_and_a_complete_graph_finds_the_top_k(tiny_model):
    model, _ = tiny_model
    values, offsets = _histories(model, [6, 2, 11, 0], seed=5)
    trie = _trie(model)
    exact = rpg.decode(model, values, offsets, k=model.num_items, trie=trie, mode="exact")
    exact_score = torch.full((4, model.num_items), float("nan"))
    exact_score.scatter_(1, exact.items, exact.scores)
    # A sparse walk returns fewer good items, but every score is the item's exact score.
    graph = dict(trie=trie, mode="graph")
    walk = rpg.decode(model, values, offsets, k=5, beam=5, degree=3, seeds=4, steps=2, **graph)
    real = walk.items >= 0
    assert torch.allclose(walk.scores[real], exact_score.gather(1, walk.items.clamp(min=0))[real])
    assert walk.stats.graph_steps <= 2
    assert walk.stats.items_scored_per_user <= 4 + 2 * 5 * 3
    # With every item every item's neighbour, one step scores the whole catalogue.
    full = rpg.decode(model, values, offsets, k=8, degree=model.num_items, steps=1, **graph)
    assert torch.equal(full.items, exact.items[:, :8])
    assert torch.allclose(full.scores, exact.scores[:, :8])


def test_rpg_graph_and_table_are_built_once_and_rebuilt_when_weights_change(tiny_model):
    model, _ = tiny_model
    config = rpg.RpgConfig(degree=5, seeds=6)
    graph, table = rpg.GRAPHS.get(model, config), rpg.TABLES.get(model)
    assert graph.neighbours.shape == (model.num_items, 5)
    assert not (graph.neighbours == torch.arange(model.num_items)[:, None]).any()
    assert len(graph.seeds) <= 6 and len(graph.seeds.unique()) == len(graph.seeds)
    assert rpg.GRAPHS.get(model, config) is graph and rpg.TABLES.get(model) is table
    assert rpg.GRAPHS.get(model, rpg.RpgConfig(degree=5, seeds=6, beam=3)) is graph
    assert rpg.GRAPHS.get(model, rpg.RpgConfig(degree=4, seeds=6)) is not graph
    with torch.no_grad():
        model.long_id_heads.out.weight.mul_(2.0)
    assert rpg.GRAPHS.get(model, config) is not graph and rpg.TABLES.get(model) is not table
    table = rpg.TABLES.get(model)
    with torch.no_grad():
        model.long_id_heads.out.bias.add_(1.0)
    assert rpg.TABLES.get(model) is not table


def test_rpg_item_table_scores_are_the_summed_digit_log_probs(tiny_model):
    """<u, e_i> + c_i - sum_q logsumexp_q(u) equals the heads' summed log-probs (B > 1)."""
    model, _ = tiny_model
    values, offsets = _histories(model, [6, 0, 9], seed=7)
    hidden = model.encode_history(values, offsets).hidden
    u = model.long_id_heads.proj(hidden)
    table = rpg.item_table(model)
    got = u @ table.vectors.T + table.biases - rpg.digit_normalizer(model, u)[:, None]
    want = model.long_id_heads.score_items(hidden, model.long_ids)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)
    some = torch.tensor([[3, -1, 0], [model.num_items - 1, 2, 2], [-1, -1, 5]])
    picked = rpg.candidate_scores(u, rpg.digit_normalizer(model, u), table, some)
    assert torch.isinf(picked[some < 0]).all()
    torch.testing.assert_close(picked[some >= 0], got.gather(1, some.clamp(min=0))[some >= 0])


def test_nezha_with_an_exhaustive_beam_equals_brute_force(tiny_model):
    """A beam as wide as the catalogue keeps every prefix, so it ranks every item exactly by
    backbone level 0 + the draft head's chained log-probs."""
    model, _ = tiny_model
    values, offsets = _histories(model, [3, 8, 0], seed=6)
    head = model.draft_head

    def score(state, item):
        codes = model.item_codes[item]
        total, draft = float(state.level0_log_probs[0, codes[0]]), head.init(state.hidden)
        for level in range(1, model.num_levels):
            draft, log_probs = head.step(draft, codes[level - 1 : level], level - 1)
            total += float(log_probs[0, codes[level]])
        return total

    k, trie = 15, _trie(model)
    out = nezha.decode(model, values, offsets, k=k, trie=trie, beam_width=model.num_items)
    _assert_top_k_equal(out, _brute_force(model, values, offsets, score), k)
    assert torch.equal(trie.item_of(model.item_codes[out.items.flatten()]), out.items.flatten())
    assert out.stats.draft_steps == model.num_levels - 1


def test_tied_draft_head_starts_as_the_item_softmax_and_learns_a_correction(tiny_model):
    """A draft head tied to the item objective: its out layers start at 0, so with a
    catalogue-wide beam `nezha` scores every item by the item softmax at the history state
    (level 0 + the item objective's conditionals telescope), i.e. ranks as `dense` does; its
    training loss reaches the head.
    Without the item objective the head is untied."""
    from genrec_spec.models.recsys.layout import train_layout

    base, data = tiny_model
    objective = replace(base.config.item_objective, level0=True, temperature=0.05, draft=True)
    config = replace(base.config, item_objective=objective)
    torch.manual_seed(2)
    model = SemanticIdRecommender(config, data.item_codes, data.codebook_sizes).eval()
    values, offsets = _histories(model, [5, 0, 11], seed=9)
    k = 12
    out = nezha.decode(model, values, offsets, k=k, trie=_trie(model), beam_width=model.num_items)
    item_lp = model.item_scores(model.encode_history(values, offsets).hidden).log_softmax(dim=-1)
    _assert_top_k_equal(out, item_lp, k)
    with torch.no_grad():  # a trained correction moves the lists away from dense's
        for layer in model.draft_head.out:
            layer.weight.normal_(std=1.0)
    moved = nezha.decode(model, values, offsets, k=k, trie=_trie(model), beam_width=99)
    assert not torch.allclose(moved.scores, out.scores, atol=1e-3)

    windows, window_offsets = _histories(model, [5, 11], seed=9)  # training rows are not empty
    layout = train_layout(windows, window_offsets, model.num_levels - 1, 3, torch.Generator())
    model.train()
    model.forward_train(layout)["draft"].backward()
    model.eval()
    assert model.draft_head.out[0].weight.grad.abs().sum() > 0
    assert not replace(config, item_objective=None).draft_tied


def test_bad_input(tiny_model):
    model, data = tiny_model
    values, offsets = _histories(model, [3, 2])
    trie = _trie(model)
    for decode, options in DECODERS.values():
        for k in (0, model.num_items + 1):
            with pytest.raises(DecodeOptionError, match="k"):
                decode(model, values, offsets, k=k, trie=trie, **options)
    other = PrefixTrie.from_codes(model.item_codes[:-1], tuple(model.codebook_sizes))
    with pytest.raises(DecodeOptionError, match="item_trie"):
        heads.decode(model, values, offsets, k=3, trie=other)
    with pytest.raises(DecodeOptionError, match="level0"):
        heads.decode(model, values, offsets, k=3, trie=trie, level0="nope")
    with pytest.raises(DecodeOptionError, match="mode"):
        rpg.decode(model, values, offsets, k=3, trie=trie, mode="beam")
    with pytest.raises(DecodeOptionError, match=">= 1"):
        rpg.decode(model, values, offsets, k=3, trie=trie, degree=0)
    bare = SemanticIdRecommender(
        RecommenderConfig(
            dim=8,
            heads=2,
            layers=1,
            parallel_heads=None,
            long_id_heads=None,
            draft_head=None,
            item_objective=None,
        ),
        data.item_codes,
        data.codebook_sizes,
        data.long_ids,
        data.long_id_sizes,
    ).eval()
    for decode, name in (
        (heads.decode, "parallel"),
        (rpg.decode, "long-ID"),
        (nezha.decode, "draft"),
        (dense.decode, "item objective"),
    ):
        with pytest.raises(DecodeOptionError, match=name):
            decode(bare, values, offsets, k=3, trie=trie)

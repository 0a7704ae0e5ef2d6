"""Candidate scoring: one fused pass equals scoring every candidate alone; prefix trees."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from genrec_spec.data_pipelines.trie import PrefixTrie
from genrec_spec.models.recsys.config import TiedLevelsConfig
from genrec_spec.models.recsys.errors import RecommenderInputError
from genrec_spec.models.recsys.recommender import SemanticIdRecommender
from genrec_spec.recsys.scoring import (
    NodeSet,
    TrieIndex,
    prefix_nodes,
    prefix_tree,
    score,
)


def _histories(model, lengths: list[int], seed: int):
    g = torch.Generator().manual_seed(seed)
    values = torch.randint(0, model.num_items, (sum(lengths),), generator=g)
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    return values, offsets


def _tied(config):
    """`config` with level 0 and levels 1.. from the item objective."""
    objective = config.item_objective
    return replace(
        config,
        item_objective=replace(objective, level0=True, tied_levels=TiedLevelsConfig(False)),
    )


def _alone(model, history: torch.Tensor, item: int) -> float:
    """One candidate's log-likelihood from its own chain of code tokens."""
    state = model.encode_history(history, torch.tensor([0, len(history)]))
    codes = model.item_codes[item]  # [L]
    depth = model.num_levels - 1
    out = model.score_tree(
        state, codes[None, :depth], torch.arange(depth)[None], torch.arange(depth)[None] - 1
    )
    total = state.level0_log_probs[0, codes[0]]
    for level in range(1, model.num_levels):
        total = total + out[0, level - 1, codes[level]]
    return float(total)


@pytest.mark.parametrize("lengths", [[4], [6, 0, 20, 3]])  # empty and truncated rows too
@pytest.mark.parametrize("tied", [False, True])  # tied levels: forced codes are not scored
def test_score_equals_each_candidate_alone(tiny_model, lengths, tied):
    model, data = tiny_model
    if tied:
        config = _tied(model.config)
        model = SemanticIdRecommender(config, data.item_codes, data.codebook_sizes).eval()
    assert model.forced_codes_free == tied
    values, offsets = _histories(model, lengths, seed=len(lengths))
    g = torch.Generator().manual_seed(1)
    # 6 candidates per row from 5 items: repeats and shared prefixes.
    pool = torch.randperm(model.num_items, generator=g)[:5]
    candidates = pool[torch.randint(0, 5, (len(lengths), 6), generator=g)]
    got = score(model, values, offsets, candidates)
    assert got.shape == candidates.shape
    for b in range(len(lengths)):
        history = values[offsets[b] : offsets[b + 1]]
        for c in range(candidates.shape[1]):
            want = _alone(model, history, int(candidates[b, c]))
            assert got[b, c].item() == pytest.approx(want, abs=1e-5)


def test_score_when_every_deeper_code_is_forced(tiny_model):
    """Items alone under their level-0 code on a tied model: no prefix is scored (an empty
    tree) and each item's log-likelihood is its level-0 log-prob, as its chain of codes gives."""
    model, _ = tiny_model
    config = _tied(model.config)
    items = 6
    codes = torch.zeros(items, model.num_levels, dtype=torch.long)
    codes[:, 0] = torch.arange(items)  # one item per level-0 code: every deeper code forced
    sizes = [items, *model.codebook_sizes[1:]]
    forced = SemanticIdRecommender(config, codes, sizes).eval()
    values, offsets = _histories(forced, [3, 5], seed=7)
    candidates = torch.tensor([[0, 5, 2], [1, 1, 4]])
    got = score(forced, values, offsets, candidates)
    for b in range(2):
        history = values[offsets[b] : offsets[b + 1]]
        for c in range(3):
            want = _alone(forced, history, int(candidates[b, c]))
            assert got[b, c].item() == pytest.approx(want, abs=1e-5)


def test_score_is_one_forward_pass(tiny_model):
    """Every block runs once: history and all candidates go through the model together."""
    model, _ = tiny_model
    calls = []
    hook = model.blocks[0].register_forward_hook(lambda *_: calls.append(1))
    try:
        values, offsets = _histories(model, [5, 2], seed=3)
        score(model, values, offsets, torch.arange(2 * model.num_items).view(2, -1) % 40)
    finally:
        hook.remove()
    assert len(calls) == 1


def test_fused_pass_equals_encode_then_score_tree(tiny_model):
    model, _ = tiny_model
    trie = PrefixTrie.from_codes(model.item_codes, tuple(model.codebook_sizes))
    index = TrieIndex.of(trie)
    values, offsets = _histories(model, [7, 1, 15], seed=4)
    mask = torch.rand(3, index.scorable, generator=torch.Generator().manual_seed(5)) < 0.3
    tree = prefix_tree(index, index.node_set(*mask.nonzero(as_tuple=True)), 3)
    state, out = model.encode_history_and_tree(
        values, offsets, tree.codes, tree.levels, tree.parents
    )
    plain = model.encode_history(values, offsets)
    torch.testing.assert_close(state.level0_log_probs, plain.level0_log_probs)
    torch.testing.assert_close(state.keys, plain.keys)
    torch.testing.assert_close(state.truncated, plain.truncated)
    ref = model.score_tree(plain, tree.codes, tree.levels, tree.parents)
    real = tree.nodes >= 0
    torch.testing.assert_close(out[real], ref[real], atol=1e-5, rtol=0)


def test_prefix_tree_holds_the_nodes_and_their_ancestors(tiny_model):
    model, _ = tiny_model
    trie = PrefixTrie.from_codes(model.item_codes, tuple(model.codebook_sizes))
    index = TrieIndex.of(trie)
    paths = prefix_nodes(trie, model.item_codes)  # [I, L-1]
    assert (paths >= 0).all() and (paths < index.scorable).all()
    # row 0: a deepest prefix only (its ancestors must come along); row 1: five items' prefixes
    rows = torch.tensor([0] + [1] * paths[:5].numel())
    member = index.node_set(rows, torch.cat([paths[3, -1:], paths[:5].flatten()]))
    tree = prefix_tree(index, member, 2)
    assert sorted(tree.nodes[0][tree.nodes[0] >= 0].tolist()) == sorted(paths[3].tolist())
    assert set(tree.nodes[1].tolist()) - {-1} == set(paths[:5].flatten().tolist())
    for b in range(2):
        for i in range(tree.nodes.shape[1]):
            node, parent = int(tree.nodes[b, i]), int(tree.parents[b, i])
            if node < 0:
                assert parent == -1  # padding: a harmless root
                continue
            assert int(tree.slot_of(torch.tensor([[node]] * 2))[b, 0]) == i
            assert int(tree.codes[b, i]) == int(index.code[node])
            if parent < 0:
                assert int(index.level[node]) == 0
            else:
                assert parent < i and int(tree.nodes[b, parent]) == int(index.parent[node])


def test_bad_candidates_raise(tiny_model):
    model, _ = tiny_model
    values, offsets = _histories(model, [3, 3], seed=6)
    with pytest.raises(RecommenderInputError, match="must lie in"):
        score(model, values, offsets, torch.tensor([[0, model.num_items], [1, 2]]))
    with pytest.raises(RecommenderInputError, match=r"\[B, C\]"):
        score(model, values, offsets, torch.tensor([0, 1]))
    with pytest.raises(RecommenderInputError, match=r"\[B, C\]"):
        score(model, values, offsets, torch.zeros(3, 2, dtype=torch.long))


def test_score_tree_rejects_a_tree_deeper_than_the_code_levels(tiny_model):
    """A code prefix has at most L - 1 codes: the plan's shallow ancestor walk checks it."""
    model, _ = tiny_model
    values, offsets = _histories(model, [3, 5], seed=8)
    state = model.encode_history(values, offsets)
    depth = model.num_levels  # one node more than any prefix chain
    chain = torch.arange(depth).expand(2, -1)
    with pytest.raises(ValueError, match="more than max_depth"):
        model.score_tree(state, chain * 0, (chain % (model.num_levels - 1)), chain - 1)


def test_node_sets_keep_each_rows_nodes_apart():
    a = NodeSet.rowwise(torch.tensor([[2, -1, 2, 0], [-1, -1, -1, -1], [3, 1, -1, -1]]), 4)
    pairs = list(zip(a.rows.tolist(), a.nodes.tolist(), strict=True))
    assert pairs == [(0, 0), (0, 2), (2, 1), (2, 3)]  # row by row, ascending, repeats once
    b = NodeSet.of(torch.tensor([1, 2, 0]), torch.tensor([2, 3, 0]), 4)
    assert (a | b).keys.tolist() == [0, 2, 6, 9, 11]
    assert (a - b).keys.tolist() == [2, 9]
    found = a.find(torch.tensor([[2, 3], [2, -1], [1, 0]]))[1]
    assert found.tolist() == [[True, False], [False, False], [True, False]]
    assert a.value_at(
        torch.tensor([5, 6, 7, 8]), torch.tensor([[2, 0], [1, 1], [3, -1]])
    ).tolist() == [
        [6, 5],
        [-1, -1],
        [8, -1],
    ]

"""The public `recommend` API: every registered decoder returns valid distinct items; cold start,
truncation, and clear errors for bad histories, k, decoder names and options."""

from __future__ import annotations

import pytest
import torch

import genrec_spec
from genrec_spec.recsys.decoders.registry import DECODERS
from genrec_spec.recsys.decoders.spec_beam import same_top_k
from genrec_spec.recsys.recommend import RecommendInputError, recommend


@pytest.mark.parametrize("decoder", list(DECODERS))
def test_every_decoder_returns_valid_distinct_items(tiny_model, decoder):
    model, _ = tiny_model
    histories = [[1, 2, 3], [], list(range(30)), [39, 0]]  # cold start and truncated rows
    for k in (1, 10, model.num_items):
        out = genrec_spec.recommend(model, histories, k=k, decoder=decoder)
        assert out.items.shape == out.scores.shape == (4, k)
        real = out.items >= 0
        assert (out.items[real] < model.num_items).all()
        assert torch.isinf(out.scores[~real]).all()
        for row in out.items.tolist():
            kept = [i for i in row if i >= 0]
            assert len(set(kept)) == len(kept)
        assert out.stats.truncated_histories == 1


def test_list_and_tensor_histories_agree_and_spec_beam_matches_beam(tiny_model):
    model, _ = tiny_model
    histories = [[5, 6, 7, 8], [], [12]]
    values = torch.tensor([5, 6, 7, 8, 12])
    offsets = torch.tensor([0, 4, 4, 5])
    a = recommend(model, histories, k=5)
    b = recommend(model, (values, offsets), k=5, beam_width=20)
    c = recommend(model, histories, k=5, decoder="spec_beam", draft="none")
    assert torch.equal(a.items, b.items)
    assert same_top_k(a, c).all()


def test_cold_start_is_the_same_list_for_every_new_user(tiny_model):
    model, _ = tiny_model
    out = recommend(model, [[], [], [3]], k=6)
    assert torch.equal(out.items[0], out.items[1])
    assert (out.items[0] >= 0).all()


def test_long_history_keeps_the_most_recent_items(tiny_model):
    model, _ = tiny_model
    history = [i % model.num_items for i in range(3 * model.config.max_len)]
    full = recommend(model, [history, [1]], k=4)
    recent = recommend(model, [history[-model.config.max_len :], [1]], k=4)
    assert full.stats.truncated_histories == 1
    assert recent.stats.truncated_histories == 0
    assert torch.equal(full.items, recent.items)


def test_bad_input_raises_clear_errors(tiny_model):
    model, _ = tiny_model
    with pytest.raises(RecommendInputError, match=r"unknown item indices \[40\].*0\.\.39"):
        recommend(model, [[1, 40]], k=3)
    with pytest.raises(RecommendInputError, match=r"unknown item indices \[-2\]"):
        recommend(model, [[-2], [3]], k=3)
    with pytest.raises(RecommendInputError, match="integer item indices"):
        recommend(model, [["i7"]], k=3)
    with pytest.raises(RecommendInputError, match="histories is empty"):
        recommend(model, [], k=3)
    with pytest.raises(RecommendInputError, match=r"k must lie in 1\.\.40"):
        recommend(model, [[1]], k=41)
    with pytest.raises(RecommendInputError, match="valid decoders: beam, spec_beam, heads"):
        recommend(model, [[1]], k=3, decoder="tiger")
    with pytest.raises(RecommendInputError, match=r"takes no option\(s\) \['beamwidth'\]"):
        recommend(model, [[1]], k=3, beamwidth=5)
    with pytest.raises(RecommendInputError, match="offsets must be"):
        recommend(model, (torch.tensor([1, 2]), torch.tensor([1, 2])), k=3)

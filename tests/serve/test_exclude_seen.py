"""`recommend(..., exclude=...)`: the excluded items leave the list, the rest keep their order,
and a row's answer depends only on its own fetch size."""

import pytest
import torch

from genrec_spec.recsys.recommend import RecommendInputError, fetch_size, recommend


def test_fetch_size():
    assert fetch_size(10, 0, 100) == 10
    assert [fetch_size(10, n, 100) for n in (1, 2, 3, 4, 5, 8, 9)] == [11, 12, 14, 14, 18, 18, 26]
    assert fetch_size(10, 200, 100) == 100


@pytest.mark.parametrize("decoder", ["beam", "heads"])
def test_exclude_drops_items_and_keeps_order(tiny_model, decoder):
    model, _ = tiny_model
    histories = [[1, 2, 3], [7, 8], [], [30, 31, 32, 33, 34]]
    exclude = [[1, 2, 3], [], [5, 5, 6], list(range(0, 40, 2))]
    k = 5
    out = recommend(model, histories, k=k, decoder=decoder, exclude=exclude)
    fetch = max(fetch_size(k, len(set(row)), model.num_items) for row in exclude)
    assert out.stats.fetched == fetch
    longer = recommend(model, histories, k=fetch, decoder=decoder)
    for b, row in enumerate(exclude):
        kept = [i for i in longer.items[b].tolist() if i not in row][:k]
        assert out.items[b].tolist() == kept
        assert not set(out.items[b].tolist()) & set(row)


def test_exclude_pads_when_too_few_items_remain(tiny_model):
    model, _ = tiny_model
    out = recommend(model, [[1], [2]], k=38, decoder="heads", exclude=[list(range(5)), []])
    assert out.items[0, -3:].tolist() == [-1, -1, -1]
    assert torch.isinf(out.scores[0, -3:]).all() and (out.items[1] >= 0).all()


def test_exclude_bad_input(tiny_model):
    model, _ = tiny_model
    with pytest.raises(RecommendInputError, match="1 item lists for 2 histories"):
        recommend(model, [[1], [2]], k=3, exclude=[[1]])
    with pytest.raises(RecommendInputError, match="unknown item indices"):
        recommend(model, [[1], [2]], k=3, exclude=[[1], [99]])
    # (k = 3 fits a width of 4; the 3 + 4 items to find with 3 left out do not)
    with pytest.raises(RecommendInputError, match="beam_width 4 is below the 7 items"):
        recommend(model, [[1], [2]], k=3, exclude=[[1, 2, 3], []], beam_width=4)

"""The recommender as a core Target: the core's beam search decodes it to the recommender's own
`beam` lists and scores, plain and speculative."""

from __future__ import annotations

import pytest
import torch

from genrec_spec import BeamConfig, beam_search
from genrec_spec.core.types import DecodeInputError
from genrec_spec.llm.proposers.catalogue import CatalogueDrafter
from genrec_spec.models.recsys.config import TiedLevelsConfig
from genrec_spec.models.recsys.recommender import SemanticIdRecommender
from genrec_spec.recsys.decoders import beam
from genrec_spec.recsys.errors import DecodeOptionError
from genrec_spec.recsys.history_cache import rows_of
from genrec_spec.recsys.target import RecommenderTarget


def core_beam(model, users, k: int, width: int, drafter: bool = False):
    """(items [B, K], scores [B, K], passes) of the core's beam search on the recommender."""
    target = RecommenderTarget(model)
    catalogue = target.catalogue()
    tokens, lengths = target.prompts(users.values, users.offsets)
    out = beam_search(
        target,
        tokens,
        prompt_lengths=lengths,
        config=BeamConfig(num_beams=width, num_return_sequences=k, length_penalty=0.0),
        max_new_tokens=model.num_levels,
        constraint=catalogue,
        drafter=CatalogueDrafter(catalogue) if drafter else None,
    )
    items = catalogue.items_of(out.values, out.offsets).view(out.scores.shape)
    return items, out.scores, out.stats.target_forwards


@pytest.mark.parametrize("levels", ["untied", "tied"])
@pytest.mark.parametrize(("k", "width"), [(3, 3), (5, 8)])
def test_core_beam_search_equals_the_recommenders_beam(
    tiny_model, with_objective, levels, k, width
):
    model, data = tiny_model
    if levels == "tied":  # log-probs normalised over a prefix's children
        tied = with_objective(
            model.config, level0=True, tied_levels=TiedLevelsConfig(residual=False)
        )
        torch.manual_seed(1)
        model = SemanticIdRecommender(tied, data.item_codes, data.codebook_sizes).eval()
    users = data.test.select(torch.arange(len(data.test)))
    want = beam.decode(model, users.values, users.offsets, k=k, trie=beam.item_trie(model),
                       beam_width=width)  # fmt: skip
    for drafter in (False, True):
        items, scores, passes = core_beam(model, users, k, width, drafter)
        assert torch.equal(items, want.items)
        # The model's own log-probs, summed alike (from trees laid out otherwise: rounding).
        torch.testing.assert_close(scores, want.scores, rtol=0, atol=1e-5)
        assert passes == model.num_levels  # the history pass, then one per level but the last


def test_the_catalogue_is_every_item_as_code_tokens(tiny_model):
    model, _ = tiny_model
    target = RecommenderTarget(model)
    catalogue = target.catalogue()
    assert catalogue.trie.num_items == model.num_items
    assert catalogue.trie.shortest == catalogue.trie.longest == model.num_levels
    assert target.vocab_size == sum(model.codebook_sizes)
    assert target.prompt_vocab_size == model.num_items + 1  # the items and the start token


def test_bad_use_is_refused(tiny_model):
    model, data = tiny_model
    target = RecommenderTarget(model)
    users = data.test.select(torch.arange(2))
    catalogue = target.catalogue()
    tokens, lengths = target.prompts(users.values, users.offsets)
    with pytest.raises(DecodeInputError, match="unless its items all have max_new_tokens"):
        beam_search(target, tokens, prompt_lengths=lengths, max_new_tokens=model.num_levels + 1,
                    constraint=catalogue)  # fmt: skip
    start = target.start_token
    with pytest.raises(DecodeInputError, match="outside the target's vocabulary"):
        beam_search(target, [[start, start + 1]], max_new_tokens=model.num_levels,
                    constraint=catalogue)  # fmt: skip
    # A history without the start token would lose its first item: refused.
    with pytest.raises(DecodeInputError, match="start token, then the history"):
        beam_search(target, rows_of(users.values, users.offsets),
                    max_new_tokens=model.num_levels, constraint=catalogue)  # fmt: skip
    cache = target.prefill(torch.tensor([[start, 2]]), torch.tensor([2]), 8)
    with pytest.raises(DecodeInputError, match="decodes by beam search"):
        target.commit(cache, torch.zeros(1, 1, dtype=torch.long), torch.ones(1, dtype=torch.long))
    with pytest.raises(DecodeInputError, match="no hidden states"):
        target.prefill(torch.tensor([[start, 2]]), torch.tensor([2]), 8, hidden_layers=(1,))


@pytest.mark.parametrize("levels", ["untied", "tied"])
def test_the_beam_decoder_runs_on_the_core_engine(tiny_model, with_objective, levels):
    model, data = tiny_model
    if levels == "tied":  # forced codes cost 0: a level where no beam has a choice needs no pass
        tied = with_objective(model.config, level0=True, tied_levels=TiedLevelsConfig())
        model = SemanticIdRecommender(tied, data.item_codes, data.codebook_sizes).eval()
        assert model.forced_codes_free
    users = data.test.select(torch.arange(len(data.test)))
    trie = beam.item_trie(model)
    native = beam.decode(model, users.values, users.offsets, k=4, trie=trie, beam_width=6)
    core = beam.decode(model, users.values, users.offsets, k=4, trie=trie, beam_width=6,
                       engine="core")  # fmt: skip
    assert torch.equal(core.items, native.items)
    torch.testing.assert_close(core.scores, native.scores, rtol=0, atol=1e-5)
    assert core.stats.target_passes == native.stats.target_passes
    assert core.stats.truncated_histories == native.stats.truncated_histories
    with pytest.raises(DecodeOptionError, match="engine"):
        beam.decode(model, users.values, users.offsets, k=4, trie=trie, engine="fast")

"""The recommender as a core Target: the core's beam search decodes it to the recommender's own
`beam` lists and scores, plain and speculative."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from genrec_spec import BeamConfig, beam_search
from genrec_spec.core.catalogue import TokenTrie
from genrec_spec.core.catalogue_drafter import CatalogueDrafter
from genrec_spec.core.types import DecodeInputError
from genrec_spec.models.recsys.config import TiedLevelsConfig
from genrec_spec.models.recsys.recommender import SemanticIdRecommender
from genrec_spec.recsys.decoders import beam
from genrec_spec.recsys.errors import DecodeOptionError
from genrec_spec.recsys.history_cache import rows_of
from genrec_spec.recsys.item_trie import item_trie
from genrec_spec.recsys.spec_levels import SpecLevels
from genrec_spec.recsys.target import RecommenderTarget, with_ancestors


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
@pytest.mark.parametrize(("k", "width"), [(1, 1), (2, 2), (3, 3), (5, 8)])
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
    want = beam.decode(model, users.values, users.offsets, k=k, trie=item_trie(model),
                       beam_width=width, engine="native")  # fmt: skip
    for drafter in (False, True):
        items, scores, passes = core_beam(model, users, k, width, drafter)
        assert torch.equal(items, want.items)
        # The model's own log-probs, summed alike (from trees laid out otherwise: rounding).
        torch.testing.assert_close(scores, want.scores, rtol=0, atol=1e-5)
        assert passes == model.num_levels  # the history pass, then one per level but the last


class GenericRead:
    """The recommender as a target without its own step read (`beam_candidates`): the core's
    plain search grows its pending tree and reads each node's children back from its outputs."""

    def __init__(self, target: RecommenderTarget) -> None:
        self.target = target

    def __getattr__(self, name: str):
        if name == "beam_candidates":
            raise AttributeError(name)
        return getattr(self.target, name)


@pytest.mark.parametrize("levels", ["untied", "tied"])
@pytest.mark.parametrize(("k", "width"), [(1, 1), (3, 5), (5, 40)])
def test_the_recommenders_step_read_equals_the_cores_generic_read(
    tiny_model, with_objective, levels, k, width
):
    """A plain search on the recommender's own step read (its tree from the beams' levels, the
    children off its level's outputs; the root's candidates once for its W copies) gives the
    lists, scores and passes of the core's generic read of the same target."""
    model, data = tiny_model
    if levels == "tied":  # forced codes cost 0: read without a pass
        tied = with_objective(model.config, level0=True, tied_levels=TiedLevelsConfig())
        torch.manual_seed(2)
        model = SemanticIdRecommender(tied, data.item_codes, data.codebook_sizes).eval()
        assert model.forced_codes_free
    users = data.test.select(torch.arange(len(data.test)))
    target = RecommenderTarget(model)
    catalogue = target.catalogue()
    assert bool((catalogue.trie.forced_tokens >= 0).any())  # prefixes with one child
    tokens, lengths = target.prompts(users.values, users.offsets)
    config = BeamConfig(num_beams=width, num_return_sequences=k, length_penalty=0.0)
    outs = [
        beam_search(
            read,
            tokens,
            prompt_lengths=lengths,
            config=config,
            max_new_tokens=model.num_levels,
            constraint=catalogue,
        )  # fmt: skip
        for read in (target, GenericRead(target))
    ]
    own, generic = outs
    assert torch.equal(own.states, generic.states)
    torch.testing.assert_close(own.scores, generic.scores, rtol=0, atol=1e-5)
    assert own.stats.target_forwards == generic.stats.target_forwards


def test_the_catalogue_is_every_item_as_code_tokens(tiny_model):
    model, _ = tiny_model
    target = RecommenderTarget(model)
    catalogue = target.catalogue()
    assert catalogue.trie.num_items == model.num_items
    assert catalogue.trie.shortest == catalogue.trie.longest == model.num_levels
    # L blocks as wide as the widest codebook: item i's level-l code c is token l * Vmax + c
    assert target.vocab_size == model.num_levels * max(model.codebook_sizes)
    assert catalogue.items_of(
        (model.item_codes + torch.arange(model.num_levels) * max(model.codebook_sizes)).flatten(),
        torch.arange(model.num_items + 1) * model.num_levels,
    ).tolist() == list(range(model.num_items))
    assert target.prompt_vocab_size == model.num_items + 1  # the items and the start token
    # Laid out from the item trie, it is the trie of the items' token lists, table for table
    tokens = model.item_codes + torch.arange(model.num_levels) * max(model.codebook_sizes)
    listed = TokenTrie.from_sequences(tokens.tolist(), target.vocab_size)
    for field in dataclasses.fields(TokenTrie):
        got, want = getattr(catalogue.trie, field.name), getattr(listed, field.name)
        assert torch.equal(got, want) if isinstance(want, torch.Tensor) else got == want
    # and its nodes are the item trie's (a catalogue state is the recommender's prefix node)
    items = item_trie(model)
    assert catalogue.trie.child_offsets.tolist() == items.child_offsets.tolist()
    level = torch.repeat_interleave(
        torch.arange(model.num_levels), torch.tensor(items.level_starts).diff()[1:]
    )  # [edges] the level of the code edge e carries (edge e leads to node e + 1)
    codes = catalogue.trie.child_tokens - level * max(model.codebook_sizes)
    assert codes.tolist() == items.child_codes.tolist()


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
    # spec_beam's drafter drafts for the target's own step read, which needs the catalogue
    levels = SpecLevels(model, item_trie(model), "frontier", 4, "exact", 1)
    with pytest.raises(DecodeInputError, match="drafts for a target's own step read"):
        beam_search(target, tokens, prompt_lengths=lengths, max_new_tokens=model.num_levels,
                    drafter=levels)  # fmt: skip
    # under the catalogue they draft, reading the beams by their catalogue states
    config = BeamConfig(num_beams=4, num_return_sequences=2, length_penalty=0.0)
    out = beam_search(target, tokens, prompt_lengths=lengths, max_new_tokens=model.num_levels,
                      constraint=catalogue, drafter=levels, config=config)  # fmt: skip
    want = beam.decode(model, users.values, users.offsets, k=2, trie=item_trie(model),
                       beam_width=4, engine="native")  # fmt: skip
    assert torch.equal(catalogue.trie.items(out.states), want.items)
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
    trie = item_trie(model)
    native = beam.decode(model, users.values, users.offsets, k=4, trie=trie, beam_width=6,
                         engine="native")  # fmt: skip
    core = beam.decode(model, users.values, users.offsets, k=4, trie=trie, beam_width=6)
    assert torch.equal(core.items, native.items)
    torch.testing.assert_close(core.scores, native.scores, rtol=0, atol=1e-5)
    assert core.stats.target_passes == native.stats.target_passes
    assert core.stats.truncated_histories == native.stats.truncated_histories
    with pytest.raises(DecodeOptionError, match="engine"):
        beam.decode(model, users.values, users.offsets, k=4, trie=trie, engine="fast")


@pytest.mark.parametrize("first", [True, False])
def test_outputs_not_needed_are_skipped_without_changing_the_others(
    tiny_model, random_recommender, random_histories, first
):
    """grow_tree's `needed`: the nodes not needed read -inf, and the needed ones keep the values
    of a grow that reads every node, even below a node not needed that itself descends from a
    needed one (it is fed beside them, not before them), in the history pass (`first`) and in a
    later pass."""
    model = random_recommender(tiny_model[0].config, 0, (4, 3, 3), 30)  # L = 4
    target = RecommenderTarget(model)
    values, offsets = random_histories(model, [3, 0, 5])
    tokens, lengths = target.prompts(values, offsets)
    codes = model.item_codes[torch.tensor([2, 7, 11])] + target.offsets[:-1]  # [B, L] as tokens
    chain = codes[:, :3]  # [B, 3] each row's item's prefixes of lengths 1..3
    parents = torch.tensor([0, 1, 2]).expand(3, -1)  # below the root, node 0, one chain

    def grown(needed):
        cache = target.prefill(tokens, lengths, 16)
        roots = tokens.gather(1, (lengths - 1)[:, None])
        if first:  # roots and chain in one grow (the roots' node 0 comes first)
            out = target.grow_tree(
                cache,
                torch.cat([roots, chain], 1),
                torch.cat([torch.full((3, 1), -1), parents], 1),
                None if needed is None else torch.cat([torch.ones(3, 1, dtype=bool), needed], 1),
            )
            return out[:, 1:]
        target.grow_tree(cache, roots, torch.full((3, 1), -1))
        return target.grow_tree(cache, chain, parents, needed)

    every = grown(None)  # [B, 3, V]
    needed = torch.tensor([True, False, True]).expand(3, -1)  # the middle one is known
    some = grown(needed)
    assert torch.isinf(some[:, 1]).all()
    torch.testing.assert_close(some[:, [0, 2]], every[:, [0, 2]], rtol=0, atol=1e-5)
    assert torch.isfinite(every[:, 2]).any(1).all()  # the last level is scored


def test_with_ancestors_marks_each_marked_nodes_ancestors_up_to_a_depth():
    """Two rows of one tree layout each: a chain 0 <- 1 <- 2 <- 3 and a branch 0 <- 4, a
    padding node (parent -1) at 5; against a walk up the parents."""
    parents = torch.tensor([[-1, 0, 1, 2, 0, -1], [-1, 0, 1, 2, 0, -1]])
    marked = torch.tensor([[0, 0, 0, 1, 0, 0], [0, 0, 0, 0, 1, 1]], dtype=torch.bool)
    for depth in range(4):
        want = marked.clone()
        for b, i in marked.nonzero().tolist():
            for _ in range(depth):
                i = int(parents[b, i])
                if i < 0:
                    break
                want[b, i] = True
        assert torch.equal(with_ancestors(marked, parents, depth), want), depth

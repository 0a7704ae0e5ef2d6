"""Unit checks of the core's building blocks: tree topology, logits processing, sampling
without replacement, and the acceptance rules on hand-made trees."""

import pytest
import torch

from genrec_spec import (
    DraftTree,
    GreedyMatch,
    RejectionSampling,
    SamplingParams,
    TypicalAcceptance,
)
from genrec_spec.core.beam import SORT_SCORES, stable_top
from genrec_spec.core.sampling import probabilities, sample, sample_without_replacement
from genrec_spec.core.tree import (
    chain,
    from_lists,
    paths,
    prepend_chain,
    static_tree,
    topology,
    widths_to_choices,
)
from genrec_spec.core.types import DecodeInputError

# Two rows: row 0 is root -> {1 -> {3, 4}, 2}; row 1 a chain 0 -> 1 -> 2 -> 3 plus a padding
# leaf 4 under the root.
PARENTS = torch.tensor([[-1, 0, 0, 1, 1], [-1, 0, 1, 2, 0]])


def test_topology_and_paths():
    ancestors, depth = topology(PARENTS)
    assert depth.tolist() == [[0, 1, 1, 2, 2], [0, 1, 2, 3, 1]]
    assert ancestors[0, 4].tolist() == [True, True, False, False, True]
    assert ancestors[1, 3].tolist() == [True, True, True, True, False]
    route = paths(ancestors, depth)
    assert route[0, 4].tolist() == [0, 1, 4, -1, -1]
    assert route[1, 3].tolist() == [0, 1, 2, 3, -1]
    assert route[1, 4].tolist() == [0, 4, -1, -1, -1]


def test_tree_builders():
    padded = from_lists([[7, 1, 2], [8]], [[-1, 0, 1], [-1]])
    assert padded.tokens.tolist() == [[7, 1, 2], [8, 0, 0]]
    assert padded.parents.tolist() == [[-1, 0, 1], [-1, 0, 0]]
    assert padded.valid.tolist() == [[True, True, True], [True, False, False]]
    drafts = chain(
        torch.tensor([5, 6]),
        torch.tensor([[1, 2], [3, 4]]),
        valid=torch.tensor([[True, True], [True, False]]),
    )
    assert drafts.parents.tolist() == [[-1, 0, 1]] * 2
    assert drafts.valid.tolist() == [[True, True, True], [True, True, False]]
    led = prepend_chain(torch.tensor([[9, 9], [8, 8]]), padded)
    assert led.tokens[0].tolist() == [9, 9, 7, 1, 2]
    assert led.parents[1].tolist() == [-1, 0, 1, 2, 2]
    parents, ranks, depth = static_tree(widths_to_choices((2, 1)))
    assert parents.tolist() == [-1, 0, 0, 1, 2]
    assert ranks.tolist() == [0, 0, 1, 0, 0] and depth.tolist() == [0, 1, 1, 2, 2]
    with pytest.raises(ValueError, match="prefix"):
        static_tree([(0, 1)])


def test_probabilities_filters():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, 0.0], [0.0, 0.0, 3.0, 1.0, 2.0]])
    greedy = probabilities(logits, SamplingParams())
    assert greedy.argmax(-1).tolist() == [0, 2] and greedy.sum(-1).tolist() == [1.0, 1.0]
    top2 = probabilities(logits, SamplingParams(1.0, top_k=2))
    assert (top2 > 0).sum(-1).tolist() == [2, 2]
    full = logits.softmax(-1)
    for top_p in (0.3, 0.7, 0.95):
        kept = probabilities(logits, SamplingParams(1.0, top_p=top_p)) > 0
        for row in range(2):
            order = full[row].argsort(descending=True)
            mass = full[row][order].cumsum(0)
            size = int((mass < top_p).sum()) + 1  # smallest prefix reaching top_p
            assert set(order[:size].tolist()) == set(kept[row].nonzero().flatten().tolist())
    cooled = probabilities(logits, SamplingParams(0.5))
    assert torch.allclose(cooled, (logits / 0.5).softmax(-1))
    # a temperature that leaves no model (inf: uniform) or no number, and filters that keep nothing
    for bad, says in (
        (dict(temperature=float("inf")), "finite and >= 0"),
        (dict(temperature=float("nan")), "finite and >= 0"),
        (dict(temperature=-1.0), "finite and >= 0"),
        (dict(top_k=-1), "top_k"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=float("nan")), "top_p"),
    ):
        with pytest.raises(DecodeInputError, match=says):
            SamplingParams(**bad)


def test_sample_without_replacement_conditionals(tiny):
    """Second draws follow q with the first draw removed and renormalised (chi-square)."""
    q = torch.tensor([0.5, 0.25, 0.15, 0.1])
    rows = 40000
    tokens, conditional, valid = sample_without_replacement(
        q.expand(rows, -1), 2, torch.Generator().manual_seed(0)
    )
    assert valid.all() and (tokens[:, 0] != tokens[:, 1]).all()
    assert torch.allclose(conditional[:, 0], q.expand(rows, -1))
    first = tiny.histogram(tokens[:, :1].tolist(), 4, 1)
    assert tiny.chi_square_p(first, q.double()) > 1e-3
    for x in range(2):
        second = tokens[tokens[:, 0] == x, 1]
        expected = q.clone()
        expected[x] = 0
        expected = (expected / expected.sum()).double()
        assert tiny.chi_square_p(tiny.histogram(second[:, None].tolist(), 4, 1), expected) > 1e-3
        assert torch.allclose(conditional[tokens[:, 0] == x, 1][0].double(), expected)
    # Fewer than k tokens with mass: the extra draws are flagged invalid.
    _, _, valid = sample_without_replacement(torch.tensor([[0.0, 1.0, 0.0]]), 2, None)
    assert valid.tolist() == [[True, False]]


def test_sample_is_exact(tiny):
    probs = torch.tensor([0.1, 0.6, 0.0, 0.3])
    draws = sample(probs.expand(20000, -1), torch.Generator().manual_seed(1))
    assert tiny.chi_square_p(tiny.histogram(draws[:, None].tolist(), 4, 1), probs.double()) > 1e-3


def test_greedy_rules_agree_on_random_trees():
    """RejectionSampling and TypicalAcceptance on a one-hot (greedy) target reduce to
    GreedyMatch, on random trees with sampled draft probabilities."""
    gen = torch.Generator().manual_seed(0)
    batch, n, vocab = 64, 7, 5
    parents = torch.tensor([-1, 0, 0, 1, 1, 2, 3]).expand(batch, n)
    tokens = torch.randint(vocab, (batch, n), generator=gen)
    logits = torch.randn(batch, n, vocab, generator=gen)
    # Make matches likely: children copy their parent's argmax half of the time.
    best = logits.argmax(-1).gather(1, parents.clamp_min(0))
    tokens = torch.where(torch.rand(batch, n, generator=gen) < 0.5, best, tokens)
    q = torch.rand(batch, n, vocab, generator=gen).softmax(-1)
    tree = DraftTree(tokens, parents, q)
    greedy = GreedyMatch()(tree, logits, SamplingParams(), None)
    for rule in (RejectionSampling(), TypicalAcceptance()):
        other = rule(tree, logits, SamplingParams(), gen)
        for field in ("path", "tokens", "num_accepted", "next_token"):
            assert torch.equal(getattr(greedy, field), getattr(other, field)), (rule, field)
    assert greedy.num_accepted.max() >= 2  # deep paths were exercised


def test_acceptance_layout_and_padding():
    """Emitted tokens are the accepted path then the next token; invalid nodes never count."""
    tree = DraftTree(
        tokens=torch.tensor([[4, 1, 2, 3], [4, 1, 2, 3]]),
        parents=torch.tensor([[-1, 0, 1, 0], [-1, 0, 1, 0]]),
        valid=torch.tensor([[True, True, True, True], [True, True, False, True]]),
    )
    logits = torch.full((2, 4, 6), -5.0)
    logits[:, 0, 1] = logits[:, 1, 2] = logits[:, 2, 5] = 5.0  # argmax 1 -> 2 -> 5
    logits[:, 3, 0] = 5.0
    result = GreedyMatch()(tree, logits, SamplingParams(), None)
    assert result.num_accepted.tolist() == [2, 1]
    assert result.path.tolist() == [[0, 1, 2, 0], [0, 1, 0, 0]]
    assert result.tokens.tolist() == [[1, 2, 5, 0], [1, 2, 0, 0]]
    assert result.next_token.tolist() == [5, 2] and result.draft_depth.tolist() == [2, 1]


def test_typical_acceptance_thresholds():
    """Medusa's rule keeps a child whose target probability clears min(eps, delta e^-H)."""
    tree = DraftTree(tokens=torch.tensor([[0, 1, 2]] * 2), parents=torch.tensor([[-1, 0, 1]] * 2))
    probs = torch.tensor([[0.5, 0.45, 0.05], [0.5, 0.45, 0.05], [0.2, 0.2, 0.6]])
    logits = torch.stack([probs.log(), probs.log()])
    logits[1, 1] = torch.tensor([0.5, 0.5, 0.0]).log()  # row 1: token 2 after node 1 has p 0
    result = TypicalAcceptance()(tree, logits, SamplingParams(1.0), torch.Generator())
    assert result.num_accepted.tolist() == [1, 1]  # p(1)=0.45 passes; p(2)=0.05 / 0 do not
    assert not TypicalAcceptance.lossless and RejectionSampling.lossless


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingParams(0.7),
        SamplingParams(1.3, top_k=5),
        SamplingParams(1.0, top_p=0.8),
        SamplingParams(0.9, top_k=20, top_p=0.6),
        SamplingParams(2.0, top_k=1),
    ],
)
def test_logit_processing_equals_transformers_warpers(sampling):
    """Temperature, top-k and top-p as transformers' generate applies them (its warpers, in
    its order), an independent reference for the distribution every exactness test targets."""
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    warpers = LogitsProcessorList([TemperatureLogitsWarper(sampling.temperature)])
    if sampling.top_k:
        warpers.append(TopKLogitsWarper(sampling.top_k))
    if sampling.top_p < 1:
        warpers.append(TopPLogitsWarper(sampling.top_p))
    logits = 3 * torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    theirs = warpers(torch.zeros(6, 1, dtype=torch.long), logits.clone()).softmax(-1)
    torch.testing.assert_close(probabilities(logits, sampling), theirs, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("shape", [(1, 40), (3, 500), (1, 5000), (4, 3000)])
def test_beam_top_keeps_ties_in_place_order(shape):
    # Beam search's candidate pick (`core.beam.stable_top`, also the recommender's `extend`): a
    # stable descending sort's first `keep`, whether it sorts the table outright (small) or takes
    # topk and resolves ties (large).
    generator = torch.Generator().manual_seed(shape[1])
    levels = torch.tensor([-1e9, -3.0, -2.5, -2.0, -1.0, float("-inf")])
    scores = levels[torch.randint(len(levels), shape, generator=generator)]  # ties everywhere
    scores[0, :5] = -1e9 - torch.arange(5.0)  # float32: -1e9 minus a little ties -1e9
    for keep in (1, 7, 40):
        values, places = stable_top(scores, keep)
        expected = scores.sort(dim=1, descending=True, stable=True)
        assert torch.equal(values, expected.values[:, :keep])
        real = values > float("-inf")  # which of the -inf a step keeps changes no result
        assert torch.equal(places[real], expected.indices[:, :keep][real])
    assert (shape[0] * shape[1] <= SORT_SCORES) == (shape[1] < 1000)  # both ways are covered

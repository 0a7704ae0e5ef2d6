"""EAGLE drafting is lossless: with the static tree (EAGLE-1) and the dynamic one (EAGLE-2),
greedy output equals plain greedy decoding token for token at batch 3 with uneven prompts, and
rejection sampling reproduces the target's exact distribution. The drafter's own KV cache
follows each row's accepted path, whatever length it kept. Plus the EAGLE-2 rerank and the
static tree built from rank statistics."""

import pytest
import torch

from genrec_spec import ControllerConfig, SamplingParams, generate
from genrec_spec.core.tree import likely_choices, top_m_tree, topology
from genrec_spec.llm.proposers import Eagle2Proposer, EagleProposer
from genrec_spec.llm.training.eagle import load_eagle
from genrec_spec.models.llm.eagle_drafter import EagleDrafter

FIXED = ControllerConfig(adaptive=False)
CHOICES = [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (0, 0, 0, 0)]


@pytest.fixture(scope="module")
def drafter(trained_eagle):
    return load_eagle(trained_eagle.folder, trained_eagle.model)[0]


def proposers(drafter, layer):
    """EAGLE-1 on a 4-deep static tree; EAGLE-2 growing 5 levels, 3 nodes expanded per level,
    keeping 20 of its 39 candidates (the tiny target's flat distributions make the drafter
    unsure, so fewer would keep no node below depth 2)."""
    return {
        "eagle": EagleProposer(drafter, layer, choices=CHOICES),
        "eagle2": Eagle2Proposer(drafter, layer, depth=5, top_k=3, tree_nodes=20),
    }


@pytest.mark.parametrize("method", ["eagle", "eagle2"])
@pytest.mark.parametrize("controller", [FIXED, None], ids=["full-depth", "adaptive"])
def test_greedy_equals_plain(trained_eagle, drafter, method, controller, kit):
    model = trained_eagle.model
    kit.assert_greedy(model, proposers(drafter, model.config.n_layers)[method], controller)


class Recording(Eagle2Proposer):
    """Records, before each draft, the committed text and the root feature it drafts from."""

    def begin(self, state):
        super().begin(state)
        self.seen = []

    def propose(self, state, budget):
        self.seen.append(
            (state.tokens.clone(), state.lengths.clone(), state.finished.clone())
            + (None if state.counts is None else state.counts.clone(),)
            + (self.root_feature.clone(), self.ready.clone())
        )
        return super().propose(state, budget)


def test_drafter_cache_follows_the_accepted_path(trained_eagle, drafter):
    """Before every draft, each ready row's root feature equals the drafter's output at the
    last pair when drafter and target run from scratch over the committed text (the target's
    features at positions 0 .. L-2 paired with tokens 1 .. L-1), although rows kept paths of
    different lengths; the single-token prompt's row is not ready at first."""
    model = trained_eagle.model
    layer = model.config.n_layers
    proposer = Recording(drafter, layer, depth=5, top_k=3, tree_nodes=12)
    prompts = trained_eagle.greedy_prompts
    generate(model, prompts, max_new_tokens=30, proposer=proposer, controller=FIXED)
    uneven = checked = 0
    for tokens, lengths, finished, counts, root_feature, ready in proposer.seen:
        uneven += counts is not None and len(set(counts[~finished].tolist())) > 1
        for b in range(len(prompts)):
            if finished[b] or not ready[b]:
                continue
            seq = tokens[b : b + 1, : int(lengths[b])]  # [1, L]
            _, hidden = model(seq, model.new_cache(*seq.shape), hidden_layers=(layer,))
            pairs = seq.shape[1] - 1
            out = drafter(hidden[layer][:, :pairs], seq[:, 1:], drafter.new_cache(1, pairs))
            torch.testing.assert_close(root_feature[b], out[0, -1], atol=1e-4, rtol=1e-4)
            checked += 1
    assert proposer.seen[0][5].tolist() == [True, False, True]
    assert uneven > 0 and checked > 10  # rows did keep different path lengths in one step


@pytest.mark.parametrize("method", ["eagle", "eagle2"])
def test_rejection_sampling_is_exact(kit, method):
    """Temperature 0.8 on a vocabulary of 8: the histogram of the first 3 generated tokens over
    6000 rows per prompt against the enumerated target distribution (512 sequences). A drafter
    with random weights makes drafts that are sometimes accepted, at every depth of the tree;
    EAGLE-2's trees differ from row to row."""
    model = kit.exact_target()
    with torch.random.fork_rng():
        torch.manual_seed(3)
        random_drafter = EagleDrafter(
            model.config, model.tok_embeddings.weight, model.output.weight
        )
    proposer = {
        "eagle": EagleProposer(random_drafter, 2, choices=CHOICES[:6]),
        "eagle2": Eagle2Proposer(random_drafter, 2, depth=3, top_k=2, tree_nodes=8),
    }[method]
    sampling = SamplingParams(0.8)
    kit.assert_exact(model, proposer, sampling)


def test_draft_vocabulary_restricts_drafts(kit):
    """A drafter whose LM head keeps 12 of 61 tokens drafts only those, and greedy decoding
    stays exact."""
    model = kit.tiny_llama(61, seed=0)
    ids = torch.arange(0, 60, 5)  # [12]
    with torch.random.fork_rng():
        torch.manual_seed(0)
        small = EagleDrafter(model.config, model.tok_embeddings.weight, model.output.weight, ids)
    assert small.logits(torch.zeros(2, 32)).shape == (2, 12)
    proposer = Eagle2Proposer(small, 2, depth=3, top_k=3, tree_nodes=6)
    prompts = [[5, 9, 2], [4, 1, 1, 7, 8]]
    plain = generate(model, prompts, max_new_tokens=12).tolist()
    drafted = []
    original = proposer.propose
    proposer.propose = lambda state, budget: drafted.append(original(state, budget)) or drafted[-1]
    out = generate(model, prompts, max_new_tokens=12, proposer=proposer, controller=FIXED)
    assert out.tolist() == plain and drafted
    assert all(torch.isin(tree.tokens[:, 1:], ids).all() for tree in drafted)
    with pytest.raises(ValueError, match="draft vocabulary has 12 tokens"):
        Eagle2Proposer(small, 2, top_k=13)


def test_top_m_tree_keeps_parents_before_children():
    """The m best candidates per row by score, in candidate order, parents renumbered; rows
    keep different shapes."""
    roots = torch.tensor([100, 200])
    tokens = torch.arange(1, 9).expand(2, 8)  # candidate c holds token c + 1
    parents = torch.tensor([[-1, -1, 0, 0, 1, 1, 2, 4]] * 2)
    scores = torch.tensor(
        [
            [-1.0, -2.0, -1.5, -3.0, -2.5, -4.0, -1.6, -2.6],  # keeps 0, 1, 2, 6: a chain 0-2-6
            [-3.0, -0.5, -4.0, -5.0, -0.7, -0.9, -6.0, -0.8],  # keeps 1, 4, 5, 7: 1-4-7 and 1-5
        ]
    )
    tree = top_m_tree(roots, tokens, scores, parents, 4)
    assert tree.tokens.tolist() == [[100, 1, 2, 3, 7], [200, 2, 5, 6, 8]]
    assert tree.parents.tolist() == [[-1, 0, 0, 1, 3], [-1, 0, 1, 1, 2]]
    assert topology(tree.parents)[1].tolist() == [[0, 1, 1, 2, 3], [0, 1, 2, 2, 3]]


def test_likely_choices():
    """Paths best first by the product of their ranks' acceptance, prefixes first; a deep
    chain when the top choice is usually right."""
    assert likely_choices([0.8, 0.1], 5, 4) == [(0,), (0, 0), (0, 0, 0), (0, 0, 0, 0), (1,)]
    assert likely_choices([0.5, 0.3], 4, 2) == [(0,), (1,), (0, 0), (0, 1)]
    assert likely_choices([0.9, 0.0], 3, 2) == [(0,), (0, 0)]  # rank 1 never: a 2-node tree


def test_static_tree_needs_a_node(kit):
    model = kit.tiny_llama(61, seed=0)
    drafter = EagleDrafter(model.config, model.tok_embeddings.weight, model.output.weight)
    with pytest.raises(ValueError, match="no draft node"):
        EagleProposer(drafter, 2, rank_acceptance=[0.0, 0.0])

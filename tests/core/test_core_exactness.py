"""Speculative sampling reproduces the target's exact distribution.

A tiny random target (vocabulary 8) gives the exact joint distribution of the first three
generated tokens by enumeration (512 sequences). Each method samples many rows in one batched
call (two prompts of different lengths, so B > 1 with uneven prompts), and the histogram must
pass a chi-square test and sit within sampling noise in total variation. Seeds are fixed, so
the outcome is stable. Negative controls show the test has power: typical acceptance and two
deliberately wrong multi-draft rules fail it by a wide margin.
"""

import pytest
import torch

from genrec_spec import (
    CallableTarget,
    ControllerConfig,
    DraftTree,
    SamplingParams,
    TypicalAcceptance,
    generate,
)
from genrec_spec.core.sampling import probabilities
from genrec_spec.llm.proposers import (
    DraftModelProposer,
    LookaheadProposer,
    PromptLookup,
    TrieProposer,
)

VOCAB, LENGTH = 8, 3
PROMPTS = [[1, 2, 3, 1, 2], [5, 4]]
FIXED = ControllerConfig(adaptive=False)


@pytest.fixture(scope="module")
def models(tiny):
    target = tiny.HashLM(VOCAB, seed=0, scale=1.5)
    draft = tiny.HashLM(VOCAB, seed=1, like=target, noise=1.5)
    return target, draft


def run(tiny, models, proposer, sampling, rows, acceptance=None, seed=0, stats=None):
    """Sample `rows` rows per prompt; return [(counts, exact probs)] per prompt (and append the
    call's DecodeStats to ``stats`` when given)."""
    target, _ = models
    prompts = [p for p in PROMPTS for _ in range(rows)]
    out = generate(
        CallableTarget(target),
        prompts,
        proposer=proposer,
        sampling=sampling,
        max_new_tokens=LENGTH,
        generator=torch.Generator().manual_seed(seed),
        controller=FIXED,
        acceptance=acceptance,
    )
    if stats is not None:
        stats.append(out.stats)
    out = out.tolist()
    return [
        (
            tiny.histogram(out[i * rows : (i + 1) * rows], VOCAB, LENGTH),
            tiny.exact_distribution(target, prompt, LENGTH, sampling),
        )
        for i, prompt in enumerate(PROMPTS)
    ]


def draft(models, **kwargs):
    return DraftModelProposer(CallableTarget(models[1]), **kwargs)


CASES = {
    "chain-T1": (lambda m: draft(m, k=2), SamplingParams(1.0), 10000),
    "chain-topk": (lambda m: draft(m, k=3), SamplingParams(0.7, top_k=5), 10000),
    "tree-without-replacement-topp": (
        lambda m: draft(m, k=2, width=3),
        SamplingParams(1.3, top_p=0.8),
        10000,
    ),
    "tree-iid": (lambda m: draft(m, k=2, width=3, children="iid"), SamplingParams(1.0), 10000),
    "tree-top-w-deterministic": (
        lambda m: draft(m, k=2, width=3, children="top"),
        SamplingParams(1.0, top_k=4),
        10000,
    ),
    "tree-static-choices": (
        lambda m: draft(m, choices=[(0,), (1,), (0, 0), (0, 1), (1, 0)]),
        SamplingParams(0.9, top_p=0.9),
        10000,
    ),
    "prompt-lookup": (lambda m: PromptLookup(k=3), SamplingParams(1.0), 10000),
    "trie": (lambda m: TrieProposer(k=2), SamplingParams(0.8), 4000),
    "lookahead": (lambda m: LookaheadProposer(window=3, ngram=3), SamplingParams(0.8), 4000),
}


# Model-free drafters rarely hit on a random model: their statistics count only where drafts
# were accepted at depth 2 (a chain of accepted tokens, not just single ones).
DEEP = ("prompt-lookup", "trie", "lookahead")


@pytest.mark.parametrize("name", CASES)
def test_speculative_sampling_is_exact(tiny, models, name):
    make, sampling, rows = CASES[name]
    stats = []
    results = run(tiny, models, make(models), sampling, rows, stats=stats)
    if name in DEEP:
        assert stats[0].accepted_per_position[1] > 0, stats[0]
    for counts, probs in results:
        p_value = tiny.chi_square_p(counts, probs)
        tv = tiny.total_variation(counts, probs)
        noise = tiny.tv_noise(probs, rows)
        assert p_value > 1e-3, (name, p_value)
        assert tv < 1.5 * noise, (name, tv, noise)


def test_plain_sampling_is_exact(tiny, models):
    """The baseline the others are held to: proposer=None with the same statistics."""
    for counts, probs in run(tiny, models, None, SamplingParams(1.1, top_k=6, top_p=0.9), 10000):
        assert tiny.chi_square_p(counts, probs) > 1e-3


class RootQ:
    """A deliberately wrong proposer for depth-1 trees: it drafts like `inner` (distinct
    children) but labels every child with the draft's distribution q at the root, the rule for
    i.i.d. siblings. Children sampled without replacement need q with the earlier siblings
    removed, and deterministic top-w children need one-hot: rejection sampling is then biased."""

    def __init__(self, inner, draft_model, sampling):
        self.inner, self.draft_model, self.sampling = inner, draft_model, sampling
        self.k, self.draft_cost, self.hidden_layers = 1, 0.0, ()

    def begin(self, state):
        self.inner.begin(state)

    def observe(self, state, acceptance):
        self.inner.observe(state, acceptance)

    def propose(self, state, budget):
        tree = self.inner.propose(state, budget)
        rows = torch.arange(state.batch_size)
        logits = self.draft_model(state.tokens)[rows, state.lengths - 1]  # causal: pads after
        q = probabilities(logits, self.sampling)[:, None].expand(-1, tree.num_nodes, -1)
        return DraftTree(tree.tokens, tree.parents, q.contiguous(), tree.valid)


@pytest.mark.parametrize("control", ["typical", "unconditioned-siblings", "q-for-top-w"])
def test_negative_controls_fail(tiny, models, control):
    sampling = SamplingParams(1.0)
    if control == "typical":
        proposer, rule = draft(models, k=2), TypicalAcceptance()
    elif control == "unconditioned-siblings":
        proposer, rule = RootQ(draft(models, k=1, width=4), models[1], sampling), None
    else:
        proposer, rule = (
            RootQ(draft(models, k=1, width=4, children="top"), models[1], sampling),
            None,
        )
    (counts, probs), _ = run(tiny, models, proposer, sampling, 10000, acceptance=rule)
    assert tiny.chi_square_p(counts, probs) < 1e-6
    assert tiny.total_variation(counts, probs) > 2.5 * tiny.tv_noise(probs, 10000)

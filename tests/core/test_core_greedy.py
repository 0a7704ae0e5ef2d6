"""Greedy speculative decoding equals plain greedy decoding, token for token, for every
proposer and every target adapter (callable, Hugging Face, native Llama), with B > 1, uneven
prompts, eos, and the adaptive controller; plain decoding itself equals a cache-free loop."""

import pytest
import torch

from genrec_spec import CallableTarget, ControllerConfig, HFTarget, NativeTarget, generate
from genrec_spec.llm.proposers import (
    DraftModelProposer,
    LookaheadProposer,
    PromptLookup,
    TrieProposer,
)

VOCAB = 61
PROMPTS = [[5, 9, 2, 33, 7, 5, 9, 2, 8], [4, 60], [12, 3, 3, 40, 22, 3]]
FIXED = ControllerConfig(adaptive=False)


@pytest.fixture(scope="module")
def targets(tiny):
    """name -> (target factory, a draft model of the same vocabulary, cache-free callable)."""
    hash_lm = tiny.HashLM(VOCAB, seed=3, scale=3.0, order=1)
    native, hf = tiny.native_llama(0), tiny.hf_llama(VOCAB, 0, 4.0)

    def native_fn(ids):
        return native(ids, native.new_cache(ids.shape[0], ids.shape[1]))

    return {
        "callable": (
            lambda: CallableTarget(hash_lm),
            CallableTarget(tiny.HashLM(VOCAB, seed=4, like=hash_lm, noise=1.0)),
            hash_lm,
        ),
        "hf": (lambda: HFTarget(hf), tiny.perturbed(hf, 1, 0.05), lambda ids: hf(ids).logits),
        "native": (lambda: NativeTarget(native), tiny.perturbed(native, 1, 0.05), native_fn),
    }


PROPOSERS = {
    "draft-chain": lambda draft: DraftModelProposer(draft, k=3),
    "draft-tree-top": lambda draft: DraftModelProposer(draft, k=3, width=2, children="top"),
    "draft-tree-sample": lambda draft: DraftModelProposer(draft, k=2, width=3),
    "draft-choices": lambda draft: DraftModelProposer(
        draft, choices=[(0,), (1,), (0, 0), (0, 1), (0, 0, 0)]
    ),
    "prompt-lookup": lambda draft: PromptLookup(k=3),
    "trie": lambda draft: TrieProposer(k=3, max_nodes=8),
    "lookahead": lambda draft: LookaheadProposer(window=3, ngram=3, verify=3),
}


@pytest.mark.parametrize("target_name", ["callable", "hf", "native"])
def test_plain_greedy_matches_cache_free_loop(tiny, targets, target_name):
    make, _, fn = targets[target_name]
    out = generate(make(), PROMPTS, max_new_tokens=12)
    assert out.tolist() == tiny.naive_greedy(fn, PROMPTS, 12)
    assert out.offsets.tolist() == [0, 12, 24, 36]
    assert out.stats.target_forwards == 12 and out.stats.mean_accepted_length == 1.0


@pytest.mark.parametrize("proposer_name", PROPOSERS)
@pytest.mark.parametrize("target_name", ["callable", "hf", "native"])
def test_speculative_greedy_equals_plain(targets, target_name, proposer_name):
    make, draft, _ = targets[target_name]
    plain = generate(make(), PROMPTS, max_new_tokens=20).tolist()
    first = int(getattr(make(), "scores_prefill", False))
    out = generate(
        make(),
        PROMPTS,
        max_new_tokens=20,
        controller=FIXED,
        proposer=PROPOSERS[proposer_name](draft),
    )
    assert out.tolist() == plain
    stats = out.stats
    # Every forward drafts but the prefill, where it scores the first token
    assert stats.speculative_forwards == stats.target_forwards - first <= 20
    if target_name == "callable" or proposer_name.startswith("draft"):
        assert stats.mean_accepted_length > 1.5  # drafts were accepted: the check has teeth
    assert all(
        a <= d for a, d in zip(stats.accepted_per_position, stats.drafted_per_position, strict=True)
    )


def test_cross_adapter_draft_and_self_draft(tiny, targets):
    """An HF model drafts for the native target; a copy of the target itself accepts every
    draft token, so each forward after the prefill (which scores the first token) yields
    k + 1 tokens."""
    make, _, _ = targets["native"]
    plain = generate(make(), PROMPTS, max_new_tokens=17).tolist()
    out = generate(
        make(),
        PROMPTS,
        max_new_tokens=17,
        controller=FIXED,
        proposer=DraftModelProposer(tiny.hf_llama(VOCAB, 1, 4.0), k=3),
    )
    assert out.tolist() == plain
    self_draft = generate(
        make(),
        PROMPTS,
        max_new_tokens=17,
        controller=FIXED,
        proposer=DraftModelProposer(make(), k=3),
    )
    assert self_draft.tolist() == plain
    stats = self_draft.stats
    assert stats.target_forwards == 5 and stats.speculative_forwards == 4
    assert stats.accepted_per_position == (12, 12, 12)


def test_eos_and_adaptive_controller(tiny, targets):
    """Rows stop right after their eos token (ragged output); the adaptive controller (the
    default) changes only the speed."""
    make, draft, fn = targets["callable"]
    reference = tiny.naive_greedy(fn, PROMPTS, 20)
    eos = reference[0][5]
    expected = tiny.naive_greedy(fn, PROMPTS, 20, eos=eos)
    for proposer in [None, DraftModelProposer(draft, k=3), LookaheadProposer()]:
        out = generate(make(), PROMPTS, max_new_tokens=20, proposer=proposer, eos_token_id=eos)
        assert out.tolist() == expected
        assert (
            out.offsets.tolist()
            == [0] + torch.tensor([len(r) for r in expected]).cumsum(0).tolist()
        )


def test_tensor_prompts_with_lengths(tiny, targets):
    make, _, fn = targets["callable"]
    padded = torch.zeros(3, 9, dtype=torch.long)
    for b, prompt in enumerate(PROMPTS):
        padded[b, : len(prompt)] = torch.tensor(prompt)
    out = generate(
        make(),
        padded,
        prompt_lengths=torch.tensor([9, 2, 6]),
        max_new_tokens=6,
        proposer=PromptLookup(k=2),
    )
    assert out.tolist() == tiny.naive_greedy(fn, PROMPTS, 6)

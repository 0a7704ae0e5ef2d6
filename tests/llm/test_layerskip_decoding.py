"""Layer-skip drafting is lossless: greedy output equals plain greedy decoding token for token
at batch 3 with uneven prompts, and rejection sampling reproduces the target's exact
distribution (temperature, top-k and top-p, chain and tree, a draft vocabulary smaller than the
target's). Drafting on the target's own cache drafts exactly what the same early exit drafts
with a cache of its own."""

import pytest
import torch

from genrec_spec import CallableTarget, ControllerConfig, SamplingParams, generate
from genrec_spec.core.targets import NativeTarget
from genrec_spec.core.types import DecodeInputError
from genrec_spec.llm.proposers import DraftModelProposer, LayerSkipProposer, layer_skip_copy
from genrec_spec.llm.training.layerskip import load_layerskip
from genrec_spec.models.llm.exit_head import EarlyExit, ExitHead

FIXED = ControllerConfig(adaptive=False)


@pytest.fixture(scope="module")
def draft(trained_layerskip):
    return load_layerskip(trained_layerskip.folder, trained_layerskip.model)[0]


def plain_exit(model, n_layers: int = 1, vocab_ids=None) -> EarlyExit:
    """The untrained exit head: the target's final norm and LM head right after layer n."""
    head = ExitHead(model.config, model.norm.weight, model.output.weight, 16, vocab_ids)
    return EarlyExit(model, head, n_layers)


def test_untrained_head_is_plain_early_exit(kit):
    """Before training the draft scores as the target's first layer with its norm and LM head
    (``layer_skip_copy``), and a draft vocabulary masks the other tokens out."""
    model = kit.tiny_llama(61, seed=0)
    ids = torch.tensor([[5, 9, 2, 33], [4, 1, 7, 7]])  # B = 2
    expected = layer_skip_copy(model, 1)(ids, model.new_cache(2, 4))
    torch.testing.assert_close(plain_exit(model)(ids, model.new_cache(2, 4)), expected)
    kept = torch.arange(0, 61, 3)
    masked = plain_exit(model, vocab_ids=kept)(ids, model.new_cache(2, 4))
    torch.testing.assert_close(masked[..., kept], expected[..., kept])
    assert masked.isinf().sum() == 2 * 4 * (61 - len(kept))


@pytest.mark.parametrize("width", [1, 2], ids=["chain", "tree"])
@pytest.mark.parametrize("controller", [FIXED, None], ids=["full-depth", "adaptive"])
def test_greedy_equals_plain(trained_layerskip, draft, width, controller, kit):
    proposer = LayerSkipProposer(draft, k=4, width=width)
    kit.assert_greedy(trained_layerskip.model, proposer, controller, min_accepted=2.0, deep=3)


def test_shared_cache_drafts_as_an_own_cache(trained_layerskip, draft):
    """The same early exit as a separate draft model (its own cache, kept in step by
    DraftModelProposer) makes the same drafts at every step: equal acceptance counts."""
    model = trained_layerskip.model
    prompts = trained_layerskip.greedy_prompts
    shared = LayerSkipProposer(draft, k=4, width=2)
    own = DraftModelProposer(NativeTarget(draft), k=4, width=2)
    a = generate(model, prompts, max_new_tokens=30, proposer=shared, controller=FIXED)
    b = generate(model, prompts, max_new_tokens=30, proposer=own, controller=FIXED)
    assert a.tolist() == b.tolist()
    assert a.stats.accepted_per_position == b.stats.accepted_per_position
    assert a.stats.drafted_per_position == b.stats.drafted_per_position


def test_greedy_tree_takes_the_draft_top_w(trained_layerskip, draft):
    """Under greedy decoding a root of width 3 gets the draft's 3 most likely tokens, all valid
    (the one-hot greedy distribution alone would leave one). The first tree hangs under the
    first generated token (the prefill scored it)."""
    model, prompts = trained_layerskip.model, trained_layerskip.greedy_prompts
    proposer = LayerSkipProposer(draft, k=2, width=3)
    trees = []
    original = proposer.propose
    proposer.propose = lambda state, budget: trees.append(original(state, budget)) or trees[-1]
    out = generate(model, prompts, max_new_tokens=4, proposer=proposer, controller=FIXED)
    for b, prompt in enumerate(prompts):
        seen = prompt + out.tolist()[b][:1]
        logits = draft(torch.tensor([seen]), model.new_cache(1, len(seen)))[0, -1]  # [V]
        assert trees[0].tokens[b, 1:4].tolist() == logits.topk(3).indices.tolist()
    assert trees[0].valid[:, :4].all()


@pytest.mark.parametrize(
    "sampling, width",
    [(SamplingParams(0.8), 1), (SamplingParams(1.0, top_k=6, top_p=0.9), 2)],
    ids=["chain-t0.8", "tree-topk-topp"],
)
def test_rejection_sampling_is_exact(kit, sampling, width):
    """The histogram of the first 3 generated tokens over 6000 rows per prompt against the
    enumerated target distribution (512 sequences) on a vocabulary of 8. The head has random
    weights and drafts from 6 of the 8 tokens only; drafts are accepted at every depth."""
    model = kit.exact_target()
    with torch.random.fork_rng():
        torch.manual_seed(3)
        head = ExitHead(model.config, model.norm.weight, model.output.weight, 16, torch.arange(6))
        torch.nn.init.normal_(head.feed_forward.w2.weight, std=0.3)
    proposer = LayerSkipProposer(EarlyExit(model, head, 1), k=3, width=width)
    kit.assert_exact(model, proposer, sampling)


def test_needs_the_native_target(kit):
    """The draft runs on the target's cache: another kind of target is refused clearly."""
    model = kit.tiny_llama(61, seed=0)
    proposer = LayerSkipProposer(plain_exit(model))
    with pytest.raises(DecodeInputError, match="runs on the target's own KV cache"):
        generate(CallableTarget(kit.ChainLM(model)), [[1, 2]], proposer=proposer)
    with pytest.raises(ValueError, match="keeps 1 .. 1 of the target's 2 layers"):
        plain_exit(model, n_layers=2)

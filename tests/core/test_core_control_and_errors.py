"""The adaptive draft-depth controller, and clear errors for bad input."""

import pytest
import torch

from genrec_spec import (
    CallableTarget,
    ControllerConfig,
    DecodeInputError,
    DraftTree,
    SamplingParams,
    as_target,
    generate,
)
from genrec_spec.core.beam import beam_search
from genrec_spec.core.constraints import AllowedTokens
from genrec_spec.core.controller import SpeculationController
from genrec_spec.llm.proposers import DraftModelProposer, PromptLookup


def feed(controller, steps, rate):
    """Run steps where each row-draft token is accepted with the given rate."""
    budgets = []
    for _ in range(steps):
        budget = controller.budget()
        budgets.append(budget)
        controller.update(budget, budget + 1, 100, 100 * budget, 100 * rate, 100 * (1 - rate))
    return budgets


def test_controller_adapts_and_switches_off():
    config = ControllerConfig()
    high = SpeculationController(config, k_max=6, draft_cost=0.0, batch_size=1)
    assert feed(high, 10, 0.9)[-1] == 6
    low = SpeculationController(config, k_max=6, draft_cost=0.0, batch_size=1)
    budgets = feed(low, 40, 0.02)
    assert budgets[-20:].count(0) >= 17  # off, apart from periodic probes
    assert any(budgets[-20:])  # ... which do happen
    big_batch = SpeculationController(config, k_max=6, draft_cost=0.0, batch_size=256)
    assert feed(big_batch, 5, 0.8)[-1] == 0  # scoring 256 rows x k tokens does not pay
    costly_draft = SpeculationController(config, k_max=6, draft_cost=0.5, batch_size=1)
    assert 0 < feed(costly_draft, 10, 0.8)[-1] < 6  # a draft forward per level: shallower
    fixed = SpeculationController(ControllerConfig(adaptive=False), 6, 0.0, 256)
    assert feed(fixed, 3, 0.0) == [6, 6, 6]


def test_measured_pass_cost_shapes_the_depth():
    """A CPU-like table (2 tokens cost what 1 does, 3 cost 1.4x): interpolated between sizes,
    extended at its average slope; with acceptance 0.6 the controller drafts 1 token, where the
    linear model drafts deeper."""
    table = (1.0, 1.0, 1.4, 1.5, 1.8)
    measured = SpeculationController(ControllerConfig(pass_cost=table), 6, 0.0, 1)
    assert measured.pass_cost(2) == 1.0 and measured.pass_cost(2.5) == pytest.approx(1.2)
    assert measured.pass_cost(7) == pytest.approx(1.8 + 2 * 0.2)
    assert feed(measured, 10, 0.6)[-1] == 1
    assert feed(SpeculationController(ControllerConfig(), 6, 0.0, 1), 10, 0.6)[-1] > 1


def test_generate_turns_speculation_off_for_large_batches(tiny):
    """Text that repeats (a Markov model's own greedy cycle in the prompt) makes prompt lookup
    nearly always right: on for 2 rows, yet off for 512 rows."""
    lm = tiny.HashLM(16, seed=0, order=1)
    cycle = generate(CallableTarget(lm), [[1, 2, 3]], max_new_tokens=32).tolist()[0]
    prompts = [[1, 2, 3] + cycle] * 2
    small = generate(CallableTarget(lm), prompts, max_new_tokens=16, proposer=PromptLookup())
    large = generate(CallableTarget(lm), prompts * 256, max_new_tokens=16, proposer=PromptLookup())
    assert small.stats.speculative_forwards == small.stats.target_forwards
    assert small.stats.mean_accepted_length > 2
    assert large.stats.speculative_forwards < 0.25 * large.stats.target_forwards
    assert large.tolist()[:2] == small.tolist()


@pytest.fixture(scope="module")
def target(tiny):
    return CallableTarget(tiny.HashLM(12, seed=0), max_length=16)


@pytest.mark.parametrize(
    "prompts, match",
    [
        ([[1, 2], []], "empty"),
        (torch.zeros(2, 0, dtype=torch.long), "empty"),
        ([[1] * 20, [2]], "context"),
        ([[1] * 10, [2]], "context"),  # 10 + max_new_tokens 8 > 16
        ([[1, 40], [2]], "vocabulary"),
        ({"input_ids": [1, 2]}, "not a token id"),  # a tokenizer's dict, not its ids
        ([[1, 2.5], [2]], "not a token id"),
        (torch.tensor([[1.0, 2.0]]), "not token ids"),  # (read as ids 1, 2 before)
    ],
)
def test_bad_prompts(target, prompts, match):
    with pytest.raises(DecodeInputError, match=match):
        generate(target, prompts, max_new_tokens=8)


@pytest.mark.parametrize(
    "change, match",
    [
        # one length per row (a length for 1 of 2 rows failed inside the target, or passed)
        (dict(prompt_lengths=torch.tensor([2])), r"shape \(1,\) for 2 prompts"),
        (dict(prompt_lengths=torch.tensor([[2], [1]])), r"shape \(2, 1\) for 2 prompts"),
        # an end token the target cannot emit never ends a row (decoded to max_new_tokens)
        (dict(eos_token_id=12), "eos_token_id 12 is not a token"),
        (dict(eos_token_id=[3, -1]), "eos_token_id -1 is not a token"),
        # a hook's id past the vocabulary (an IndexError before)
        (dict(constraint=AllowedTokens(lambda row, ids: [1, 99], 12)), "returned 99"),
    ],
)
def test_bad_arguments_of_generate_and_beam_search(target, change, match):
    prompts = torch.tensor([[1, 2], [3, 0]])
    for decode in (generate, beam_search):
        with pytest.raises(DecodeInputError, match=match):
            decode(target, prompts, max_new_tokens=4, **change)


def test_bad_settings(tiny, target):
    with pytest.raises(DecodeInputError, match="max_new_tokens"):
        generate(target, [[1, 2]], max_new_tokens=0)
    for bad in ({"top_p": 0.0}, {"top_p": 1.5}, {"temperature": -1.0}, {"top_k": -2}):
        with pytest.raises(ValueError, match="Fix:"):
            SamplingParams(**bad)
    with pytest.raises(DecodeInputError, match="vocabulary"):
        other = CallableTarget(tiny.HashLM(10, seed=1))
        generate(target, [[1, 2], [3]], max_new_tokens=4, proposer=DraftModelProposer(other))
    with pytest.raises(DecodeInputError, match="CallableTarget"):
        as_target(object())
    with pytest.raises(DecodeInputError, match=r"\[B, N\]"):
        DraftTree(tokens=torch.zeros(2, 3, dtype=torch.long), parents=torch.zeros(2, 4))


def test_nan_logits_raise(tiny):
    lm = tiny.HashLM(12, seed=0)

    def broken(ids):
        logits = lm(ids)
        logits[ids.shape[0] // 2 :, -1, 3] = float("nan")  # some rows only
        return logits

    with pytest.raises(DecodeInputError, match="target's logits contain NaN"):
        generate(CallableTarget(broken), [[1, 2], [3, 4, 5]], max_new_tokens=4)
    with pytest.raises(DecodeInputError, match="draft probabilities contain NaN"):
        generate(
            CallableTarget(lm),
            [[1, 2], [3, 4, 5]],
            max_new_tokens=4,
            sampling=SamplingParams(1.0),
            controller=ControllerConfig(adaptive=False),
            proposer=DraftModelProposer(CallableTarget(broken), k=2),
        )

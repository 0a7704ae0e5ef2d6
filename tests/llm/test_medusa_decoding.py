"""Medusa drafting is lossless: greedy output equals plain greedy decoding token for token, and
rejection sampling reproduces the target's exact distribution (typical acceptance, the lossy
rule, fails the same test). The heads read the hidden state of each row's last kept node."""

import pytest
import torch
from transformers import LlamaConfig as HFLlamaConfig
from transformers import LlamaForCausalLM

from genrec_spec import ControllerConfig, HFTarget, SamplingParams, TypicalAcceptance, generate
from genrec_spec.llm.proposers import MedusaProposer
from genrec_spec.llm.training.medusa import load_medusa
from genrec_spec.models.llm.medusa_heads import MedusaHeads

FIXED = ControllerConfig(adaptive=False)


@pytest.fixture(scope="module")
def heads(trained):
    return load_medusa(trained.folder, trained.model)[0]


@pytest.mark.parametrize("controller", [FIXED, None], ids=["full-depth", "adaptive"])
def test_greedy_equals_plain(trained, heads, controller, kit):
    model = trained.model
    proposer = MedusaProposer(heads, hidden_layer=model.config.n_layers)
    out = kit.assert_greedy(model, proposer, controller, min_accepted=1.15, deep=None)
    assert all(
        a <= d
        for a, d in zip(
            out.stats.accepted_per_position, out.stats.drafted_per_position, strict=True
        )
    )


def test_greedy_equals_plain_hf_target(trained):
    """The same through a transformers model (HFTarget: pending re-fed tokens before each tree,
    its own hidden-state slicing), with heads on its LM head."""
    config = HFLlamaConfig(
        vocab_size=61,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=96,
    )
    torch.manual_seed(0)
    hf = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.mul_(4.0)  # peaked distributions: no near-ties in greedy paths
    heads = MedusaHeads(hf.lm_head.weight, num_heads=3)
    with torch.no_grad():
        heads.weight.normal_(0, 0.05, generator=torch.Generator().manual_seed(2))
    plain = generate(HFTarget(hf), trained.greedy_prompts, max_new_tokens=20).tolist()
    out = generate(
        HFTarget(hf),
        trained.greedy_prompts,
        max_new_tokens=20,
        proposer=MedusaProposer(heads, hidden_layer=2),
        controller=FIXED,
    )
    assert out.tolist() == plain
    assert out.stats.speculative_forwards == out.stats.target_forwards
    assert out.stats.accepted_per_position[0] > 0  # some rows kept paths past the root


class Recording(MedusaProposer):
    """Records, before each draft, the committed text and the root state the heads will read."""

    def begin(self, state):
        super().begin(state)
        self.seen = []

    def propose(self, state, budget):
        counts = None if state.counts is None else state.counts.clone()
        self.seen.append(
            (state.tokens.clone(), state.lengths.clone(), state.finished.clone(), counts)
            + (self.root_hidden.clone(), self.ready.clone())
        )
        return super().propose(state, budget)


def test_heads_read_the_last_kept_node(trained, heads):
    """Before every draft, each ready row's root state equals the target's hidden state at the
    token before the root, computed from scratch on the committed text, although rows keep
    paths of different lengths; the single-token prompt's row is not ready at first."""
    model = trained.model
    layer = model.config.n_layers
    proposer = Recording(heads, hidden_layer=layer)
    generate(model, trained.greedy_prompts, max_new_tokens=30, proposer=proposer, controller=FIXED)
    uneven = 0
    for tokens, lengths, finished, counts, root_hidden, ready in proposer.seen:
        uneven += counts is not None and len(set(counts[~finished].tolist())) > 1
        for b in range(len(trained.greedy_prompts)):
            if finished[b] or not ready[b]:
                continue
            seq = tokens[b : b + 1, : int(lengths[b])]
            _, hidden = model(seq, model.new_cache(*seq.shape), hidden_layers=(layer,))
            torch.testing.assert_close(root_hidden[b], hidden[layer][0, -2], atol=1e-4, rtol=1e-4)
    assert proposer.seen[0][5].tolist() == [True, False, True]
    assert uneven > 0  # rows did keep different path lengths in the same step


CHOICES = [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]  # siblings at depths 1 and 2


@pytest.mark.parametrize("rule", ["rejection", "typical"])
def test_rejection_sampling_is_exact(kit, rule):
    """Temperature 0.8 on a vocabulary of 8: the histogram of the first 3 generated tokens over
    6000 rows per prompt against the enumerated target distribution (512 sequences). Heads with
    random weights make drafts that are sometimes accepted, at every depth of the tree."""
    model = kit.exact_target()
    heads = MedusaHeads(model.output.weight, num_heads=3)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        heads.weight.normal_(0, 0.3, generator=gen)
        heads.bias.normal_(0, 0.3, generator=gen)
    proposer = MedusaProposer(heads, model.config.n_layers, choices=CHOICES)
    sampling = SamplingParams(0.8)
    acceptance = TypicalAcceptance() if rule == "typical" else None
    for prompt, p_value, tv, noise in kit.exactness(model, proposer, sampling, acceptance):
        if rule == "rejection":
            assert p_value > 1e-3 and tv < 1.5 * noise, (prompt, p_value, tv, noise)
        else:  # the lossy rule: the test has the power to see it
            assert p_value < 1e-6 and tv > 2.5 * noise, (prompt, p_value, tv, noise)

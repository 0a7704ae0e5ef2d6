"""The gate that lets speculative beam search draft only while drafts pay (core.draft_gate)."""

import torch

from genrec_spec import CallableTarget
from genrec_spec.core.beam import BeamConfig, beam_search
from genrec_spec.core.controller import ControllerConfig
from genrec_spec.core.draft_gate import DraftGate

VOCAB, EOS = 40, 3


def gate_decisions(gate: DraftGate, passes: int, saves_every: int = 0) -> list[bool]:
    """Whether each of `passes` passes drafts, each drafted pass carrying twice its own nodes
    as drafts, and every `saves_every`-th of them saving a step (0: none does)."""
    opened, drafted = [], 0
    for _ in range(passes):
        opened.append(gate.opens())
        if opened[-1]:
            gate.count_pass(nodes=5, drafted=10)
            drafted += 1
            if saves_every and drafted % saves_every == 0:
                gate.count_saved_step()
    return opened


def test_the_gate_closes_on_drafts_that_save_nothing_then_probes():
    opened = gate_decisions(DraftGate(ControllerConfig(probe_every=4)), 24)
    first_closed = opened.index(False)
    assert 1 <= first_closed <= 4  # the prior lets it measure first
    after = opened[first_closed:]
    # closed, it drafts one pass in probe_every (and closes again: those save nothing either)
    assert [i for i, o in enumerate(after) if o] == [3, 7, 11, 15, 19][: sum(after)]
    assert sum(after) >= 4


def test_the_gate_stays_open_while_drafts_save_steps():
    # a saved step a drafted pass against 2/3 of a pass's extra cost (linear model, 0.1 a node)
    assert all(gate_decisions(DraftGate(ControllerConfig()), 30, saves_every=1))


def test_a_measured_table_prices_the_drafted_nodes():
    # nearly free nodes (a flat table): a step saved every fourth drafted pass keeps it open,
    # where the linear model's price closes it
    flat = ControllerConfig(pass_cost=(1.0,) * 16)
    assert all(gate_decisions(DraftGate(flat), 30, saves_every=4))
    assert not all(gate_decisions(DraftGate(ControllerConfig()), 30, saves_every=4))
    assert all(gate_decisions(DraftGate(ControllerConfig(adaptive=False)), 30))


class MarkovLM:
    """A seeded random bigram model."""

    def __init__(self, vocab: int, seed: int) -> None:
        self.table = 3 * torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(seed))

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:  # [B, T] -> [B, T, V]
        return self.table[ids]


class LeastLikelyDrafter:
    """Drafts below every beam the token its model ranks last: drafts that never hit."""

    def __init__(self, model: MarkovLM) -> None:
        self.worst = model.table.argmin(1)  # [V] each token's least likely successor

    def begin(self, tokens: torch.Tensor, lengths: torch.Tensor) -> None:
        pass

    def draft(self, tree, rows, nodes, budget, cache) -> None:
        tokens = self.worst[tree.tokens[rows, nodes]]
        new = tree.child(rows, nodes, tokens) < 0
        tree.add(rows[new], nodes[new], tokens[new])


def test_beam_search_stops_drafting_what_never_pays_and_keeps_its_output():
    model = MarkovLM(VOCAB, 3)
    target = CallableTarget(model, VOCAB)
    prompts = [[5, 9, 2, 33, 7, 1, 5, 9, 2, 33], [4, 7, 11, 4, 7], [12, 30, 6, 12, 30]]
    kwargs = dict(max_new_tokens=24, eos_token_id=EOS, drafter=LeastLikelyDrafter(model))
    config = BeamConfig(num_beams=4, num_return_sequences=2)
    always = BeamConfig(num_beams=4, num_return_sequences=2, control=ControllerConfig(False))
    plain = beam_search(target, prompts, config=config, max_new_tokens=24, eos_token_id=EOS)
    gated = beam_search(target, prompts, config=config, **kwargs)
    fixed = beam_search(target, prompts, config=always, **kwargs)
    for out in (gated, fixed):
        assert out.tolist() == plain.tolist() and torch.equal(out.scores, plain.scores)
        assert out.stats.draft_hits == 0 and out.stats.target_forwards == 24
    assert fixed.stats.speculative_forwards == 24
    # drafted to measure, then closed, probing one pass in probe_every
    assert 2 <= gated.stats.speculative_forwards <= 3 + 24 // ControllerConfig.probe_every
    assert gated.stats.draft_nodes < fixed.stats.draft_nodes / 2

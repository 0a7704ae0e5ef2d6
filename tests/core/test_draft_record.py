"""The record that lets speculative beam search draft only where drafting paid in earlier
searches (core.draft_record)."""

import torch

from genrec_spec import CallableTarget
from genrec_spec.core.beam import BeamConfig, beam_search
from genrec_spec.core.catalogue_drafter import CatalogueDrafter
from genrec_spec.core.constraints import Catalogue
from genrec_spec.core.controller import ControllerConfig
from genrec_spec.core.draft_record import DraftRecord

VOCAB, EOS = 40, 3
PROMPTS = [[5, 9, 2, 33, 7, 1, 5, 9, 2, 33], [4, 7, 11, 4, 7], [12, 30, 6, 12, 30]]


def decisions(record: DraftRecord, searches: int, saved: int) -> list[bool]:
    """Whether each of `searches` searches drafts, each drafted search carrying drafts in 10
    passes of 5 nodes and 10 drafted nodes each, and saving `saved` steps."""
    out = []
    for _ in range(searches):
        out.append(record.drafts())
        if out[-1]:
            record.count([(5, 10)] * 10, saved)
    return out


def test_the_record_stops_drafting_what_saves_nothing_then_probes():
    drafted = decisions(DraftRecord(ControllerConfig(probe_every=4)), 24, saved=0)
    assert drafted[0]  # the prior lets the first search measure
    closed = drafted.index(False)
    assert closed <= 2
    # closed, one search in probe_every drafts (and closes it again: it saves nothing either)
    assert [i for i, d in enumerate(drafted[closed:]) if d] == [3, 7, 11, 15, 19][: sum(drafted)]


def test_the_record_keeps_drafting_while_the_steps_saved_pay():
    # 10 drafted nodes beside 5 cost 0.67 passes under the linear model (0.1 a node): 8 saved
    # steps in 10 drafted passes pay for them
    assert all(decisions(DraftRecord(), 20, saved=8))
    assert not all(decisions(DraftRecord(), 20, saved=5))


def test_a_measured_table_prices_the_drafted_nodes():
    # nearly free nodes (a flat table): 2 saved steps in 10 passes keep it drafting, where the
    # linear model's price stops it; adaptive=False drafts every search
    flat = ControllerConfig(pass_cost=(1.0,) * 16)
    assert all(decisions(DraftRecord(flat), 20, saved=2))
    assert not all(decisions(DraftRecord(), 20, saved=2))
    assert all(decisions(DraftRecord(ControllerConfig(adaptive=False)), 20, saved=0))


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


def test_searches_stop_drafting_what_never_pays_and_keep_their_output():
    model = MarkovLM(VOCAB, 3)
    target = CallableTarget(model, VOCAB)
    config = BeamConfig(num_beams=4, num_return_sequences=2)
    kwargs = dict(config=config, max_new_tokens=12, eos_token_id=EOS)
    plain = beam_search(target, PROMPTS, **kwargs)
    record, drafter = DraftRecord(ControllerConfig(probe_every=4)), LeastLikelyDrafter(model)
    runs = [
        beam_search(target, PROMPTS, drafter=drafter, record=record, **kwargs) for _ in range(9)
    ]
    for out in runs:
        assert out.tolist() == plain.tolist() and torch.equal(out.scores, plain.scores)
        assert out.stats.target_forwards == plain.stats.target_forwards
    drafted = [out.stats.draft_nodes > 0 for out in runs]
    # the first search drafts to measure, saves no step, and stops the next; then probes
    assert drafted == [True, False, False, False, True, False, False, False, True]
    # no search saved a step: what the record holds of them is its prior, decayed by each
    assert record.saved == ControllerConfig.prior_weight * ControllerConfig.smoothing**3
    assert record.speedup < 1


def test_searches_keep_drafting_forced_title_continuations(tiny):
    """A catalogue's forced continuations save steps in every search: the record keeps
    drafting them, and each search gives plain beam search's output in fewer passes."""
    lm = tiny.HashLM(VOCAB, seed=5, scale=1.5)
    target = CallableTarget(lm, VOCAB)
    g = torch.Generator().manual_seed(6)
    # long items with shared heads: a beam walks down a few forced tokens after each choice
    sequences = sorted(
        {(4 + i % 4, *torch.randint(4, VOCAB, (6,), generator=g).tolist()) for i in range(40)}
    )
    catalogue = Catalogue.of([list(s) for s in sequences], VOCAB, eos_token_id=EOS)
    config = BeamConfig(num_beams=3, num_return_sequences=3)
    kwargs = dict(config=config, max_new_tokens=8, eos_token_id=EOS, constraint=catalogue)
    plain = beam_search(target, PROMPTS, **kwargs)
    record, drafter = DraftRecord(), CatalogueDrafter(catalogue, depth=8, fanout=1)
    for _ in range(5):
        spec = beam_search(target, PROMPTS, drafter=drafter, record=record, **kwargs)
        assert spec.tolist() == plain.tolist() and torch.equal(spec.scores, plain.scores)
        assert spec.stats.draft_nodes > 0
        assert spec.stats.target_forwards < plain.stats.target_forwards
    assert record.speedup > ControllerConfig.min_speedup

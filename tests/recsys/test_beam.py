"""Trie-constrained beam search: equals a plain Python beam search over the model, exhaustive
scoring when the beam is as wide as the catalogue, valid distinct items, clear errors."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from genrec_spec.data_pipelines.trie import PrefixTrie
from genrec_spec.recsys import target
from genrec_spec.recsys.decoders import beam
from genrec_spec.recsys.decoders.spec_beam import same_top_k
from genrec_spec.recsys.item_trie import item_trie
from genrec_spec.recsys.scoring import score


@pytest.fixture
def model(tiny_model):
    """The tiny model with large random weights: peaked distributions, so rankings are not
    decided by float rounding between near-uniform log-probs."""
    model, _ = tiny_model
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return model


def _trie(model) -> PrefixTrie:
    return PrefixTrie.from_codes(model.item_codes, tuple(model.codebook_sizes))


def _histories(model, lengths: list[int], seed: int):
    g = torch.Generator().manual_seed(seed)
    values = torch.randint(0, model.num_items, (sum(lengths),), generator=g)
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    return values, offsets


def _python_beam(model, history: torch.Tensor, k: int, width: int) -> tuple[list, list]:
    """Beam search written plainly: every prefix scored as its own chain of code tokens,
    candidates sorted by (score desc, parent rank, code), invalid prefixes skipped."""
    codes = [tuple(c) for c in model.item_codes.tolist()]
    valid = {c[:n] for c in codes for n in range(1, len(c) + 1)}
    state = model.encode_history(history, torch.tensor([0, len(history)]))
    beams = [((), 0.0)]
    for level in range(model.num_levels):
        candidates = []
        for rank, (prefix, total) in enumerate(beams):
            if level == 0:
                log_probs = state.level0_log_probs[0]
            else:
                out = model.score_tree(
                    state,
                    torch.tensor([prefix]),
                    torch.arange(level)[None],
                    torch.arange(level)[None] - 1,
                )
                log_probs = out[0, -1]
            for code in range(model.codebook_sizes[level]):
                if prefix + (code,) in valid:
                    candidates.append((total + float(log_probs[code]), rank, code, prefix))
        candidates.sort(key=lambda c: (-c[0], c[1], c[2]))
        beams = [(prefix + (code,), total) for total, _, code, prefix in candidates[:width]]
    return [codes.index(p) for p, _ in beams[:k]], [t for _, t in beams[:k]]


@pytest.mark.parametrize(("k", "width"), [(1, 1), (3, 4), (5, 8)])
@pytest.mark.parametrize("engine", beam.ENGINES)
def test_beam_equals_a_python_beam_search(model, k, width, engine):
    values, offsets = _histories(model, [6, 0, 30], seed=k)  # empty and truncated rows
    trie = _trie(model)
    got = beam.decode(model, values, offsets, k=k, trie=trie, beam_width=width, engine=engine)
    items, scores = [], []
    for b in range(3):
        row_items, row_scores = _python_beam(model, values[offsets[b] : offsets[b + 1]], k, width)
        items.append(row_items)
        scores.append(row_scores)
    want = SimpleNamespace(items=torch.tensor(items), scores=torch.tensor(scores))
    assert same_top_k(want, got).all()
    assert got.stats.target_passes == model.num_levels
    assert got.stats.truncated_histories == 1


@pytest.mark.parametrize("engine", beam.ENGINES)
def test_catalogue_wide_beam_is_the_exhaustive_top_k(model, engine):
    """With a beam as wide as the catalogue nothing is pruned: the top-K by exact
    log-likelihood of every item."""
    values, offsets = _histories(model, [4, 9, 1, 12], seed=11)
    trie = _trie(model)
    got = beam.decode(model, values, offsets, k=8, trie=trie, beam_width=model.num_items,
                      engine=engine)  # fmt: skip
    every = score(model, values, offsets, torch.arange(model.num_items).expand(4, -1))
    top = every.topk(8, dim=1)
    assert same_top_k(SimpleNamespace(items=top.indices, scores=top.values), got).all()


@pytest.mark.parametrize(("k", "width"), [(1, None), (10, None), (40, 40), (7, 25)])
def test_items_are_valid_distinct_and_sorted(model, k, width):
    values, offsets = _histories(model, [3, 8, 0, 13, 5], seed=3)
    out = beam.decode(model, values, offsets, k=k, trie=_trie(model), beam_width=width)
    assert out.items.shape == out.scores.shape == (5, k)
    assert ((out.items >= 0) & (out.items < model.num_items)).all()
    for row in out.items.tolist():
        assert len(set(row)) == k
    assert (out.scores[:, 1:] <= out.scores[:, :-1]).all()
    assert (out.scores <= 0).all()


def test_bad_options_raise(model):
    values, offsets = _histories(model, [3, 2], seed=5)
    trie = _trie(model)
    with pytest.raises(beam.DecodeOptionError, match="beam_width 3 must be >= k = 5"):
        beam.decode(model, values, offsets, k=5, trie=trie, beam_width=3)
    with pytest.raises(beam.DecodeOptionError, match="larger than the catalogue"):
        beam.decode(model, values, offsets, k=model.num_items + 1, trie=trie)
    with pytest.raises(beam.DecodeOptionError, match="k must be >= 1"):
        beam.decode(model, values, offsets, k=0, trie=trie)
    other = PrefixTrie.from_codes(model.item_codes[:-1], tuple(model.codebook_sizes))
    with pytest.raises(beam.DecodeOptionError, match="does not match the model"):
        beam.decode(model, values, offsets, k=2, trie=other)


def _dense_extend(beams: beam.Beams, log_probs, trie, level: int, width: int):
    """The beam step over the full [W, V] grid: mask codes that lead to no item, stable sort."""
    batch, beams_in = beams.nodes.shape
    vocab = trie.codebook_sizes[level]
    allowed = trie.allowed_mask(beams.nodes.flatten(), level).view(batch, beams_in, vocab)
    candidates = beams.scores[:, :, None] + log_probs[:, :, :vocab]
    candidates = candidates.masked_fill(~allowed, float("-inf")).flatten(1)
    ranked = torch.sort(candidates, dim=1, descending=True, stable=True)
    scores, flat = ranked.values[:, :width], ranked.indices[:, :width]
    nodes = trie.child(beams.nodes.gather(1, flat // vocab).flatten(), (flat % vocab).flatten())
    return scores, torch.where(torch.isfinite(scores), nodes.view(scores.shape), -1), flat // vocab


@pytest.mark.parametrize("width", [1, 3, 7, 500])
def test_extend_equals_the_dense_grid_step(model, width):
    """Candidates read from the trie's child lists give the dense masked grid's beams: same
    scores, nodes and parents, ties included (log-probs rounded to create many), empty beams
    and beams wider than the candidates."""
    trie = _trie(model)
    g = torch.Generator().manual_seed(width)
    beams = beam.start_beams(3, trie)
    for level in range(model.num_levels):
        vmax = max(model.codebook_sizes)
        log_probs = (torch.rand(3, beams.nodes.shape[1], vmax, generator=g) * 4).round().neg()
        want_scores, want_nodes, want_origin = _dense_extend(beams, log_probs, trie, level, width)
        beams = beam.extend(beams, log_probs, trie, level, width)
        assert torch.equal(beams.scores, want_scores)
        assert torch.equal(beams.nodes, want_nodes)
        real = beams.nodes >= 0
        assert torch.equal(beams.origin[real], want_origin[real])
        assert torch.equal(beams.code[real], trie.child_codes[beams.nodes[real] - 1])


def test_extend_reads_no_code_past_the_levels_codebook():
    """More beams than prefixes leaves empty ones, whose child slots lie at the root's (level 0's
    codes); a level's log-probs may be exactly as wide as its own codebook (`search` builds
    them so where no beam has a choice), which those codes must not index."""
    trie = PrefixTrie.from_codes(torch.tensor([[1, 0], [2, 0], [4, 0]]), (5, 1))
    level0 = torch.tensor([[[-9.0, -1.0, -2.0, -9.0, -3.0]]]).repeat(2, 1, 1)  # [B, 1, 5]
    beams = beam.extend(beam.start_beams(2, trie), level0, trie, 0, 6)
    assert beams.nodes.shape == (2, 5) and (beams.nodes[:, 3:] == -1).all()
    beams = beam.extend(beams, torch.zeros(2, 5, 1), trie, 1, 6)  # forced: log-prob 0
    assert beams.scores[0, :3].tolist() == [-1.0, -2.0, -3.0]
    assert trie.leaf_items[beams.nodes[:, :3] - trie.level_starts[-2]].tolist() == [[0, 1, 2]] * 2
    assert (beams.nodes[:, 3:] == -1).all()


def test_item_trie_is_built_once_per_code_table(model):
    trie = item_trie(model)
    assert item_trie(model) is trie  # reused: per-request callers do not rebuild it
    assert torch.equal(trie.leaf_items, _trie(model).leaf_items)
    assert torch.equal(trie.child_codes, _trie(model).child_codes)
    # A rewritten code table (load_state_dict copies in place) gets a trie of its new codes.
    swapped = model.item_codes[[1, 0, *range(2, model.num_items)]].clone()
    with torch.no_grad():
        model.item_codes.copy_(swapped)
    rebuilt = item_trie(model)
    assert rebuilt is not trie
    assert torch.equal(rebuilt.leaf_items, _trie(model).leaf_items)
    assert not torch.equal(rebuilt.leaf_items, trie.leaf_items)


@pytest.mark.parametrize("width", [3, 8])
def test_prefixes_no_beam_extends_are_left_out(model, monkeypatch, width):
    """The pruned tree keeps exactly the current beams' ancestors (parents before children, the
    current beams last); decoding with it gives the lists of the whole tree and the same scores
    up to rounding, from fewer nodes."""
    values, offsets = _histories(model, [5, 2, 7], seed=3)
    trie = _trie(model)
    state = model.encode_history(values, offsets)
    monkeypatch.setattr(target, "PRUNE_SHARE", 0.0)  # leave out whatever no beam extends
    history, _, _ = beam.search(model, state, trie, width)
    codes, levels, parents, _, _ = target.beam_tree(
        [b.code for b in history], [b.origin for b in history], history[-1].nodes >= 0
    )
    current = history[-1].nodes.shape[1]
    for row in range(len(offsets) - 1):
        kept = set(range(codes.shape[1] - current, codes.shape[1]))  # the current beams
        for node in list(kept):
            while parents[row, node] >= 0:
                assert parents[row, node] < node
                node = int(parents[row, node])
                kept.add(node)
        others = set(range(codes.shape[1])) - kept  # padding only: level 0, code 0, no parent
        assert all(parents[row, i] < 0 and levels[row, i] == codes[row, i] == 0 for i in others)
    pruned = beam.decode(model, values, offsets, k=3, trie=trie, beam_width=width)
    monkeypatch.setattr(target, "PRUNE_SHARE", 1.0)  # never
    whole = beam.decode(model, values, offsets, k=3, trie=trie, beam_width=width)
    assert torch.equal(pruned.items, whole.items)
    torch.testing.assert_close(pruned.scores, whole.scores)
    assert pruned.stats.nodes_scored < whole.stats.nodes_scored


def test_the_tree_of_some_beams_holds_them_and_their_ancestors(model):
    """`beam_tree` with some current beams scored (the others' codes are forced): those beams
    last, in order, over their ancestors, at the first level (no context) and deeper."""
    values, offsets = _histories(model, [5, 2, 7], seed=3)
    trie = _trie(model)
    history, _, _ = beam.search(model, model.encode_history(values, offsets), trie, 4)
    for depth in (1, len(history)):
        current = history[depth - 1]
        scored = (current.nodes >= 0) & (torch.arange(4) % 2 == 1)  # beams 1 and 3
        codes, levels, parents, picked, real = target.beam_tree(
            [b.code for b in history[:depth]], [b.origin for b in history[:depth]], scored
        )
        assert torch.equal(picked[real], scored.nonzero()[:, 1])
        last = codes[:, -picked.shape[1] :]
        assert torch.equal(last[real], current.code[scored])
        assert bool((levels[:, -picked.shape[1] :][real] == depth - 1).all())
        assert bool((parents[:, -picked.shape[1] :][real] >= 0).all()) == (depth > 1)


def test_decoders_run_in_inference_mode_and_return_ordinary_tensors(model, monkeypatch):
    modes = []
    encode = model.encode_history

    def recording(*args, **kwargs):
        modes.append(torch.is_inference_mode_enabled())
        return encode(*args, **kwargs)

    monkeypatch.setattr(model, "encode_history", recording)
    values, offsets = _histories(model, [3, 5], seed=1)
    out = beam.decode(model, values, offsets, k=3, trie=item_trie(model), beam_width=4)
    assert modes == [True]  # no autograd bookkeeping in the decode
    # What it returns, and the trie it cached, can be changed in place and used in autograd.
    assert not out.items.is_inference() and not out.scores.is_inference()
    assert not item_trie(model).leaf_items.is_inference()
    out.scores.clamp_(min=-1e9)
    weights = torch.ones(out.scores.shape, requires_grad=True)
    (weights * out.scores).sum().backward()
    assert torch.equal(weights.grad, out.scores)

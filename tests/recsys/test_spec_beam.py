"""Speculative beam search returns beam search's top-K exactly: random models with 2 and 3 code
levels (+ collision) over many users, K and beam widths, with drafts that hit and drafts that
miss (follow-up passes); then a model trained on real ML-100K."""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from genrec_spec.data_pipelines.trie import PrefixTrie
from genrec_spec.models.recsys.config import (
    DraftHeadConfig,
    ItemObjectiveConfig,
    RecommenderConfig,
    TiedLevelsConfig,
)
from genrec_spec.models.recsys.recommender import SemanticIdRecommender
from genrec_spec.recsys.decoders import beam, spec_beam
from genrec_spec.recsys.decoders.beam import DecodeOptionError
from genrec_spec.recsys.decoders.spec_beam import same_top_k
from genrec_spec.recsys.scoring import NodeSet
from genrec_spec.recsys.spec_levels import children_of


def _random_model(
    build, seed: int, sizes: tuple[int, ...], items: int, item_levels: str = "none"
) -> SemanticIdRecommender:
    """`build` (the random_recommender fixture) on a small config whose code levels are tied
    to the item objective as `item_levels` says ("hstu": as "residual", on HSTU blocks)."""
    return build(_config(item_levels), seed, sizes, items)


def _config(item_levels: str) -> RecommenderConfig:
    if item_levels == "hstu":
        return replace(_config("residual"), block="hstu")
    return RecommenderConfig(
        dim=16,
        layers=2,
        heads=2,
        dropout=0.0,
        max_len=10,
        long_id_heads=None,
        draft_head=DraftHeadConfig(hidden=8),
        item_objective=ItemObjectiveConfig(
            level0=item_levels != "none",  # "level0": level 0 from the item objective
            # "all", "cosine", "residual": every level tied to it; "residual": the history
            # state's query, corrected
            tied_levels=(
                TiedLevelsConfig(residual=item_levels == "residual")
                if item_levels in ("all", "cosine", "residual")
                else None
            ),
            temperature=0.05 if item_levels in ("cosine", "residual") else 0.0,  # cosine logits
        ),
    )


MODELS = [(0, (5, 4), 60), (1, (4, 3, 3), 90), (2, (6, 5, 4), 150)]  # seed, sizes, items
# (draft, lookahead) -> sequential passes for L = 3 and L = 4 code levels (collision included)
PASSES = {
    ("frontier", 1): {3: 2, 4: 2},
    ("frontier", 0): {3: 2, 4: 3},
    ("frontier", 2): {3: 2, 4: 2},
    ("none", 1): {3: 2, 4: 3},
    ("none", 0): {3: 3, 4: 4},
    ("none", 2): {3: 2, 4: 2},  # the first follow-up scores all the decode can need
}


@pytest.mark.parametrize(("seed", "sizes", "items"), MODELS)
@pytest.mark.parametrize("item_levels", ["none", "level0", "all", "cosine", "residual", "hstu"])
@pytest.mark.parametrize("engine", beam.ENGINES)
def test_spec_beam_equals_beam(
    seed, sizes, items, item_levels, engine, random_recommender, uneven_histories
):
    """On either engine: the core's beam search, with the drafts as its drafter, takes the same
    sequential passes."""
    model = _random_model(random_recommender, seed, sizes, items, item_levels)
    trie = PrefixTrie.from_codes(model.item_codes, tuple(model.codebook_sizes))
    values, offsets = uneven_histories(model, users=12, seed=seed)
    levels = model.num_levels
    for k, width in [(1, 1), (5, 10), (30, 45)]:
        want = beam.decode(
            model, values, offsets, k=k, trie=trie, beam_width=width, engine="native"
        )
        for (draft, lookahead), passes in PASSES.items():
            got = spec_beam.decode(
                model,
                values,
                offsets,
                k=k,
                trie=trie,
                beam_width=width,
                draft=draft,
                lookahead=lookahead,
                engine=engine,
                plain_from="never",  # speculative in every step (12 users x 45 beams)
            )
            assert same_top_k(want, got).all(), (k, width, draft, lookahead)
            assert got.stats.target_passes == passes[levels]
            assert got.stats.truncated_histories == want.stats.truncated_histories


@pytest.mark.parametrize(("seed", "sizes", "items"), MODELS)
@pytest.mark.parametrize(
    ("draft", "item_levels"), [("nezha", "none"), ("items", "residual"), ("heads", "none")]
)
@pytest.mark.parametrize("engine", beam.ENGINES)
def test_post_history_draft_equals_beam(
    seed, sizes, items, draft, item_levels, engine, random_recommender, uneven_histories
):
    """A draft made after the history pass (the NEZHA head's beam, the item objective's or the
    parallel heads' mass)
    only decides what is scored early: the list stays beam's whether the draft holds every needed
    prefix (wide) or few (width 1: follow-ups), and every needed prefix is scored by the last
    level's pass at the latest, on either engine."""
    model = _random_model(random_recommender, seed, sizes, items, item_levels)
    trie = PrefixTrie.from_codes(model.item_codes, tuple(model.codebook_sizes))
    values, offsets = uneven_histories(model, users=12, seed=seed)
    for k, width in [(1, 1), (5, 10), (30, 45)]:
        want = beam.decode(
            model, values, offsets, k=k, trie=trie, beam_width=width, engine="native"
        )
        for draft_width, lookahead in itertools.product((1, 3, None, 200), (0, 1)):
            # (plain_from: speculative in every step, 12 users x 45 beams)
            asked = dict(k=k, trie=trie, beam_width=width, draft=draft, draft_width=draft_width,
                         lookahead=lookahead, plain_from="never")  # fmt: skip
            got = spec_beam.decode(model, values, offsets, engine=engine, **asked)
            assert same_top_k(want, got).all(), (k, width, draft_width, lookahead)
            assert 2 <= got.stats.target_passes <= model.num_levels
            assert got.stats.draft_nodes > 0
            assert 0.0 < got.stats.draft_hit_rate <= 1.0
            if engine == "core":  # the same drafts, scored in the same passes
                native = spec_beam.decode(model, values, offsets, engine="native", **asked).stats
                for name in ("target_passes", "nodes_scored", "draft_nodes", "draft_hit_rate"):
                    assert getattr(got.stats, name) == getattr(native, name), name


@pytest.mark.parametrize("width", [4, 8])
@pytest.mark.parametrize("engine", beam.ENGINES)
def test_a_first_level_that_names_every_item(width, engine, random_recommender, uneven_histories):
    """One code level whose codes name every item (the collision level holds one code): on a
    model whose forced codes are free no prefix needs a score past the history pass, and every
    draft (the exact ones have no deeper prefix to weigh) gives beam's lists in that pass, with
    more beams than items (8 > 5) too."""
    model = _random_model(random_recommender, 0, (6,), 5, "residual")
    assert model.num_levels == 2 and model.codebook_sizes[-1] == 1 and model.forced_codes_free
    trie = PrefixTrie.from_codes(model.item_codes, tuple(model.codebook_sizes))
    values, offsets = uneven_histories(model, users=4, seed=0)
    want = beam.decode(model, values, offsets, k=3, trie=trie, beam_width=width, engine="native")
    assert bool((want.items >= 0).all())
    core = beam.decode(model, values, offsets, k=3, trie=trie, beam_width=width, engine="core")
    assert same_top_k(want, core).all()
    for draft in ("items", "heads", "nezha", "frontier", "none"):
        got = spec_beam.decode(model, values, offsets, k=3, trie=trie, beam_width=width,
                               draft=draft, engine=engine, plain_from="never")  # fmt: skip
        assert same_top_k(want, got).all(), draft
        assert got.stats.target_passes == 1


def test_forced_codes_cost_nothing(monkeypatch, random_recommender, uneven_histories):
    """Levels normalised over a prefix's children (tied levels) give a prefix's only child
    log-prob exactly 0: beam scores only the beams with a choice (skipping a level where none
    has one) and returns what scoring every beam returns, from fewer nodes (the same scores up
    to the rounding of another tree layout); spec_beam, which never scores such prefixes,
    returns the same with every draft."""
    # 512 IDs, 60 items: few collisions
    model = _random_model(random_recommender, 6, (8, 8, 8), 60, "residual")
    assert model.forced_codes_free
    trie = PrefixTrie.from_codes(model.item_codes, tuple(model.codebook_sizes))
    values, offsets = uneven_histories(model, users=12, seed=6)
    settings = [(1, 1), (5, 8), (10, 30)]  # k, beam width
    fast = [beam.decode(model, values, offsets, k=k, trie=trie, beam_width=w) for k, w in settings]
    one_user = [  # each user alone at width 1: its collision code is nearly always forced
        beam.decode(
            model,
            values[offsets[u] : offsets[u + 1]],
            torch.stack([offsets[0], offsets[u + 1] - offsets[u]]),
            k=1,
            trie=trie,
            beam_width=1,
        )
        for u in range(12)
    ]
    with monkeypatch.context() as patched:
        patched.setattr(SemanticIdRecommender, "forced_codes_free", property(lambda _: False))
        full = [
            beam.decode(model, values, offsets, k=k, trie=trie, beam_width=w) for k, w in settings
        ]
    for got, want in zip(fast, full, strict=True):
        assert torch.equal(got.items, want.items)
        torch.testing.assert_close(got.scores, want.scores, rtol=0, atol=1e-5)
        assert got.stats.nodes_scored < want.stats.nodes_scored
        assert want.stats.target_passes == model.num_levels
    assert min(out.stats.target_passes for out in one_user) < model.num_levels  # a level skipped
    for (k, width), want in zip(settings, fast, strict=True):
        for draft, engine in itertools.product(
            ("frontier", "none", "nezha", "items", "heads"), beam.ENGINES
        ):
            got = spec_beam.decode(model, values, offsets, k=k, trie=trie, beam_width=width,
                                   draft=draft, lookahead=0, engine=engine,
                                   plain_from="never")  # fmt: skip
            assert same_top_k(want, got).all(), (k, width, draft, engine)


@pytest.mark.parametrize("drafted", [1, 3, "all"])
@pytest.mark.parametrize("engine", beam.ENGINES)
def test_item_drafts_that_hit_and_miss(drafted, engine, random_recommender, uneven_histories):
    """Drafting every item's prefixes needs no follow-up (one pass, every needed prefix
    drafted); a few random items leave most prefixes to the follow-up passes."""
    model = _random_model(random_recommender, 3, (5, 4, 3), 80)
    trie = PrefixTrie.from_codes(model.item_codes, tuple(model.codebook_sizes))
    values, offsets = uneven_histories(model, users=9, seed=4)
    count = model.num_items if drafted == "all" else drafted
    g = torch.Generator().manual_seed(5)
    items = torch.stack([torch.randperm(model.num_items, generator=g)[:count] for _ in range(9)])
    want = beam.decode(model, values, offsets, k=10, trie=trie, beam_width=15, engine="native")
    got = spec_beam.decode(model, values, offsets, k=10, trie=trie, beam_width=15, draft="none",
                           draft_items=items, engine=engine)  # fmt: skip
    assert same_top_k(want, got).all()
    if drafted == "all":
        assert got.stats.target_passes == 1
        assert got.stats.draft_hit_rate == 1.0
    else:
        assert 1 < got.stats.target_passes <= model.num_levels
        assert 0.0 <= got.stats.draft_hit_rate < 1.0


def test_core_drafts_under_inference_mode(random_recommender, uneven_histories):
    """The core engine's first decode of a model inside ``torch.inference_mode`` (its target,
    catalogue and the drafter's tables all made there, as a service's would be) equals `beam`'s,
    given items drafted with the after-history draft (nodes found in the tree by state)."""
    model = _random_model(random_recommender, 3, (5, 4, 3), 80)
    trie = PrefixTrie.from_codes(model.item_codes, tuple(model.codebook_sizes))
    values, offsets = uneven_histories(model, users=6, seed=7)
    want = beam.decode(model, values, offsets, k=10, trie=trie, beam_width=12, engine="native")
    given = torch.cat([want.items[:, :3], want.items[:, :3].flip(0)], 1)  # hits and misses
    with torch.inference_mode():
        for draft in ("items", "heads", "nezha"):
            got = spec_beam.decode(model, values, offsets, k=10, trie=trie, beam_width=12,
                                   draft=draft, draft_items=given, engine="core")  # fmt: skip
            assert same_top_k(want, got).all(), draft


@pytest.mark.parametrize("seed", [1, 2, 14, 23, 57, 91])
def test_random_catalogues_and_options(seed, random_recommender, uneven_histories):
    """Catalogues, models and options drawn at random (1-3 code levels of 2-9 codes, up to
    three items a code tuple, beams from 1 to more than the catalogue's items): `beam` on both
    engines and every draft of `spec_beam` on both engines give `beam`'s lists. Among the seeds,
    one-level catalogues whose level 0 skips code 0 with more beams than items (`extend`), and a
    frontier draft whose forced nodes' candidates were stored last (the core's candidate
    store), each wrong before its fix."""
    r = random.Random(seed)
    sizes = tuple(r.randint(2, 9) for _ in range(r.randint(1, 3)))
    items = r.randint(2, max(3, min(300, math.prod(sizes) * r.choice([1, 2, 3]))))
    item_levels = r.choice(["none", "level0", "all", "cosine", "residual"])
    model = _random_model(random_recommender, seed, sizes, items, item_levels)
    trie = PrefixTrie.from_codes(model.item_codes, tuple(model.codebook_sizes))
    values, offsets = uneven_histories(model, users=r.randint(1, 6), seed=seed)
    width = r.choice([1, 2, 3, 5, 8, 13, 20, 40, 64])
    k = min(r.randint(1, width), model.num_items)
    asked = dict(k=k, trie=trie, beam_width=width)
    want = beam.decode(model, values, offsets, engine="native", **asked)
    assert same_top_k(want, beam.decode(model, values, offsets, engine="core", **asked)).all()
    for draft, engine in itertools.product(
        ("frontier", "none", "nezha", "items", "heads"), beam.ENGINES
    ):
        options = dict(lookahead=r.choice([None, 0, 1, 2]), draft_width=r.choice([None, 1, 7]))
        options |= dict(draft=draft, engine=engine, plain_from="never")
        got = spec_beam.decode(model, values, offsets, **asked, **options)
        assert same_top_k(want, got).all(), options


def test_same_top_k_rejects_different_lists():
    items = torch.tensor([[3, 1, 2], [5, 6, 7]])
    scores = torch.tensor([[-1.0, -2.0, -2.00001], [-0.5, -1.0, -3.0]])
    ref = SimpleNamespace(items=items, scores=scores)
    swapped_tie = SimpleNamespace(items=torch.tensor([[3, 2, 1], [5, 6, 7]]), scores=scores)
    assert same_top_k(ref, swapped_tie).tolist() == [True, True]  # a near-exact tie
    swapped = SimpleNamespace(items=torch.tensor([[1, 3, 2], [5, 8, 7]]), scores=scores)
    assert same_top_k(ref, swapped).tolist() == [False, False]
    # Ties at the boundary: item 9 scores as the reference's last, which of them is listed is
    # rounding (row 0); an item the reference left out at a slot above the last is not (row 1).
    boundary = SimpleNamespace(items=torch.tensor([[3, 1, 9], [5, 9, 7]]), scores=scores)
    assert same_top_k(ref, boundary).tolist() == [True, False]
    shifted = SimpleNamespace(items=items, scores=scores - torch.tensor([[0.0], [0.01]]))
    assert same_top_k(ref, shifted).tolist() == [True, False]


def test_bad_options_raise(random_recommender, uneven_histories):
    model = _random_model(random_recommender, 0, (5, 4), 60)
    trie = PrefixTrie.from_codes(model.item_codes, tuple(model.codebook_sizes))
    values, offsets = uneven_histories(model, users=2, seed=0)
    with pytest.raises(DecodeOptionError, match="valid drafts: auto, frontier, items, heads, nez"):
        spec_beam.decode(model, values, offsets, k=3, trie=trie, draft="best")
    config = replace(model.config, item_objective=None)
    no_items = SemanticIdRecommender(config, model.item_codes, model.codebook_sizes).eval()
    with pytest.raises(DecodeOptionError, match="the items draft needs a model trained with"):
        spec_beam.decode(no_items, values, offsets, k=3, trie=trie, draft="items")
    # "auto": the item objective's draft where the model has one, else the first code level
    assert spec_beam.resolve_draft(model, "auto") == "items"
    assert spec_beam.resolve_draft(no_items, "auto") == "frontier"
    with pytest.raises(ValueError, match="candidate item indices must lie in"):
        bad = torch.tensor([[0], [model.num_items]])
        spec_beam.decode(model, values, offsets, k=3, trie=trie, draft_items=bad)
    with pytest.raises(DecodeOptionError, match="beam_width 2 must be >= k = 3"):
        spec_beam.decode(model, values, offsets, k=3, trie=trie, beam_width=2)
    with pytest.raises(DecodeOptionError, match="draft_width must be >= 1"):
        spec_beam.decode(model, values, offsets, k=3, trie=trie, draft="nezha", draft_width=0)
    model.draft_head = None
    with pytest.raises(DecodeOptionError, match="need the model's draft head"):
        spec_beam.decode(model, values, offsets, k=3, trie=trie, draft="nezha")
    model.parallel_heads = None
    with pytest.raises(DecodeOptionError, match="the heads draft needs the model's parallel"):
        spec_beam.decode(model, values, offsets, k=3, trie=trie, draft="heads")
    for bad in (-1, 1.5, "2"):
        with pytest.raises(DecodeOptionError, match="lookahead must be an integer >= 0"):
            spec_beam.decode(model, values, offsets, k=3, trie=trie, lookahead=bad)
    for bad in (0, True, 2.5, "sometimes"):
        with pytest.raises(DecodeOptionError, match='plain_from must be "auto", "never" or a'):
            spec_beam.decode(model, values, offsets, k=3, trie=trie, plain_from=bad)


@pytest.mark.parametrize("engine", beam.ENGINES)
def test_wide_steps_decode_as_beam(engine, random_recommender, uneven_histories):
    """From `plain_from` beams a step (batch x width) the decode is `beam`'s, passes and all (no
    draft); below it, speculative. "auto" is PLAIN_FROM_CPU beams on a CPU."""
    model = _random_model(random_recommender, 3, (5, 4, 3), 80)
    trie = PrefixTrie.from_codes(model.item_codes, tuple(model.codebook_sizes))
    values, offsets = uneven_histories(model, users=6, seed=2)  # 6 rows x 10 beams: 60
    want = beam.decode(model, values, offsets, k=5, trie=trie, beam_width=10, engine=engine)
    for plain_from, plain in ((60, True), (61, False), ("never", False), ("auto", False)):
        got = spec_beam.decode(model, values, offsets, k=5, trie=trie, beam_width=10,
                               draft="frontier", engine=engine, plain_from=plain_from)  # fmt: skip
        assert same_top_k(want, got).all()
        assert (got.stats.draft_nodes is None) == plain, plain_from
        assert (got.stats.target_passes == want.stats.target_passes) == plain, plain_from
    assert spec_beam.runs_plain("auto", spec_beam.PLAIN_FROM_CPU, torch.device("cpu"))
    assert not spec_beam.runs_plain("auto", spec_beam.PLAIN_FROM_CPU - 1, torch.device("cpu"))
    assert not spec_beam.runs_plain("auto", 10**6, torch.device("cuda"))  # no device needed


@pytest.fixture(scope="session")
def ml100k_model(ml100k_dir, tmp_path_factory):
    """A short training run on real ML-100K: a model with real, peaked and uneven
    code distributions."""
    from genrec_spec.recsys.checkpoint import load_checkpoint
    from genrec_spec.recsys.train_config import TrainConfig
    from genrec_spec.recsys.trainer import train

    out = tmp_path_factory.mktemp("spec_beam") / "ckpt"
    model_config = RecommenderConfig(dim=32, layers=2, heads=2, max_len=50, dropout=0.1)
    train_config = TrainConfig(
        epochs=2,
        max_minutes=0,  # no time budget: the same model on a loaded machine
        batch_size=32,
        lr=3e-3,
        warmup_steps=20,
        branches_per_row=8,
        valid_users=50,
        progress=False,
    )
    train(ml100k_dir, out, model_config, train_config)
    model, _ = load_checkpoint(out)
    return model


@pytest.mark.slow
def test_spec_beam_equals_beam_on_trained_ml100k(ml100k_model, ml100k_dir):
    from genrec_spec.recsys.data import load_prepared

    model = ml100k_model
    test = load_prepared(ml100k_dir).test
    trie = PrefixTrie.from_codes(model.item_codes, tuple(model.codebook_sizes))
    users = torch.arange(200)
    for k, width, draft in [(10, 20, "frontier"), (30, 30, "none")]:
        for rows in users.split(100):
            part = test.select(rows)
            want = beam.decode(model, part.values, part.offsets, k=k, trie=trie,
                               beam_width=width, engine="native")  # fmt: skip
            for engine in beam.ENGINES:
                got = spec_beam.decode(model, part.values, part.offsets, k=k, trie=trie,
                                       beam_width=width, draft=draft, engine=engine,
                                       plain_from="never")  # fmt: skip
                assert same_top_k(want, got).all()
                assert got.stats.target_passes < want.stats.target_passes


@pytest.mark.slow
def test_core_beam_search_equals_beam_on_trained_ml100k(ml100k_model, ml100k_dir):
    """The recommender on the core (`recsys.target`): the core's beam search, plain and with the
    catalogue drafter, returns `beam`'s lists and scores on real ML-100K users."""
    from genrec_spec import BeamConfig, beam_search
    from genrec_spec.core.catalogue_drafter import CatalogueDrafter
    from genrec_spec.recsys.data import load_prepared
    from genrec_spec.recsys.target import RecommenderTarget

    model = ml100k_model
    part = load_prepared(ml100k_dir).test.select(torch.arange(100))
    trie = PrefixTrie.from_codes(model.item_codes, tuple(model.codebook_sizes))
    want = beam.decode(model, part.values, part.offsets, k=10, trie=trie, beam_width=20,
                       engine="native")  # fmt: skip
    target = RecommenderTarget(model)
    catalogue = target.catalogue()
    tokens, lengths = target.prompts(part.values, part.offsets)
    for drafter in (None, CatalogueDrafter(catalogue)):
        out = beam_search(
            target,
            tokens,
            prompt_lengths=lengths,
            config=BeamConfig(num_beams=20, num_return_sequences=10, length_penalty=0.0),
            max_new_tokens=model.num_levels,
            constraint=catalogue,
            drafter=drafter,
        )
        items = catalogue.items_of(out.values, out.offsets).view(out.scores.shape)
        assert torch.equal(items, want.items)
        # The same log-probs summed alike, from trees laid out otherwise: rounding apart.
        torch.testing.assert_close(out.scores, want.scores, rtol=0, atol=1e-5)
    # Batch 1: a level where no beam has a choice costs no pass, on the core as in beam. Whether
    # some level of some user has none depends on the trie; one beam (W = 1) meets one at the
    # collision level unless its item collides.
    passes = []
    for user, width in itertools.product(range(8), (1, 20)):
        one = part.select(torch.tensor([user]))
        native = beam.decode(model, one.values, one.offsets, k=1, trie=trie, beam_width=width,
                             engine="native")  # fmt: skip
        core = beam.decode(model, one.values, one.offsets, k=1, trie=trie, beam_width=width)
        assert torch.equal(core.items, native.items)
        passes.append((native.stats.target_passes, core.stats.target_passes))
    assert all(a == b for a, b in passes) and min(a for a, _ in passes) < model.num_levels


def test_children_of_marks_exactly_each_members_children():
    """Against the trie read node by node: every child of a member, nothing else, per row (the
    members' children past the scorable levels are not marked)."""
    g = torch.Generator().manual_seed(0)
    codes = torch.stack([torch.randint(0, v, (60,), generator=g) for v in (4, 5, 6)], 1)
    codes = torch.unique(codes, dim=0)
    trie = PrefixTrie.from_codes(codes, (4, 5, 6))
    scorable = trie.level_starts[-2]  # nodes above the last level
    rows, nodes = (torch.rand(3, scorable, generator=g) < 0.3).nonzero(as_tuple=True)
    offsets = trie.child_offsets.tolist()
    expected = set()
    for row, node in zip(rows.tolist(), nodes.tolist(), strict=True):
        for child in range(offsets[node] + 1, offsets[node + 1] + 1):
            if child < scorable:
                expected.add((row, child))
    found = children_of(trie, NodeSet.of(rows, nodes, scorable))
    assert set(zip(found.rows.tolist(), found.nodes.tolist(), strict=True)) == expected
    assert bool((found.keys[1:] > found.keys[:-1]).all())  # sorted and distinct

"""Beam search in the core: equal to transformers' beam search (plain and catalogue-constrained,
through HFTarget and the native Llama), equal to brute force where the beam is exhaustive, never
outside the catalogue, and speculative beam search equal to plain beam search in fewer passes."""

import random
from dataclasses import replace

import pytest
import torch

from genrec_spec import CallableTarget, HFTarget, generate
from genrec_spec.core.beam import BeamConfig, _distinct, beam_search
from genrec_spec.core.beam_tree import BeamTree, rank_within_rows
from genrec_spec.core.catalogue_drafter import CatalogueDrafter
from genrec_spec.core.constraints import AllowedTokens, Catalogue
from genrec_spec.core.prompt_lookup import PromptLookupDrafter, continuation_starts
from genrec_spec.core.types import DecodeInputError
from genrec_spec.models.llm.llama import Llama

VOCAB, EOS = 40, 3
PROMPTS = [[5, 9, 2, 33, 7, 1], [4, 7], [12, 30, 3, 20, 22]]  # B = 3, uneven


def random_catalogue(items: int, seed: int) -> list[list[int]]:
    """Distinct random sequences of 1-5 tokens (no eos inside), sharing prefixes."""
    g = torch.Generator().manual_seed(seed)
    out: set[tuple[int, ...]] = set()
    while len(out) < items:
        length = int(torch.randint(1, 6, (1,), generator=g))
        head = int(torch.randint(4, 8, (1,), generator=g))  # few first tokens: shared prefixes
        tail = torch.randint(4, VOCAB, (length - 1,), generator=g).tolist()
        out.add((head, *tail))
    return [list(s) for s in sorted(out)]


@pytest.fixture(scope="module")
def hf_model(tiny):
    return tiny.hf_llama(VOCAB, seed=0, scale=2.5)  # peaked: no near-ties between beams


@pytest.fixture(scope="module")
def native_model(hf_model, tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf_llama")
    hf_model.save_pretrained(folder)
    return Llama.from_hf(folder)


def hf_beam(model, prompts, config: BeamConfig, max_new_tokens, allowed_fn=None, eos=EOS):
    """transformers' generate on left-padded prompts: per row, K (tokens, score)."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = model.generate(
        ids,
        attention_mask=mask,
        num_beams=config.num_beams,
        num_return_sequences=config.num_return_sequences,
        length_penalty=config.length_penalty,
        early_stopping=config.early_stopping,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos,
        pad_token_id=EOS,
        do_sample=False,
        prefix_allowed_tokens_fn=None if allowed_fn is None else allowed_fn(width),
        return_dict_in_generate=True,
        output_scores=True,
    )
    k = config.num_return_sequences
    rows = out.sequences[:, width:].tolist()
    scores = out.sequences_scores.view(len(prompts), k)
    return [rows[b * k : (b + 1) * k] for b in range(len(prompts))], scores


def assert_same_as_hf(ours, theirs):
    hf_rows, hf_scores = theirs
    for mine, hf in zip(ours.tolist(), hf_rows, strict=True):
        for seq, ref in zip(mine, hf, strict=True):
            assert ref[: len(seq)] == seq and all(t == EOS for t in ref[len(seq) :])
    assert torch.allclose(ours.scores, hf_scores, atol=1e-4)


def trie_allowed_fn(sequences):
    """A prefix_allowed_tokens_fn over the catalogue (each sequence + EOS), for generate."""
    allowed: dict[tuple[int, ...], set[int]] = {}
    for seq in sequences:
        full = [*seq, EOS]
        for i in range(len(full)):
            allowed.setdefault(tuple(full[:i]), set()).add(full[i])

    def make(width):
        def fn(batch_id, input_ids):
            return sorted(allowed.get(tuple(input_ids[width:].tolist()), {EOS}))

        return fn

    return make


SETTINGS = [
    BeamConfig(num_beams=4, num_return_sequences=3),
    BeamConfig(num_beams=5, num_return_sequences=5, length_penalty=0.0, early_stopping="never"),
    BeamConfig(num_beams=3, num_return_sequences=2, length_penalty=2.0, early_stopping=True),
]


@pytest.mark.parametrize("target", ["hf", "native"])
@pytest.mark.parametrize("config", SETTINGS, ids=["default", "canonical", "early"])
def test_beam_equals_transformers(hf_model, native_model, target, config):
    model = HFTarget(hf_model) if target == "hf" else native_model
    ours = beam_search(model, PROMPTS, config=config, max_new_tokens=7, eos_token_id=EOS)
    assert_same_as_hf(ours, hf_beam(hf_model, PROMPTS, config, 7))
    assert ours.stats.target_forwards <= 7


@pytest.mark.parametrize("target", ["hf", "native"])
@pytest.mark.parametrize("config", SETTINGS, ids=["default", "canonical", "early"])
def test_beam_without_end_tokens_equals_transformers(hf_model, native_model, target, config):
    """No end token: every hypothesis ends at max_new_tokens, at once (the search keeps the best
    W a step and finishes them all at the last)."""
    model = HFTarget(hf_model) if target == "hf" else native_model
    ours = beam_search(model, PROMPTS, config=config, max_new_tokens=5)
    assert all(len(seq) == 5 for row in ours.tolist() for seq in row)
    assert_same_as_hf(ours, hf_beam(hf_model, PROMPTS, config, 5, eos=None))


@pytest.mark.parametrize("target", ["hf", "native"])
def test_catalogue_beam_equals_transformers_prefix_allowed_tokens(hf_model, native_model, target):
    sequences = random_catalogue(60, seed=1)
    catalogue = Catalogue.of(sequences, VOCAB, eos_token_id=EOS)
    model = HFTarget(hf_model) if target == "hf" else native_model
    config = BeamConfig(num_beams=6, num_return_sequences=4)
    ours = beam_search(
        model, PROMPTS, config=config, max_new_tokens=6, eos_token_id=EOS, constraint=catalogue
    )
    assert_same_as_hf(ours, hf_beam(hf_model, PROMPTS, config, 6, trie_allowed_fn(sequences)))
    items = {(*s, EOS) for s in sequences}
    assert all(tuple(seq) in items for row in ours.tolist() for seq in row)


def test_the_hook_constraint_equals_the_catalogue(native_model):
    sequences = random_catalogue(40, seed=2)
    by_width = trie_allowed_fn(sequences)  # the hook sees prompt + generated tokens

    def fn(row, ids):
        return by_width(len(PROMPTS[row]))(row, ids)

    kwargs = dict(config=BeamConfig(num_beams=4, num_return_sequences=2), max_new_tokens=6)
    by_hook = beam_search(
        native_model, PROMPTS, eos_token_id=EOS, constraint=AllowedTokens(fn, VOCAB), **kwargs
    )
    catalogue = Catalogue.of(sequences, VOCAB, eos_token_id=EOS)
    by_trie = beam_search(native_model, PROMPTS, eos_token_id=EOS, constraint=catalogue, **kwargs)
    assert by_hook.tolist() == by_trie.tolist()


@pytest.mark.parametrize("renormalize", [False, True])
def test_an_exhaustive_beam_is_the_brute_force_top_k(tiny, renormalize):
    """W = the number of items: beam search ("never" stopping) returns the K best items by
    sum of log-probs / length ** length_penalty, found by scoring every item."""
    lm = tiny.HashLM(VOCAB, seed=3, scale=1.5)
    sequences = random_catalogue(25, seed=4)
    catalogue = Catalogue.of(sequences, VOCAB, eos_token_id=EOS)
    config = BeamConfig(
        num_beams=25,
        num_return_sequences=6,
        length_penalty=0.7,
        early_stopping="never",
        renormalize=renormalize,
    )
    out = beam_search(
        CallableTarget(lm, VOCAB),
        PROMPTS,
        config=config,
        max_new_tokens=6,
        eos_token_id=EOS,
        constraint=catalogue,
    )
    assert_best_items(out, lm, catalogue, sequences, renormalize, length_penalty=0.7)


def assert_best_items(out, lm, catalogue, sequences, renormalize, length_penalty):
    """``out`` holds, per prompt, the best items by sum of log-probs / length ** length_penalty,
    found by scoring every item."""
    k = out.scores.shape[1]
    for b, prompt in enumerate(PROMPTS):
        scored = []
        for seq in sequences:
            full = [*seq, EOS]
            logits = lm(torch.tensor([prompt + full]))[0, len(prompt) - 1 : -1]
            total = 0.0
            for i, token in enumerate(full):
                lp = torch.log_softmax(logits[i], -1)
                if renormalize:
                    allowed = catalogue.allowed(*_prefix_state(catalogue, full[:i]))[0]
                    lp = torch.log_softmax(logits[i].masked_fill(~allowed, float("-inf")), -1)
                total += float(lp[token])
            scored.append((total / len(full) ** length_penalty, full))
        scored.sort(key=lambda x: -x[0])
        assert out.tolist()[b] == [s for _, s in scored[:k]]
        assert torch.allclose(out.scores[b], torch.tensor([s for s, _ in scored[:k]]), atol=1e-4)
    assert_states_are_the_leaves(catalogue, out)


class LogProbsOfNeeded(CallableTarget):
    """Log-probs as outputs, for the nodes a grow needs only: the others' are left at -inf (the
    contract lets a target skip them), and a forced token is declared free, as the recommender
    does."""

    outputs_log_probs = True
    forced_tokens_free = True

    def grow_tree(self, cache, tokens, parents, needed=None):
        out = torch.log_softmax(super().grow_tree(cache, tokens, parents, needed), -1)
        return out if needed is None else out.masked_fill(~needed[..., None], float("-inf"))


def test_forced_tokens_cost_nothing_beside_wider_nodes(tiny):
    """A forced token costs 0 without the target, also in a step whose other nodes have more
    children than a node keeps (2W), on a target that leaves unneeded outputs at -inf: W = 2
    beams over a catalogue whose only choices are the first token and the third after [4, 5]
    find the best items, as the speculative search does."""
    lm = tiny.HashLM(VOCAB, seed=7, scale=1.5)
    sequences = [[4, 5, x] for x in range(4, 40)] + [[6, 7, 8]]
    catalogue = Catalogue.of(sequences, VOCAB, eos_token_id=EOS)
    target = LogProbsOfNeeded(lm, VOCAB)
    config = BeamConfig(num_beams=2, num_return_sequences=2, length_penalty=0.0)
    kwargs = dict(config=config, max_new_tokens=4, eos_token_id=EOS, constraint=catalogue)
    plain = beam_search(target, PROMPTS, **kwargs)
    spec = beam_search(target, PROMPTS, drafter=CatalogueDrafter(catalogue), **kwargs)
    for b, prompt in enumerate(PROMPTS):  # each item: its first and third tokens' log-probs
        first = torch.log_softmax(lm(torch.tensor([prompt]))[0, -1], -1)
        scored = [(float(first[6]), [6, 7, 8, EOS])]
        third = torch.log_softmax(lm(torch.tensor([[*prompt, 4, 5]]))[0, -1], -1)
        scored += [(float(first[4] + third[x]), [4, 5, x, EOS]) for x in range(4, 40)]
        scored.sort(key=lambda x: -x[0])
        for out in (plain, spec):
            assert out.tolist()[b] == [s for _, s in scored[:2]]
            torch.testing.assert_close(out.scores[b], torch.tensor([s for s, _ in scored[:2]]))
    assert [6, 7, 8, EOS] in [s for row in plain.tolist() for s in row]  # the forced path won


def assert_states_are_the_leaves(catalogue, out):
    """Each result's carried state is the trie leaf its tokens walk to (its item)."""
    walked = catalogue.items_of(out.values, out.offsets).view(out.scores.shape)
    assert bool((walked >= 0).all())
    assert torch.equal(catalogue.trie.items(out.states), walked)


def _prefix_state(catalogue, prefix):
    state = torch.zeros(1, dtype=torch.long)
    for token in prefix:
        state = catalogue.advance(state, torch.tensor([token]))
    return state, torch.zeros(1, dtype=torch.long), lambda: []


@pytest.mark.parametrize(
    ("depth", "fanout", "items"), [(1, 1, 1), (8, 1, 1), (3, 3, 2), (8, 40, 1)]
)
@pytest.mark.parametrize("renormalize", [False, True])
def test_speculative_beam_equals_plain_beam_in_fewer_passes(
    tiny, depth, fanout, items, renormalize
):
    """On a cache-free target (each node's logits independent of the pass) the outputs are
    identical; drafts that miss (fanout > 1) cost nodes, never a different answer. Renormalised,
    a forced token costs 0 without the target, which the two searches know in their own ways;
    the catalogue's widest node has more children than a node keeps (2W), so a search that
    looked for a forced node's candidate among the kept ones would lose it."""
    lm = tiny.HashLM(VOCAB, seed=5, scale=1.5)
    sequences = random_catalogue(80, seed=6)
    catalogue = Catalogue.of(sequences, VOCAB, eos_token_id=EOS)
    target = CallableTarget(lm, VOCAB)
    assert catalogue.trie.widest > 2 * max(config.num_beams for config in SETTINGS)
    for config in (replace(config, renormalize=renormalize) for config in SETTINGS):
        kwargs = dict(config=config, max_new_tokens=6, eos_token_id=EOS, constraint=catalogue)
        plain = beam_search(target, PROMPTS, **kwargs)
        drafter = CatalogueDrafter(catalogue, depth=depth, fanout=fanout, items=items)
        spec = beam_search(target, PROMPTS, drafter=drafter, **kwargs)
        assert spec.tolist() == plain.tolist()
        # (renormalised over a node's children, scored in passes of other shapes: rounding)
        torch.testing.assert_close(
            spec.scores, plain.scores, rtol=0, atol=0 if not renormalize else 1e-6
        )
        assert_states_are_the_leaves(catalogue, plain)
        assert_states_are_the_leaves(catalogue, spec)
        assert spec.stats.target_forwards <= plain.stats.target_forwards
        assert spec.stats.draft_nodes > 0
    deep = beam_search(
        target,
        PROMPTS,
        config=SETTINGS[0],
        max_new_tokens=6,
        eos_token_id=EOS,
        constraint=catalogue,
        drafter=CatalogueDrafter(catalogue, depth=8, fanout=40),
    )
    assert deep.stats.target_forwards < plain.stats.target_forwards


# 160, 201 and 1155: early stopping, where the root's copies (tied in float32) count toward a
# row's W finished hypotheses: which ones ran on decided the step a row stopped at, and so its
# real results, until ties were kept in place order (`beam.stable_top`)
@pytest.mark.parametrize("seed", [*range(8), 160, 201, 1155])
def test_random_catalogues_and_settings(tiny, seed):
    """Drawn at random: a catalogue of 1-60 items, W, K, the length penalty, early stopping, the
    scoring rule, the draft budget and both drafters' depths: speculative beam search returns
    plain beam search's results, the root copies' continuations too (a cache-free target: the
    same scores), every real one an item."""
    r = random.Random(seed)
    catalogue = Catalogue.of(random_catalogue(r.randint(1, 60), seed), VOCAB, eos_token_id=EOS)
    config = BeamConfig(
        num_beams=(w := r.randint(1, 12)),
        num_return_sequences=r.randint(1, min(w, catalogue.trie.num_items)),
        length_penalty=r.choice([0.0, 0.5, 1.0, 2.0]),
        early_stopping=r.choice([True, False, "never"]),
        renormalize=r.random() < 0.5,
        draft_nodes=r.choice([1, 4, 32, 200]),
    )
    target = CallableTarget(tiny.HashLM(VOCAB, seed=seed, scale=r.choice([0.5, 1.5, 3.0])), VOCAB)
    prompts = [[r.randint(4, VOCAB - 1) for _ in range(r.randint(1, 7))] for _ in range(3)]
    kwargs = dict(config=config, max_new_tokens=catalogue.trie.longest + r.randint(0, 2),
                  eos_token_id=EOS, constraint=catalogue)  # fmt: skip
    plain = beam_search(target, prompts, **kwargs)
    drafters = [
        CatalogueDrafter(catalogue, depth=r.randint(1, 8), fanout=r.randint(1, 5), items=2),
        PromptLookupDrafter(depth=r.randint(1, 6)),
    ]
    for drafter in drafters:
        spec = beam_search(target, prompts, drafter=drafter, **kwargs)
        assert spec.tolist() == plain.tolist(), type(drafter).__name__
        assert torch.equal(spec.states, plain.states)
        torch.testing.assert_close(spec.scores, plain.scores, rtol=0, atol=1e-6)
    real = plain.scores > -1e7  # (not the root copies' continuations, about -1e9)
    walked = catalogue.items_of(plain.values, plain.offsets).view(plain.scores.shape)
    assert bool((walked[real] >= 0).all())


# every early_stopping, catalogues narrower than 2W among them (seeds 2, 10, 26)
@pytest.mark.parametrize("seed", [2, 4, 10, 13, 26, 37])
def test_random_settings_under_the_hook_equal_transformers(tiny, seed):
    """A random tiny Llama, catalogue and settings: ours through the transformers hook (which
    allows the end token after an item's end, as transformers' must) gives transformers'
    `generate` lists, early stopping and narrow catalogues included."""
    r = random.Random(seed)
    model = tiny.hf_llama(VOCAB, seed=100 + seed, scale=r.choice([1.5, 2.5, 4.0]))
    sequences = random_catalogue(r.randint(2, 30), seed)
    prompts = [[r.randint(4, VOCAB - 1) for _ in range(r.randint(1, 8))] for _ in range(2)]
    config = BeamConfig(
        num_beams=(w := r.randint(2, 8)),
        num_return_sequences=r.randint(1, min(w, len(sequences))),
        length_penalty=r.choice([0.0, 1.0, 2.0]),
        early_stopping=r.choice([True, False, "never"]),
    )
    max_new = max(map(len, sequences)) + 1 + r.randint(0, 2)
    by_width = trie_allowed_fn(sequences)
    hook = AllowedTokens(lambda row, ids: by_width(len(prompts[row]))(row, ids), VOCAB)
    ours = beam_search(HFTarget(model), prompts, config=config, max_new_tokens=max_new,
                       eos_token_id=EOS, constraint=hook)  # fmt: skip
    rows, scores = hf_beam(model, prompts, config, max_new, trie_allowed_fn(sequences))
    for b, (mine, theirs) in enumerate(zip(ours.tolist(), rows, strict=True)):
        for k, (seq, ref) in enumerate(zip(mine, theirs, strict=True)):
            if scores[b, k] > -1e7:  # (the root copies' continuations tie)
                assert ref[: len(seq)] == seq and all(t == EOS for t in ref[len(seq) :])
    real = scores > -1e7
    torch.testing.assert_close(ours.scores[real], scores[real], rtol=0, atol=1e-4)


def test_speculative_beam_on_the_native_llama(native_model):
    sequences = random_catalogue(80, seed=7)
    catalogue = Catalogue.of(sequences, VOCAB, eos_token_id=EOS)
    kwargs = dict(
        config=BeamConfig(num_beams=5, num_return_sequences=5),
        max_new_tokens=6,
        eos_token_id=EOS,
        constraint=catalogue,
    )
    plain = beam_search(native_model, PROMPTS, **kwargs)
    spec = beam_search(native_model, PROMPTS, drafter=CatalogueDrafter(catalogue, 8, 4), **kwargs)
    assert spec.tolist() == plain.tolist()
    assert torch.allclose(spec.scores, plain.scores, atol=1e-5)
    assert spec.stats.target_forwards < plain.stats.target_forwards


class Unscored(HFTarget):
    """transformers' model with the root scored by a pass of its own (the prefill caches all
    but the prompts' last tokens), counting the passes that grow the tree."""

    scores_prefill = False
    grows = 0

    def grow_tree(self, *args, **kwargs):
        self.grows += 1
        return super().grow_tree(*args, **kwargs)


@pytest.mark.parametrize("drafted", [False, True])
def test_the_roots_from_the_prefill_spare_a_pass(hf_model, drafted):
    """Where the prefill scores the prompts' last tokens, the first step reads them: the same
    beams and scores in one grow fewer, the prefill counted as the roots' pass."""
    catalogue = Catalogue.of(random_catalogue(80, seed=7), VOCAB, eos_token_id=EOS)
    drafter = CatalogueDrafter(catalogue, 8, 4) if drafted else None
    kwargs = dict(
        config=BeamConfig(num_beams=5, num_return_sequences=5),
        max_new_tokens=6,
        eos_token_id=EOS,
        constraint=catalogue,
        drafter=drafter,
    )
    unscored, scored = Unscored(hf_model), Unscored(hf_model)
    scored.scores_prefill = True
    before = beam_search(unscored, PROMPTS, **kwargs)
    after = beam_search(scored, PROMPTS, **kwargs)
    assert after.tolist() == before.tolist()
    assert torch.allclose(after.scores, before.scores, atol=1e-5)
    assert after.stats.target_forwards == scored.grows + 1
    assert before.stats.target_forwards == unscored.grows
    if not drafted:  # a plain search's passes are its steps either way
        assert scored.grows == unscored.grows - 1


class CopyingLM:
    """A causal toy LM that continues what followed the latest earlier occurrence of its last
    token (a strong induction head, margin 20 nats over a seeded random bigram table), and
    follows the bigram table where the token is new: the text prompt lookup predicts."""

    def __init__(self, vocab: int, seed: int) -> None:
        self.table = torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(seed))

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:  # [B, T] -> [B, T, V]
        positions = torch.arange(ids.shape[1])
        same = (ids[:, :, None] == ids[:, None, :]) & (positions[None, :] < positions[:, None])
        latest = torch.where(same, positions, -1).max(-1).values  # [B, T] -1: a new token
        following = ids.gather(1, (latest + 1).clamp(max=ids.shape[1] - 1))
        copy = (
            torch.nn.functional.one_hot(following, self.table.shape[1]) * (latest >= 0)[..., None]
        )
        return self.table[ids] + 20.0 * copy


def test_prompt_lookup_drafts_leave_beam_search_unchanged_in_fewer_passes(tiny):
    """Unconstrained beam search: drafting what followed each beam's last tokens gives plain
    beam search's output, in fewer passes where every beam's next token is drafted (a model
    that copies its text, narrow beams: a pass is saved only when all beams hit); under a
    catalogue the drafted nodes carry the catalogue's states, so the output is the same there
    too."""
    prompts = [[5, 9, 2, 33, 7, 1, 5, 9, 2, 33], [4, 7, 11, 4, 7], [12, 30, 6, 12, 30]]
    copying = CallableTarget(CopyingLM(VOCAB, 3), VOCAB)
    markov = CallableTarget(tiny.HashLM(VOCAB, seed=3, scale=3.0, order=2), VOCAB)
    narrow = BeamConfig(num_beams=1)  # one beam: it copies, so its drafts hit
    for target in (copying, markov):
        for config in (*SETTINGS, narrow):
            kwargs = dict(config=config, max_new_tokens=12, eos_token_id=EOS)
            plain = beam_search(target, prompts, **kwargs)
            spec = beam_search(target, prompts, drafter=PromptLookupDrafter(depth=4), **kwargs)
            assert spec.tolist() == plain.tolist() and torch.equal(spec.scores, plain.scores)
            assert spec.stats.draft_hits <= spec.stats.needed_nodes
            if target is copying:
                assert spec.stats.draft_hits > 0
            if target is copying and config is narrow:
                assert spec.stats.target_forwards < plain.stats.target_forwards
    catalogue = Catalogue.of(random_catalogue(80, seed=6), VOCAB, eos_token_id=EOS)
    kwargs = dict(config=SETTINGS[0], max_new_tokens=6, eos_token_id=EOS, constraint=catalogue)
    plain = beam_search(copying, prompts, **kwargs)
    spec = beam_search(copying, prompts, drafter=PromptLookupDrafter(depth=3), **kwargs)
    assert spec.tolist() == plain.tolist() and torch.equal(spec.scores, plain.scores)


def test_prompt_lookup_beam_drafts_on_the_native_llama(native_model):
    """The drafted chains go through the native Llama's tree passes and K/V: same beams. Each
    prompt holds every token, so every beam's last token occurred before: drafts every step."""
    kwargs = dict(config=BeamConfig(num_beams=4, num_return_sequences=3), max_new_tokens=8)
    every = list(range(VOCAB))
    prompts = [every + [5, 9, 2, 5, 9, 2, 5], every[::-1] + [4, 7, 4, 7], every + [12, 30, 3]]
    plain = beam_search(native_model, prompts, eos_token_id=EOS, **kwargs)
    spec = beam_search(
        native_model, prompts, eos_token_id=EOS, drafter=PromptLookupDrafter(), **kwargs
    )
    assert spec.tolist() == plain.tolist()
    assert torch.allclose(spec.scores, plain.scores, atol=1e-5)
    assert spec.stats.draft_nodes > 0


def test_a_native_beam_tree_may_hold_more_nodes_than_positions(hf_model, native_model):
    """The tiny Llama has 128 positions; a search of W=12 beams over 14 tokens keeps 12 x 14
    nodes besides the prompts in its tree. Their positions stay within the model's, so it runs,
    and equals transformers' beam search."""
    config = BeamConfig(num_beams=12, num_return_sequences=3)
    ours = beam_search(native_model, PROMPTS, config=config, max_new_tokens=14)
    assert_same_as_hf(ours, hf_beam(hf_model, PROMPTS, config, 14))


def test_prompt_lookup_drafts_nothing_past_the_last_step(native_model):
    """Prompts that fill the tiny Llama's 128 positions with the tokens to be generated: the
    beams' chains continue past the last step, where no beam goes and no position is left, so
    the drafter stops there (a draft below it would read past the model's positions)."""
    pattern = [5, 9, 2, 33, 7, 1, 12, 30]
    prompts = [(pattern * 16)[:120], (pattern[::-1] * 16)[:118]]
    kwargs = dict(config=BeamConfig(num_beams=2, num_return_sequences=2), max_new_tokens=8)
    plain = beam_search(native_model, prompts, **kwargs)
    spec = beam_search(native_model, prompts, drafter=PromptLookupDrafter(depth=6), **kwargs)
    assert spec.tolist() == plain.tolist()
    assert torch.allclose(spec.scores, plain.scores, atol=1e-5)
    assert spec.stats.draft_nodes > 0


def test_continuation_starts_after_the_latest_longest_match():
    tokens = torch.tensor([[1, 2, 3, 9, 1, 2, 4, 1, 2], [5, 6, 7, 8, 0, 0, 0, 0, 0]])
    # row 0 ends "1 2": last seen earlier at 4-5, followed by 4 (position 6); row 1 never repeats
    assert continuation_starts(tokens, torch.tensor([9, 4]), 3, 1).tolist() == [6, -1]
    # "2 3" occurs earlier only with n <= 2 here
    assert continuation_starts(
        torch.tensor([[2, 3, 7, 2, 3]]), torch.tensor([5]), 3, 1
    ).tolist() == [2]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(config=BeamConfig(num_beams=2, num_return_sequences=3)), "larger than num_beams"),
        (dict(config=BeamConfig(num_beams=0)), "must both be >= 1"),
        (dict(config=BeamConfig(early_stopping="sometimes")), "early_stopping"),
        # (NaN scored every hypothesis -1e9 and returned one)
        (dict(config=BeamConfig(length_penalty=float("nan"))), "length_penalty = nan"),
        (dict(config=BeamConfig(num_beams=9, num_return_sequences=9)), "larger than the catalogue"),
        (dict(eos_token_id=None), "needs eos_token_id"),
        (dict(max_new_tokens=2), "shorter than the catalogue's longest"),
        # a catalogue of another vocabulary (a wider tokenizer's)
        (dict(constraint=Catalogue.of([[4, 50]], 64, eos_token_id=EOS)), "holds token 50"),
        # items that hold the search's end token inside (built without eos_token_id)
        (dict(constraint=Catalogue.of([[4, EOS, 5, EOS], [6, EOS]], VOCAB)), "inside a catalogue"),
    ],
)
def test_bad_beam_input_is_refused(native_model, change, message):
    catalogue = Catalogue.of([[4, 5], [4, 6, 7], [8]], VOCAB, eos_token_id=EOS)
    kwargs = dict(config=BeamConfig(), max_new_tokens=6, eos_token_id=EOS, constraint=catalogue)
    with pytest.raises(DecodeInputError, match=message):
        beam_search(native_model, PROMPTS, **{**kwargs, **change})


@pytest.mark.parametrize(
    ("sequences", "message"),
    [
        ([], "empty"),
        ([[4, 99]], "outside the vocabulary"),
        ([[4, 5], [4, 5, 6]], "strict prefix"),
        ([[]], "empty token sequence"),
    ],
)
def test_bad_catalogues_are_refused(sequences, message):
    with pytest.raises(DecodeInputError, match=message):
        Catalogue.of(sequences, VOCAB)
    with pytest.raises(DecodeInputError, match="end token 3 before its end"):
        Catalogue.of([[4, 5], [6, EOS, 7]], VOCAB, eos_token_id=EOS)


def test_greedy_refuses_a_catalogue_the_target_cannot_decode(native_model):
    kwargs = dict(max_new_tokens=6, eos_token_id=EOS)
    with pytest.raises(DecodeInputError, match="outside the target's vocabulary of 40"):
        generate(native_model, PROMPTS, constraint=Catalogue.of([[4, 50]], 64, EOS), **kwargs)
    inside = Catalogue.of([[4, EOS, 5, EOS], [6, EOS]], VOCAB)
    with pytest.raises(DecodeInputError, match="inside a catalogue item"):
        generate(native_model, PROMPTS, constraint=inside, **kwargs)


def test_a_hook_that_allows_nothing_is_refused(native_model):
    hook = AllowedTokens(lambda row, ids: [] if len(ids) > 7 else [4], VOCAB)
    with pytest.raises(DecodeInputError, match="returned no token"):
        beam_search(native_model, PROMPTS, max_new_tokens=4, constraint=hook)


def test_the_trie_steps_and_lists_children():
    catalogue = Catalogue.of([[4, 5], [4, 6, 7], [8]], VOCAB, eos_token_id=EOS)
    trie = catalogue.trie
    assert trie.num_items == 3 and trie.longest == 4
    after_4 = trie.step(torch.zeros(2, dtype=torch.long), torch.tensor([4, 9]))
    assert after_4[1] == -1  # 9 leaves the catalogue
    assert trie.allowed(after_4[:1])[0].nonzero().flatten().tolist() == [5, 6]
    node = torch.zeros(1, dtype=torch.long)
    for token in [4, 6, 7]:
        node = trie.step(node, torch.tensor([token]))
    assert int(trie.forced(node)) == EOS
    leaf = trie.step(node, torch.tensor([EOS]))
    assert int(trie.items(leaf)) == 1 and torch.equal(trie.forced_child(node), leaf)
    # a choice, a leaf (nothing to force) and no node (-1) force nothing
    nothing = torch.stack([torch.tensor(0), leaf[0], torch.tensor(-1)])
    assert trie.forced(nothing).tolist() == trie.forced_child(nothing).tolist() == [-1] * 3
    tokens, _, exists = trie.children_of(torch.tensor([0, int(after_4[0]), -1]))
    assert tokens[exists].tolist() == [4, 8, 5, 6] and exists.sum(1).tolist() == [2, 2, 0]
    assert catalogue.items_below[[0, int(after_4[0])]].tolist() == [3, 2]
    assert bool((catalogue.items_below[trie.leaf_items >= 0] == 1).all())
    # breadth-first numbering, children in token order: edge e leads to node e + 1
    by_depth = [[0]]
    while by_depth[-1]:
        below = trie.children_of(torch.tensor(by_depth[-1]))[1]
        by_depth.append(below[below >= 0].tolist())
    assert sum(by_depth, []) == list(range(trie.num_nodes))


def test_nan_logits_are_refused():
    def broken(ids):
        logits = torch.randn(*ids.shape, VOCAB)
        return torch.where(ids[..., None] == 9, float("nan"), logits)  # after token 9: NaN

    with pytest.raises(DecodeInputError, match="NaN"):
        beam_search(CallableTarget(broken, VOCAB), [[1, 9], [2, 3]], max_new_tokens=3)


def test_distinct_keys_map_every_copy_to_its_first():
    keys = torch.randint(0, 6, (40,), generator=torch.Generator().manual_seed(0))
    positions, copy_of = _distinct(keys)
    firsts = [i for i, key in enumerate(keys.tolist()) if key not in keys[:i].tolist()]
    assert positions.tolist() == firsts
    assert torch.equal(keys[positions][copy_of], keys)


def test_the_beam_tree_derives_each_nodes_constraint_state():
    catalogue = Catalogue.of([[1, 2, EOS], [1, 4, EOS]], VOCAB)
    tree = BeamTree(batch=2, width=3, vocab_size=VOCAB, capacity=4, constraint=catalogue)
    roots = tree.add(torch.tensor([0, 1]), torch.tensor([-1, -1]), torch.tensor([7, 7]))
    firsts = tree.add(torch.tensor([0, 1]), roots, torch.tensor([1, 2]))  # 2 leaves it
    tree.add(torch.tensor([0, 0]), firsts[:1].repeat(2), torch.tensor([2, 4]))
    after_1 = catalogue.advance(torch.tensor(0), torch.tensor(1))
    expected = catalogue.advance(after_1.repeat(2), torch.tensor([2, 4]))
    assert tree.states[:, 0].tolist() == [0, 0]  # the roots: the catalogue's start
    assert tree.states[:, 1].tolist() == [int(after_1), -1]
    assert tree.states[0, 2:4].tolist() == expected.tolist() and bool((expected >= 0).all())
    # without a constraint every node's state is 0
    plain = BeamTree(batch=1, width=3, vocab_size=VOCAB, capacity=2)
    plain.add(torch.tensor([0, 0]), torch.tensor([-1, 0]), torch.tensor([7, 1]))
    assert plain.states[0, :2].tolist() == [0, 0]


def test_the_beam_tree_reads_back_what_it_stored():
    tree = BeamTree(batch=2, width=3, vocab_size=VOCAB, capacity=4)
    rows, parents, tokens = (
        torch.tensor([0, 0, 1]),
        torch.tensor([-1, 0, -1]),
        torch.tensor([1, 2, 3]),
    )
    nodes = tree.add(rows, parents, tokens)
    assert nodes.tolist() == [0, 1, 0]
    assert tree.child(rows, parents, tokens).tolist() == [0, 1, 0]
    row0 = torch.zeros(2, dtype=torch.long)
    values = torch.tensor([[-0.5, -1.0], [-0.25, -2.0]])
    tree.store(
        row0, nodes[:2], values, torch.tensor([[4, 5], [6, 7]]), torch.tensor([[9, 10], [11, 12]])
    )
    # a forced token: log-prob 0
    tree.know(torch.tensor([1]), torch.tensor([0]), torch.tensor([8]), torch.tensor([13]))
    # [B, W=2, C'=2] candidates (the most any node has), short rows padded with -inf, token 0
    # and state -1; node -1 reads the root
    values, tokens, states = tree.candidates(torch.tensor([[1, 0], [0, -1]]))
    inf = float("-inf")
    assert values.tolist() == [[[-0.25, -2.0], [-0.5, -1.0]], [[0.0, inf]] * 2]
    assert tokens.tolist() == [[[6, 7], [4, 5]], [[8, 0]] * 2]
    assert states.tolist() == [[[11, 12], [9, 10]], [[13, -1]] * 2]
    # past the first tables' room, earlier nodes read back the same; a node not scored has none
    many = torch.arange(3)
    tree.add(torch.ones(3, dtype=torch.long), many - 1, many + 1)
    tree.store(
        torch.ones(3, dtype=torch.long),
        many + 1,
        -torch.rand(3, 3),
        many[:, None].repeat(1, 3),
        many[:, None].repeat(1, 3) + 20,
    )
    values, tokens, states = tree.candidates(torch.tensor([[1, 1], [0, 3]]))
    assert values[0, :, :2].tolist() == [[-0.25, -2.0]] * 2 and values[0, :, 2].isinf().all()
    assert tokens[1].tolist() == [[8, 0, 0], [2, 2, 2]]
    assert states[1].tolist() == [[13, -1, -1], [22, 22, 22]]
    assert tree.candidates(torch.tensor([[2, 2], [0, 0]]))[0][0].isinf().all()


def test_a_short_run_at_the_end_of_the_store_reads_back():
    """A node's run shorter than another's, stored last (a forced token's, as a step plans it),
    reads back its own slots however full the tables are (the candidates read C' slots from
    every run's first, C' the widest run's)."""
    zeros = torch.zeros(2, dtype=torch.long)
    for runs in range(1, 7):  # the tables filled to several depths before the short runs
        tree = BeamTree(batch=1, width=3, vocab_size=VOCAB, capacity=8)
        nodes = tree.add(zeros[:1].repeat(3), torch.tensor([-1, 0, 0]), torch.tensor([1, 2, 3]))
        wide = -torch.rand(runs, 3)
        again = torch.zeros(runs, dtype=torch.long)  # the root's run, stored again and again
        tree.store(again, again, wide, torch.ones(runs, 3, dtype=torch.long), torch.ones_like(wide))
        tree.know(zeros, nodes[1:], torch.tensor([5, 6]), torch.tensor([7, 8]))
        values, tokens, states = tree.candidates(nodes[None])  # [1, 3, 3] each
        assert values[0, 0].tolist() == wide[-1].tolist()
        assert values[0, 1:].tolist() == [[0.0, float("-inf"), float("-inf")]] * 2
        assert tokens[0, 1:, 0].tolist() == [5, 6] and states[0, 1:, 0].tolist() == [7, 8]


def test_the_beam_tree_names_what_each_add_planned():
    """``added_since`` gives the nodes of a pass's later ``add``s in the order added (what a
    drafter planned after the beams' nodes), ``count_added`` the earlier ones; a closed pass
    starts the log afresh."""
    tree = BeamTree(batch=3, width=2, vocab_size=VOCAB, capacity=2)
    beams = tree.add(torch.tensor([0, 2]), torch.tensor([-1, -1]), torch.tensor([1, 1]))
    mark = len(tree.added)
    drafted = tree.add(torch.tensor([0, 0, 2]), torch.tensor([0, 0, 0]), torch.tensor([2, 3, 2]))
    more = tree.add(torch.tensor([1]), torch.tensor([-1]), torch.tensor([4]))
    assert beams.tolist() == [0, 0] and drafted.tolist() == [1, 2, 1] and more.tolist() == [0]
    rows, nodes = tree.added_since(mark)
    assert rows.tolist() == [0, 0, 2, 1] and nodes.tolist() == [1, 2, 1, 0]
    assert [part.tolist() for part in tree.added_since(0)] == [
        [0, 2, 0, 0, 2, 1],
        [0, 0, 1, 2, 1, 0],
    ]
    assert tree.count_added(mark) == 2 and tree.count_added(len(tree.added)) == 6
    tree.plan()
    assert [len(part) for part in tree.added_since(0)] == [0, 0]


def test_rank_within_rows_counts_from_each_rows_first():
    rows = torch.tensor([0, 0, 0, 2, 2, 5, 7, 7, 7, 7])
    assert rank_within_rows(rows).tolist() == [0, 1, 2, 0, 1, 0, 0, 1, 2, 3]
    assert rank_within_rows(rows[:0]).tolist() == []

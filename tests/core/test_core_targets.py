"""Target adapters score a branching tree exactly as the cache-free callable does, before and
after committing rows' different paths, and expose hidden states for trained drafters."""

import pytest
import torch

from genrec_spec import CallableTarget, DraftTree, HFTarget, NativeTarget
from genrec_spec.core import controller
from genrec_spec.core.controller import cached_pass_cost, measure_pass_cost
from genrec_spec.core.tree import root_only
from genrec_spec.core.types import DecodeInputError
from genrec_spec.models.llm.llama import Llama, LlamaConfig

VOCAB = 50
PROMPTS = torch.tensor([[3, 7, 9, 11, 2], [5, 8, 0, 0, 0], [1, 2, 3, 4, 0]])
LENGTHS = torch.tensor([5, 2, 4])
# Root, two children, grandchildren under both, and (row 1 only) a padding leaf.
TREE = DraftTree(
    tokens=torch.tensor([[2, 10, 11, 12, 13, 14], [8, 20, 21, 22, 23, 0], [4, 30, 31, 32, 33, 34]]),
    parents=torch.tensor([[-1, 0, 0, 1, 2, 3], [-1, 0, 0, 1, 1, 0], [-1, 0, 0, 2, 3, 1]]),
    valid=torch.tensor([[True] * 6, [True] * 5 + [False], [True] * 6]),
)


def tiny_llama() -> Llama:
    torch.manual_seed(0)
    return Llama(
        LlamaConfig(
            vocab_size=VOCAB,
            dim=32,
            n_layers=2,
            n_heads=4,
            n_kv_heads=2,
            hidden_dim=64,
            max_seq_len=128,
        )
    ).eval()


def tiny_gemma3(window: int, layers: list[str]):
    """A tiny random Gemma-3 whose layers are ``layers`` (sliding or full attention)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=len(layers),
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        sliding_window=window,
        layer_types=layers,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    return Gemma3ForCausalLM(config).eval()


def models(tiny):
    native = tiny_llama()
    hf = tiny.hf_llama(VOCAB, seed=0, scale=1.0)
    return {
        "hf": (HFTarget(hf), lambda ids: hf(ids).logits),
        "native": (
            NativeTarget(native),
            lambda ids: native(ids, native.new_cache(ids.shape[0], ids.shape[1])),
        ),
    }


@pytest.mark.parametrize("name", ["hf", "native", "callable"])
def test_measure_pass_cost_times_every_target(tiny, name):
    """controller.measure_pass_cost runs on each adapter: a cost per size, 1 for one token."""
    target, fn = models(tiny)["native" if name == "callable" else name]
    cost = measure_pass_cost(CallableTarget(fn) if name == "callable" else target, 4, 8, 2)
    assert len(cost) == 4 and cost[0] == 1.0 and all(c > 0 for c in cost)


def test_cached_pass_cost_times_once_per_machine_key(tmp_path, monkeypatch):
    """The table is timed on the first call, read back after; an unreadable file is timed
    again; another thread count is another key; a wrapped target is refused."""
    timed = []

    def counting(model):
        timed.append(1)
        return measure_pass_cost(model, 4, 8, 2)

    monkeypatch.setattr(controller, "measure_pass_cost", counting)
    model = tiny_llama()
    first = cached_pass_cost(model, tmp_path)
    assert cached_pass_cost(model, tmp_path) == first and len(timed) == 1
    (file,) = tmp_path.iterdir()
    file.write_text("{not json")
    assert len(cached_pass_cost(model, tmp_path)) == 4 and len(timed) == 2
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        cached_pass_cost(model, tmp_path)
    finally:
        torch.set_num_threads(threads)
    assert len(timed) == 3 and len(list(tmp_path.glob("*.json"))) == 2
    assert not list(tmp_path.glob("*.tmp"))
    with pytest.raises(DecodeInputError, match="torch module"):
        cached_pass_cost(NativeTarget(model), tmp_path)


@pytest.mark.parametrize("name", ["hf", "native"])
def test_tree_scores_match_cache_free_callable(tiny, name):
    target, fn = models(tiny)[name]
    reference = CallableTarget(fn)
    with torch.inference_mode():
        caches = [t.prefill(PROMPTS, LENGTHS, 16) for t in (target, reference)]
        got, want = (
            t.score_tree(c, TREE) for t, c in zip((target, reference), caches, strict=True)
        )
        assert torch.allclose(got, want, atol=1e-4)
        # Rows keep different paths (and row 2 keeps nothing: a finished row), then score a
        # second tree on top of the new state.
        nodes = torch.tensor([[0, 1, 3], [0, 2, 0], [0, 0, 0]])
        counts = torch.tensor([3, 2, 0])
        for t, c in zip((target, reference), caches, strict=True):
            t.commit(c, nodes, counts)
        second = DraftTree(
            tokens=torch.tensor([[14, 1, 2], [23, 3, 4], [4, 5, 6]]),
            parents=torch.tensor([[-1, 0, 0]] * 3),
        )
        got, want = (
            t.score_tree(c, second) for t, c in zip((target, reference), caches, strict=True)
        )
        assert torch.allclose(got, want, atol=1e-4)


@pytest.mark.parametrize("name", ["hf", "native"])
def test_a_scored_prefill_gives_the_roots_logits_and_caches_them(tiny, name):
    """prefill_scored on right-padded prompts of three lengths: each row's last token's logits,
    as the cache-free callable gives them, and every prompt token cached, so a tree under the
    next token (its root) scores as the callable scores the prompt plus that token's tree."""
    target, fn = models(tiny)[name]
    reference = CallableTarget(fn)
    assert target.scores_prefill
    with torch.inference_mode():
        cache, logits = target.prefill_scored(PROMPTS, LENGTHS, 16)
        ref_cache = reference.prefill(PROMPTS, LENGTHS, 16)
        roots = root_only(PROMPTS.gather(1, LENGTHS[:, None] - 1)[:, 0])
        want = reference.score_tree(ref_cache, roots)
        assert logits.shape == (3, 1, VOCAB) and torch.allclose(logits, want, atol=1e-4)
        # The roots join the reference's cache as a commit would; TREE hangs under new roots.
        reference.commit(ref_cache, torch.zeros(3, 1, dtype=torch.long), torch.ones(3).long())
        got, want = target.score_tree(cache, TREE), reference.score_tree(ref_cache, TREE)
        assert torch.allclose(got[:, :5], want[:, :5], atol=1e-4)
        assert torch.allclose(got[[0, 2]], want[[0, 2]], atol=1e-4)  # row 1's node 5 pads


@pytest.mark.parametrize("name", ["hf", "native", "callable"])
def test_a_tree_grown_pass_by_pass_scores_as_one_pass(tiny, name):
    """TREE grown in three passes (root; its children; the grandchildren) gives the one-pass
    logits of the cache-free callable; a commit afterwards keeps a path of the grown tree, and
    the next tree scores on top of it as after an ordinary pass."""
    target, fn = models(tiny)["native" if name == "callable" else name]
    target = CallableTarget(fn) if name == "callable" else target
    reference = CallableTarget(fn)
    pieces = [(0, 1), (1, 3), (3, 6)]  # node ranges of the three passes
    with torch.inference_mode():
        cache = target.prefill(PROMPTS, LENGTHS, 16)
        ref_cache = reference.prefill(PROMPTS, LENGTHS, 16)
        want = reference.score_tree(ref_cache, TREE)
        got = torch.cat(
            [target.grow_tree(cache, TREE.tokens[:, a:b], TREE.parents[:, a:b]) for a, b in pieces],
            dim=1,
        )
        assert torch.allclose(got[:, :5], want[:, :5], atol=1e-4)
        assert torch.allclose(got[[0, 2]], want[[0, 2]], atol=1e-4)  # row 1's node 5 pads
        nodes, counts = torch.tensor([[0, 2, 4], [0, 1, 0], [0, 0, 0]]), torch.tensor([3, 2, 0])
        target.commit(cache, nodes, counts)
        reference.commit(ref_cache, nodes, counts)
        second = DraftTree(
            tokens=torch.tensor([[13, 1, 2], [20, 3, 4], [4, 5, 6]]),
            parents=torch.tensor([[-1, 0, 0]] * 3),
        )
        got, want = target.score_tree(cache, second), reference.score_tree(ref_cache, second)
        assert torch.allclose(got, want, atol=1e-4)


def test_hf_target_grows_a_tree_under_a_sliding_window():
    model = tiny_gemma3(window=3, layers=["sliding_attention", "full_attention"])
    target, reference = HFTarget(model), CallableTarget(lambda ids: model(ids).logits)
    with torch.inference_mode():
        cache = target.prefill(PROMPTS, LENGTHS, 16)
        want = reference.score_tree(reference.prefill(PROMPTS, LENGTHS, 16), TREE)
        got = torch.cat(
            [
                target.grow_tree(cache, TREE.tokens[:, a:b], TREE.parents[:, a:b])
                for a, b in [(0, 2), (2, 4), (4, 6)]
            ],
            dim=1,
        )
    assert torch.allclose(got[[0, 2]], want[[0, 2]], atol=1e-4)


@pytest.mark.parametrize("name", ["hf", "native"])
def test_hidden_states_for_drafters(tiny, name):
    target, _ = models(tiny)[name]
    with torch.inference_mode():
        cache = target.prefill(PROMPTS, LENGTHS, 16, hidden_layers=(1, 2))
        assert cache.hidden[2].shape == (3, 4, 32)  # the prompts minus their roots
        target.score_tree(cache, TREE)
        assert set(cache.hidden) == {1, 2} and cache.hidden[1].shape == (3, 6, 32)


def test_native_cache_grows_for_big_trees(tiny):
    target, fn = models(tiny)["native"]
    reference = CallableTarget(fn)
    n = 70  # more than the initial 64 slots
    wide = DraftTree(
        tokens=torch.arange(n).remainder(VOCAB).expand(3, n).clone(),
        parents=torch.cat([torch.tensor([-1]), torch.zeros(n - 1, dtype=torch.long)])
        .expand(3, n)
        .contiguous(),
    )
    with torch.inference_mode():
        cache = target.prefill(PROMPTS, LENGTHS, 0)
        before = cache.kv.max_len
        got = target.score_tree(cache, wide)
        want = reference.score_tree(reference.prefill(PROMPTS, LENGTHS, 0), wide)
    assert cache.kv.max_len > before
    assert torch.allclose(got, want, atol=1e-4)


def test_hf_target_applies_a_sliding_window():
    """Gemma-3's sliding-window layers (window 4 here): greedy decoding through HFTarget, plain
    and speculative (pending re-fed tokens, B = 3 uneven), equals a cache-free loop over the
    model's own forward, which applies the window itself."""
    from genrec_spec import generate
    from genrec_spec.llm.proposers import PromptLookup

    model = tiny_gemma3(
        window=4, layers=["sliding_attention", "full_attention", "sliding_attention"]
    )
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3.0)  # peaked distributions: no argmax ties
    prompts = [[5, 9, 2, 33, 7, 1, 8, 4, 4, 3], [4, 7], [12, 3, 3, 40, 22]]
    plain = generate(model, prompts, max_new_tokens=12).tolist()
    for prompt, generated in zip(prompts, plain, strict=True):
        sequence = list(prompt)
        for token in generated:
            with torch.no_grad():
                assert int(model(torch.tensor([sequence])).logits[0, -1].argmax()) == token
            sequence.append(token)
    out = generate(model, prompts, max_new_tokens=12, proposer=PromptLookup(k=3))
    assert out.tolist() == plain and out.stats.accepted_per_position[0] > 0

"""The native Llama on tiny random weights: equal to transformers, tree pass equal to chains."""

from dataclasses import replace

import pytest
import torch

from genrec_spec.models.llm.llama import Llama, LlamaConfig, LlamaError

pytestmark = pytest.mark.usefixtures("one_thread")


def assert_close(actual, expected):
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("tie", [False, True])
def test_matches_transformers_on_random_weights(tmp_path, llama_kit, tie):
    """A random transformers Llama saved as a HF folder: from_hf loads it, and every row of a
    right-padded batch (prefill, then one cached step) gives transformers' logits and hidden
    states for that row alone."""
    import transformers

    cfg = llama_kit.TINY
    hf_config = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.dim,
        intermediate_size=cfg.hidden_dim,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads,
        max_position_embeddings=cfg.max_seq_len,
        rope_theta=cfg.rope_theta,
        rms_norm_eps=cfg.norm_eps,
        tie_word_embeddings=tie,
    )
    torch.manual_seed(1)
    hf = transformers.LlamaForCausalLM(hf_config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():  # norms away from 1 so they are tested too
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.3 * torch.randn_like(p))
    hf.save_pretrained(tmp_path)
    model = Llama.from_hf(tmp_path)
    assert model.config == replace(cfg, tie_embeddings=tie)
    assert (model.output is None) == tie

    next_tokens = [3, 50, 0]
    with torch.no_grad():
        cache, logits = llama_kit.prefill(model, llama_kit.PROMPTS, max_len=16)
        step, hidden = model(torch.tensor(next_tokens)[:, None], cache, hidden_layers=(0, 2, 3))
        for b, prompt in enumerate(llama_kit.PROMPTS):
            ref = hf(torch.tensor([prompt + [next_tokens[b]]]), output_hidden_states=True)
            n = len(prompt)
            assert_close(logits[b, :n], ref.logits[0, :n])
            assert_close(step[b, 0], ref.logits[0, n])
            for layer, h in hidden.items():
                assert_close(h[b, 0], ref.hidden_states[layer][0, n])


@torch.no_grad()
def test_tree_logits_equal_each_branch_run_as_a_chain(llama_kit, tiny_llama):
    """Every node of a (different per row) random tree gets the logits its root-to-leaf branch
    gets as a plain chain after the same committed prompt."""
    cache, _ = llama_kit.prefill(tiny_llama, llama_kit.PROMPTS, max_len=32)
    gen = torch.Generator().manual_seed(0)
    batch, n = len(llama_kit.PROMPTS), 9
    parents = llama_kit.random_parents(batch, n, gen)
    tokens = torch.randint(0, llama_kit.TINY.vocab_size, (batch, n), generator=gen)
    tree = tiny_llama(tokens, cache, parents)  # [B, N, V]
    for b, prompt in enumerate(llama_kit.PROMPTS):
        for path in llama_kit.root_to_leaf_paths(parents[b].tolist()):
            chain = llama_kit.chain_logits(tiny_llama, prompt + tokens[b, path].tolist())
            assert_close(tree[b, path], chain[len(prompt) :])


@torch.no_grad()
def test_commit_a_tree_path_then_decode_equals_plain_decoding(llama_kit, tiny_llama):
    """Commit per row a different root-to-leaf path of a tree (of different lengths, one row
    keeps nothing), then one decode step: logits equal running the whole sequence afresh."""
    cache, _ = llama_kit.prefill(tiny_llama, llama_kit.PROMPTS, max_len=32)
    parents = torch.tensor([[-1, 0, 1, 0, 3, 4], [-1, -1, 1, 2, 1, 0], [-1, 0, 0, 1, 2, 2]])
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, llama_kit.TINY.vocab_size, parents.shape, generator=gen)
    tiny_llama(tokens, cache, parents)
    node_idx = torch.tensor([[0, 3, 4, 5], [1, 4, 0, 0], [0, 0, 0, 0]])  # padded past n
    n = torch.tensor([4, 2, 0])
    cache.commit(node_idx, n)
    assert cache.lengths.tolist() == [
        len(llama_kit.PROMPTS[b]) + k for b, k in enumerate([4, 2, 0])
    ]
    step = tiny_llama(torch.tensor([[7], [8], [9]]), cache)
    for b, prompt in enumerate(llama_kit.PROMPTS):
        seq = prompt + tokens[b, node_idx[b, : n[b]]].tolist() + [7 + b]
        assert_close(step[b, 0], llama_kit.chain_logits(tiny_llama, seq)[-1])


@torch.no_grad()
def test_a_forward_validates_its_tree_once(llama_kit, tiny_llama, monkeypatch):
    """The tree bookkeeping (validation, masks) is paid once per pass, not once per layer."""
    from genrec_spec.kernels import tree_plan

    calls = []
    check = tree_plan.check_parents
    monkeypatch.setattr(tree_plan, "check_parents", lambda p: calls.append(p) or check(p))
    cache, _ = llama_kit.prefill(tiny_llama, llama_kit.PROMPTS, max_len=32)
    tiny_llama(torch.ones(3, 4, dtype=torch.int64), cache, llama_kit.random_parents(3, 4, None))
    assert len(calls) == 2 and llama_kit.TINY.n_layers == 3  # prefill + tree pass


@torch.no_grad()
def test_attention_reads_the_cache_in_place(llama_kit, tiny_llama, monkeypatch):
    """On CPU every layer's attention reads [committed | pending] K/V as one slice of the cache
    (ragged rows included), never a copy of the committed entries."""
    from genrec_spec.kernels import tree_attention_torch

    found = []
    follows = tree_attention_torch._follows
    monkeypatch.setattr(
        tree_attention_torch, "_follows", lambda *args: found.append(follows(*args)) or found[-1]
    )
    cache, _ = llama_kit.prefill(tiny_llama, llama_kit.PROMPTS, max_len=32)
    tiny_llama(torch.ones(3, 5, dtype=torch.int64), cache, llama_kit.random_parents(3, 5, None))
    assert found == [True] * 2 * 2 * llama_kit.TINY.n_layers  # K and V, prefill and tree pass


@torch.no_grad()
def test_explicit_chain_parents_equal_none(llama_kit, tiny_llama):
    cache, _ = llama_kit.prefill(tiny_llama, llama_kit.PROMPTS, max_len=32)
    tokens = torch.tensor([[1, 2, 3, 4]] * 3)
    chain = torch.arange(4).expand(3, 4) - 1
    torch.testing.assert_close(tiny_llama(tokens, cache), tiny_llama(tokens, cache, chain))


@torch.no_grad()
def test_bfloat16_model_keeps_fp32_rope_and_stays_close(llama_kit, tiny_llama):
    """model.to(bfloat16) leaves the RoPE tables in fp32; logits stay near the fp32 model's."""
    half = llama_kit.make_tiny_llama().to(torch.bfloat16)
    assert half._rope_cos.dtype == torch.float32
    _, ref = llama_kit.prefill(tiny_llama, llama_kit.PROMPTS, max_len=16)
    cache, logits = llama_kit.prefill(half, llama_kit.PROMPTS, max_len=16)
    assert cache.dtype == torch.bfloat16 and logits.dtype == torch.float32
    for b, prompt in enumerate(llama_kit.PROMPTS):
        n = len(prompt)
        torch.testing.assert_close(logits[b, :n], ref[b, :n], atol=0.1, rtol=0.05)


@torch.no_grad()
def test_hidden_states_equal_forwards(llama_kit, tiny_llama):
    """hidden_states (no LM head, no layers past the deepest asked for) returns forward's hidden
    layers, the final-normed state included."""
    tokens = torch.randint(0, llama_kit.TINY.vocab_size, (2, 7))
    last = llama_kit.TINY.n_layers
    for layers in ((1,), (0, last), (0, 1, last)):
        _, full = tiny_llama(tokens, tiny_llama.new_cache(2, 7), hidden_layers=layers)
        alone = tiny_llama.hidden_states(tokens, tiny_llama.new_cache(2, 7), layers)
        assert sorted(alone) == sorted(layers)
        for layer in layers:
            torch.testing.assert_close(alone[layer], full[layer], rtol=0, atol=0)
    with pytest.raises(LlamaError, match="needs layers"):
        tiny_llama.hidden_states(tokens, tiny_llama.new_cache(2, 7), ())


def test_bad_forward_input_raises(llama_kit, tiny_llama):
    cache = tiny_llama.new_cache(2, 16)
    tokens = torch.zeros(2, 4, dtype=torch.int64)
    with pytest.raises(LlamaError, match="rows but the cache has 2"):
        tiny_llama(torch.zeros(3, 4, dtype=torch.int64), cache)
    with pytest.raises(LlamaError, match="parents has shape"):
        tiny_llama(tokens, cache, torch.zeros(2, 3, dtype=torch.int64))
    with pytest.raises(LlamaError, match="hidden_layers"):
        tiny_llama(tokens, cache, hidden_layers=(llama_kit.TINY.n_layers + 1,))
    with pytest.raises(LlamaError, match="int64"):
        tiny_llama(torch.zeros(2, 4), cache)
    with pytest.raises(LlamaError, match="max_seq_len 64"):
        tiny_llama.new_cache(2, 65)
    with pytest.raises(LlamaError, match="n_heads must be a multiple"):
        replace(llama_kit.TINY, n_kv_heads=4)


def test_from_hf_rejects_other_architectures(tmp_path):
    with pytest.raises(LlamaError, match="config.json and"):
        Llama.from_hf(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "qwen2"}')
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(LlamaError, match="only plain Llama"):
        Llama.from_hf(tmp_path)


def test_config_is_frozen(llama_kit):
    with pytest.raises(AttributeError):
        llama_kit.TINY.dim = 8
    assert isinstance(llama_kit.TINY, LlamaConfig) and llama_kit.TINY.head_dim == 8

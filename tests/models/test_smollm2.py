"""The native Llama on the real SmolLM2-135M-Instruct: same weights, logits and greedy output as
transformers, and a tree pass equal to running each branch alone."""

import pytest
import torch

from genrec_spec.core.targets import HFTarget
from genrec_spec.models.llm.llama import Llama
from genrec_spec.models.llm.smollm2 import smollm2_hf_dir

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

TEXTS = [
    "The three primary colors are",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
]
TOL = {"rtol": 1e-4, "atol": 1e-3}  # fp32, logits of magnitude ~30


@pytest.fixture(scope="module")
def prompts(smollm2) -> list[list[int]]:
    """Three prompts of uneven length, one of them in the chat template."""
    _, tokenizer = smollm2
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is speculative decoding?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    ids = [tokenizer(text).input_ids for text in [*TEXTS[:2], chat]]
    assert len({len(p) for p in ids}) == 3
    return ids


def test_config_tokenizer_and_tied_embeddings(smollm2):
    model, tokenizer = smollm2
    c = model.config
    assert (c.n_layers, c.dim, c.n_heads, c.n_kv_heads, c.hidden_dim) == (30, 576, 9, 3, 1536)
    assert c.vocab_size == len(tokenizer) == 49152
    assert c.tie_embeddings and model.output is None  # the GGUF stores no output.weight
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|im_end|>", 2)


def test_gguf_weights_equal_transformers_conversion(smollm2):
    """from_gguf (our dequantisation and q/k un-permutation) gives exactly the tensors that
    transformers' GGUF reader wrote to the HF folder, which from_hf loads."""
    from_hf = Llama.from_hf(smollm2_hf_dir())
    assert from_hf.config == smollm2[0].config
    ours, theirs = smollm2[0].state_dict(), from_hf.state_dict()
    assert ours.keys() == theirs.keys()
    for name, tensor in ours.items():
        assert torch.equal(tensor, theirs[name]), name


@torch.no_grad()
def test_logits_and_hidden_states_match_transformers(smollm2, hf_smollm2, prompts, llama_kit):
    model, _ = smollm2
    cache, logits = llama_kit.prefill(model, prompts, max_len=64)
    last = torch.tensor([len(p) - 1 for p in prompts])
    _, hidden = model(
        logits[torch.arange(3), last].argmax(-1)[:, None], cache, hidden_layers=(0, 15, 30)
    )
    for b, prompt in enumerate(prompts):
        next_token = int(logits[b, len(prompt) - 1].argmax())
        ref = hf_smollm2(torch.tensor([prompt + [next_token]]), output_hidden_states=True)
        torch.testing.assert_close(logits[b, : len(prompt)], ref.logits[0, :-1], **TOL)
        for layer, h in hidden.items():
            torch.testing.assert_close(h[b, 0], ref.hidden_states[layer][0, -1], **TOL)


def hf_greedy(hf, prompt: list[int], steps: int) -> list[int]:
    """transformers' model decoding one row greedily with its own KV cache."""
    ids, past, out = torch.tensor([prompt]), None, []
    name = HFTarget(hf).cache_name  # the KV cache argument's name in this transformers
    for _ in range(steps):
        result = hf(ids, use_cache=True, **{name: past})
        past, ids = result[name], result.logits[:, -1:].argmax(-1)
        out.append(int(ids))
    return out


@torch.no_grad()
def test_greedy_output_equals_transformers(smollm2, hf_smollm2, prompts, llama_kit):
    """Our batched cached greedy decoding (B = 3, uneven prompts) equals transformers' greedy
    decoding of each prompt alone, token for token."""
    ours = llama_kit.greedy(smollm2[0], prompts, steps=24)
    assert ours == [hf_greedy(hf_smollm2, p, steps=24) for p in prompts]


@torch.no_grad()
def test_tree_pass_equals_branches_and_commit_equals_plain_decoding(smollm2, prompts, llama_kit):
    """A random tree per row (B = 2): each branch's logits equal that branch run as a chain on
    the same committed cache; committing one path then decoding equals a fresh prefill."""
    model, _ = smollm2
    rows = prompts[:2]
    cache, _ = llama_kit.prefill(model, rows, max_len=64)
    gen = torch.Generator().manual_seed(0)
    parents = llama_kit.random_parents(2, 8, gen)
    tokens = torch.randint(0, model.config.vocab_size, (2, 8), generator=gen)
    tree = model(tokens, cache, parents)
    paths = [llama_kit.root_to_leaf_paths(parents[b].tolist()) for b in range(2)]
    for b in range(2):
        for path in paths[b]:
            # Forward never touches committed entries, so the cache itself serves as the clone.
            chain = model(tokens[b, path].expand(2, -1), cache)
            torch.testing.assert_close(tree[b, path], chain[b], **TOL)

    model(tokens, cache, parents)  # the tree's K/V pending again
    longest = [max(p, key=len) for p in paths]
    keep = [len(longest[0]), 1]
    node_idx = torch.zeros(2, 8, dtype=torch.int64)
    for b in range(2):
        node_idx[b, : keep[b]] = torch.tensor(longest[b][: keep[b]])
    cache.commit(node_idx, torch.tensor(keep))
    step = model(torch.tensor([[11], [12]]), cache)
    for b, prompt in enumerate(rows):
        seq = prompt + tokens[b, node_idx[b, : keep[b]]].tolist() + [11 + b]
        torch.testing.assert_close(step[b, 0], llama_kit.chain_logits(model, seq)[-1], **TOL)

"""Helpers and models shared by the Llama tests, as fixtures: the suite imports test files in
importlib mode, where test modules cannot import each other."""

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from genrec_spec.models.llm.kv_cache import StaticKVCache
from genrec_spec.models.llm.llama import Llama, LlamaConfig

TINY = LlamaConfig(
    vocab_size=61,
    dim=48,
    n_layers=3,
    n_heads=6,
    n_kv_heads=2,
    hidden_dim=96,
    rope_theta=500.0,  # small, so positions a few tokens apart already rotate differently
    max_seq_len=64,
)
PROMPTS = [[5, 9, 2, 33, 7, 1, 8], [4, 60, 11], [12, 3, 3, 40, 22]]  # B = 3, uneven


def make_tiny_llama(tie_embeddings: bool = False, seed: int = 0) -> Llama:
    """TINY with default (random) initialisation from ``seed``, global RNG untouched."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return Llama(replace(TINY, tie_embeddings=tie_embeddings)).eval()


def prefill(
    model: Llama, prompts: list[list[int]], max_len: int
) -> tuple[StaticKVCache, torch.Tensor]:  # cache, logits [B, T, V]
    """The documented prefill: right-pad, one chain pass, commit each row's prompt length."""
    batch, width = len(prompts), max(map(len, prompts))
    tokens = torch.zeros(batch, width, dtype=torch.int64)
    for b, p in enumerate(prompts):
        tokens[b, : len(p)] = torch.tensor(p)
    cache = model.new_cache(batch, max_len)
    logits = model(tokens, cache)
    lengths = torch.tensor([len(p) for p in prompts])
    cache.commit(torch.arange(width).expand(batch, width), lengths)
    return cache, logits


def chain_logits(model: Llama, seq: list[int]) -> torch.Tensor:  # [len(seq), V]
    """Logits of one sequence run from scratch: the ground truth for cached/tree passes."""
    return model(torch.tensor([seq]), model.new_cache(1, len(seq)))[0]


def greedy(model: Llama, prompts: list[list[int]], steps: int) -> list[list[int]]:
    """Batched greedy decoding with the cache: one token per row and step."""
    cache, logits = prefill(model, prompts, max(map(len, prompts)) + steps)
    last = torch.tensor([len(p) - 1 for p in prompts])
    token = logits[torch.arange(len(prompts)), last].argmax(-1)  # [B]
    out = [token]
    for _ in range(steps - 1):
        logits = model(token[:, None], cache)
        cache.commit(torch.zeros(len(prompts), 1, dtype=torch.int64), torch.ones(len(prompts)))
        token = logits[:, 0].argmax(-1)
        out.append(token)
    return torch.stack(out, dim=1).tolist()


def random_parents(batch: int, n: int, generator: torch.Generator) -> torch.Tensor:  # [B, N]
    """A different random tree per row: node i's parent is uniform in -1 .. i-1."""
    high = torch.arange(n) + 1  # parent + 1 is uniform in 0 .. i
    return (torch.rand(batch, n, generator=generator) * high).long() - 1


def root_to_leaf_paths(parents: list[int]) -> list[list[int]]:
    """Each leaf's path of node indices, root side first."""
    leaves = sorted(set(range(len(parents))) - set(parents))
    paths = []
    for leaf in leaves:
        path = [leaf]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        paths.append(path[::-1])
    return paths


@pytest.fixture(scope="module")
def one_thread():
    """Decode-sized matmuls are faster on one thread on these 2-core machines (a thread wake-up
    per small op costs more than it saves); the previous setting returns after each module."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def llama_kit() -> SimpleNamespace:
    """The helpers above, for tests."""
    return SimpleNamespace(
        TINY=TINY,
        PROMPTS=PROMPTS,
        make_tiny_llama=make_tiny_llama,
        prefill=prefill,
        chain_logits=chain_logits,
        greedy=greedy,
        random_parents=random_parents,
        root_to_leaf_paths=root_to_leaf_paths,
    )


@pytest.fixture(scope="session")
def tiny_llama() -> Llama:
    """TINY with untied embeddings; tests must not change its weights."""
    return make_tiny_llama()


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M-Instruct (native, from the shipped GGUF) and its tokenizer."""
    from genrec_spec.models.llm.smollm2 import load_smollm2

    return load_smollm2()


@pytest.fixture(scope="session")
def hf_smollm2():
    """transformers' own LlamaForCausalLM on transformers' own conversion of the same GGUF."""
    from transformers import AutoModelForCausalLM

    from genrec_spec.models.llm.smollm2 import smollm2_hf_dir

    return AutoModelForCausalLM.from_pretrained(smollm2_hf_dir(), dtype=torch.float32).eval()

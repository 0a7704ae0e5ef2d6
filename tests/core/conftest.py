"""Tiny random language models and statistics helpers for the decoding-core tests, as fixtures
(the suite imports test files in importlib mode, where test modules cannot import each other)."""

import copy
from types import SimpleNamespace

import pytest
import torch

from genrec_spec.core.sampling import probabilities
from genrec_spec.models.llm.llama import Llama, LlamaConfig


class HashLM:
    """A causal toy LM whose next-token distribution depends on the whole prefix: a rolling
    hash h_t = (37 h_{t-1} + ids_t + 1) mod S picks a row of a seeded random logit table.
    ``like=other`` builds a correlated draft: the other's table plus ``noise`` times fresh
    Gaussian noise (same hash, so the two models disagree by a controlled amount).
    ``order=n`` hashes only the last n tokens (a Markov model: greedy text soon repeats, which
    n-gram drafters can exploit)."""

    def __init__(
        self,
        vocab: int,
        seed: int,
        scale: float = 2.0,
        states: int = 211,
        like: "HashLM | None" = None,
        noise: float = 1.0,
        order: int = 0,
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        fresh = torch.randn(states, vocab, generator=gen)
        self.table = scale * fresh if like is None else like.table + noise * fresh
        self.states = states
        self.vocab = vocab
        self.order = like.order if like is not None else order

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:  # [B, T] -> [B, T, V]
        hashes = []
        for t in range(ids.shape[1]):
            state = torch.zeros(ids.shape[0], dtype=torch.long)
            for s in range(max(0, t - self.order + 1) if self.order else 0, t + 1):
                state = (37 * state + ids[:, s] + 1) % self.states
            hashes.append(state)
        return self.table[torch.stack(hashes, dim=1)]


def exact_distribution(lm, prompt: list[int], length: int, sampling) -> torch.Tensor:
    """P(first `length` generated tokens) for every sequence, by enumeration: [V**length],
    sequences in row-major (lexicographic) order."""
    grid = torch.cartesian_prod(*[torch.arange(lm.vocab)] * length).view(-1, length)
    seqs = torch.cat([torch.tensor(prompt).expand(len(grid), -1), grid], dim=1)
    logits = lm(seqs)[:, len(prompt) - 1 : -1]  # [V**L, L, V]: the distribution of each token
    p = probabilities(logits, sampling).gather(2, grid[:, :, None]).squeeze(2)
    return p.double().prod(1)


def histogram(rows: list[list[int]], vocab: int, length: int) -> torch.Tensor:
    """Counts of each generated sequence (first `length` tokens): [V**length]."""
    seqs = torch.tensor([row[:length] for row in rows])
    index = sum(seqs[:, j] * vocab ** (length - 1 - j) for j in range(length))
    return torch.bincount(index, minlength=vocab**length).double()


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> float:
    """Pearson chi-square goodness-of-fit p-value; cells expected below min_expected are pooled
    into one cell. A sample outside the support gives p = 0."""
    n = counts.sum()
    if bool((counts[probs == 0] > 0).any()):
        return 0.0
    expected = probs * n
    small = expected < min_expected
    obs = torch.cat([counts[~small], counts[small].sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = ((obs - exp) ** 2 / exp).sum()
    dof = torch.tensor(float(len(obs) - 1))
    return float(torch.special.gammaincc(dof / 2, stat / 2))


def total_variation(counts: torch.Tensor, probs: torch.Tensor) -> float:
    return float(0.5 * (counts / counts.sum() - probs).abs().sum())


def tv_noise(probs: torch.Tensor, n: int) -> float:
    """Expected total variation of n exact samples from probs (normal approximation)."""
    return float(0.5 * (2 / torch.pi) ** 0.5 * (probs * (1 - probs) / n).sqrt().sum())


def naive_greedy(
    lm, prompts: list[list[int]], steps: int, eos: int | None = None
) -> list[list[int]]:
    """Greedy decoding by re-running the full sequence each token: the ground truth."""
    out = []
    for prompt in prompts:
        seq = list(prompt)
        for _ in range(steps):
            token = int(lm(torch.tensor([seq]))[0, -1].argmax())
            seq.append(token)
            if token == eos:
                break
        out.append(seq[len(prompt) :])
    return out


def sharpen(model, factor: float):
    """Scale random weights up so greedy paths are not all ties near uniform logits."""
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(factor)
    return model.eval()


def perturbed(model, seed: int, noise: float):
    """A correlated draft: the model's weights plus relative Gaussian noise."""
    draft = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(noise * p.std() * torch.randn(p.shape, generator=gen))
    return draft


def hf_llama(vocab: int, seed: int, scale: float):
    """A tiny random transformers Llama (2 layers, dim 32, GQA 4:2), sharpened by ``scale``."""
    from transformers import LlamaConfig as HFLlamaConfig
    from transformers import LlamaForCausalLM

    config = HFLlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    torch.manual_seed(seed)
    return sharpen(LlamaForCausalLM(config), scale).eval()


def native_llama(seed: int, vocab: int = 61) -> Llama:
    """A tiny random native Llama (2 layers, dim 32), sharpened."""
    config = LlamaConfig(
        vocab_size=vocab,
        dim=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        hidden_dim=64,
        rope_theta=500.0,
        max_seq_len=64,
    )
    torch.manual_seed(seed)
    return sharpen(Llama(config), 3.0)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny tensors and a 135M model at batch <= 3: a second thread only adds wake-up latency.
    Module-scoped so module fixtures that decode run with it too."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny():
    return SimpleNamespace(
        HashLM=HashLM,
        exact_distribution=exact_distribution,
        histogram=histogram,
        chi_square_p=chi_square_p,
        total_variation=total_variation,
        tv_noise=tv_noise,
        naive_greedy=naive_greedy,
        sharpen=sharpen,
        perturbed=perturbed,
        native_llama=native_llama,
        hf_llama=hf_llama,
    )

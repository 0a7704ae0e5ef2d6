"""Tiny random native Llama targets and distribution statistics for the drafter tests, as
fixtures (the suite imports test files in importlib mode, where test modules cannot import
each other; the statistics mirror tests/core's)."""

import argparse
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch

from genrec_spec import ControllerConfig, generate
from genrec_spec.core.sampling import probabilities
from genrec_spec.models.llm.llama import Llama, LlamaConfig


def tiny_llama(vocab: int, seed: int, dim: int = 32, scale: float = 3.0) -> Llama:
    """A random native Llama with weights scaled by ``scale`` (so next-token distributions are
    peaked, not near uniform); global RNG untouched."""
    config = LlamaConfig(
        vocab_size=vocab,
        dim=dim,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        hidden_dim=2 * dim,
        rope_theta=500.0,
        max_seq_len=160,  # EAGLE-3's training-time test scores 3 steps of 46 pairs at once
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = Llama(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(scale)
    return model


class ChainLM:
    """The model as a cache-free causal callable ids [B, T] -> logits [B, T, V]."""

    def __init__(self, model: Llama) -> None:
        self.model, self.vocab = model, model.config.vocab_size

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(ids, self.model.new_cache(*ids.shape))


def exact_distribution(lm, prompt: list[int], length: int, sampling) -> torch.Tensor:
    """P(first `length` generated tokens) for every sequence, by enumeration: [V**length]."""
    grid = torch.cartesian_prod(*[torch.arange(lm.vocab)] * length).view(-1, length)
    seqs = torch.cat([torch.tensor(prompt).expand(len(grid), -1), grid], dim=1)
    logits = lm(seqs)[:, len(prompt) - 1 : -1]  # [V**L, L, V]
    p = probabilities(logits, sampling).gather(2, grid[:, :, None]).squeeze(2)
    return p.double().prod(1)


def histogram(rows: list[list[int]], vocab: int, length: int) -> torch.Tensor:
    """Counts of each generated sequence (first `length` tokens): [V**length]."""
    seqs = torch.tensor([row[:length] for row in rows])
    index = sum(seqs[:, j] * vocab ** (length - 1 - j) for j in range(length))
    return torch.bincount(index, minlength=vocab**length).double()


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> float:
    """Pearson chi-square p-value, cells expected below min_expected pooled; p = 0 for a sample
    outside the support."""
    if bool((counts[probs == 0] > 0).any()):
        return 0.0
    expected = probs * counts.sum()
    small = expected < min_expected
    obs = torch.cat([counts[~small], counts[small].sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    obs, exp = obs[exp > 0], exp[exp > 0]
    stat = ((obs - exp) ** 2 / exp).sum()
    dof = torch.tensor(float(len(obs) - 1))
    return float(torch.special.gammaincc(dof / 2, stat / 2))


def total_variation(counts: torch.Tensor, probs: torch.Tensor) -> float:
    return float(0.5 * (counts / counts.sum() - probs).abs().sum())


def tv_noise(probs: torch.Tensor, n: int) -> float:
    """Expected total variation of n exact samples from probs (normal approximation)."""
    return float(0.5 * (2 / torch.pi) ** 0.5 * (probs * (1 - probs) / n).sqrt().sum())


# The exact-distribution check every drafter passes: the first LENGTH generated tokens of ROWS
# rows per prompt, on a vocabulary of VOCAB, against the enumerated distribution (512 sequences).
EXACT_VOCAB, EXACT_LENGTH, EXACT_ROWS = 8, 3, 6000
EXACT_PROMPTS = [[1, 2, 3, 1, 2], [5, 4], [6]]
GREEDY_PROMPTS = [[5, 9, 2, 33, 7, 1, 8], [4], [12, 3, 3, 40, 22]]  # B = 3, uneven, one of 1


def exact_target() -> Llama:
    """The target of the exact-distribution checks: flat enough that drafts get accepted."""
    return tiny_llama(EXACT_VOCAB, seed=0, scale=1.5)


def exactness(
    model: Llama, proposer, sampling, acceptance=None
) -> list[tuple[list[int], float, float, float]]:  # per prompt: prompt, p-value, TV, TV noise
    """Sample with ``proposer`` at full depth every step, check drafts were accepted at every
    depth (else the check has no teeth), and compare each prompt's histogram with the exact
    distribution; the caller asserts on the statistics (lossless: p-value and TV both fine)."""
    out = generate(
        model,
        [p for p in EXACT_PROMPTS for _ in range(EXACT_ROWS)],
        proposer=proposer,
        sampling=sampling,
        max_new_tokens=EXACT_LENGTH + 1,
        generator=torch.Generator().manual_seed(0),
        controller=ControllerConfig(adaptive=False),
        acceptance=acceptance,
    )
    assert all(a > 0 for a in out.stats.accepted_per_position)
    rows, stats = out.tolist(), []
    for i, prompt in enumerate(EXACT_PROMPTS):
        counts = histogram(rows[i * EXACT_ROWS : (i + 1) * EXACT_ROWS], EXACT_VOCAB, EXACT_LENGTH)
        probs = exact_distribution(ChainLM(model), prompt, EXACT_LENGTH, sampling)
        p_value = chi_square_p(counts, probs)
        stats.append((prompt, p_value, total_variation(counts, probs), tv_noise(probs, EXACT_ROWS)))
    return stats


def assert_exact(model: Llama, proposer, sampling) -> None:
    for prompt, p_value, tv, noise in exactness(model, proposer, sampling):
        assert p_value > 1e-3 and tv < 1.5 * noise, (prompt, p_value, tv, noise)


def assert_greedy(
    model: Llama,
    proposer,
    controller: ControllerConfig | None,
    min_accepted: float = 1.5,
    deep: int | None = 2,
):  # the proposer's generate output
    """``proposer`` decodes GREEDY_PROMPTS (B = 3, lengths 7, 1, 5) to plain greedy decoding's
    tokens. At full depth (``controller`` not adaptive) drafts were accepted, ``min_accepted``
    tokens a step and some at draft position ``deep``, so the check has teeth (the adaptive
    controller may stop drafting at low acceptance)."""
    plain = generate(model, GREEDY_PROMPTS, max_new_tokens=30).tolist()
    out = generate(
        model, GREEDY_PROMPTS, max_new_tokens=30, proposer=proposer, controller=controller
    )
    assert out.tolist() == plain
    if controller is not None and not controller.adaptive:
        assert out.stats.mean_accepted_length > min_accepted
        assert deep is None or out.stats.accepted_per_position[deep] > 0
    return out


def train_job(argv: list[str]) -> object:
    """``train-drafter``'s settings (a ``DrafterJob``) for the arguments ``argv``."""
    from genrec_spec.cli import train_drafter as train_cli

    parser = argparse.ArgumentParser()
    train_cli.add_arguments(parser)
    return train_cli.job_of(parser.parse_args(argv))


def train_cli_settings(argv: list[str]) -> tuple[object, str]:
    """``train-drafter``'s config for the arguments ``argv`` and the command line it records."""
    from genrec_spec.llm.training.pipeline import command_line, drafter_config

    job = train_job(argv)
    config = drafter_config(job)
    return config, command_line(job, config)


@contextmanager
def single_thread():
    """Tiny tensors: a second thread only adds wake-up latency on these 2-core machines (and
    costs 30x when other jobs load them)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    with single_thread():
        yield


@pytest.fixture(scope="session")
def kit() -> SimpleNamespace:
    return SimpleNamespace(
        tiny_llama=tiny_llama,
        ChainLM=ChainLM,
        exact_distribution=exact_distribution,
        histogram=histogram,
        chi_square_p=chi_square_p,
        total_variation=total_variation,
        tv_noise=tv_noise,
        exact_target=exact_target,
        exactness=exactness,
        assert_exact=assert_exact,
        assert_greedy=assert_greedy,
        train_cli=train_cli_settings,
        train_job=train_job,
        EXACT_VOCAB=EXACT_VOCAB,
        EXACT_LENGTH=EXACT_LENGTH,
    )


@pytest.fixture(scope="session")
def distilled(tmp_path_factory) -> SimpleNamespace:
    """A tiny target at weight scale 1 (whose greedy text falls into loops that drafters can
    learn) and its self-distillation data on random prompts plus GREEDY_PROMPTS (so drafts on
    those get accepted), cached in a temporary folder."""
    from genrec_spec.llm.training.selfdistill import load_or_distill

    with single_thread():  # session fixtures run before the module's one_thread
        model = tiny_llama(61, seed=0, scale=1.0)
        gen = torch.Generator().manual_seed(1)
        prompts = [
            torch.randint(
                0, 61, (int(torch.randint(1, 8, (1,), generator=gen)),), generator=gen
            ).tolist()
            for _ in range(24)
        ] + GREEDY_PROMPTS
        cache = tmp_path_factory.mktemp("cache")
        data = load_or_distill(model, prompts, 40, 9, cache_dir=cache, progress=False)
    return SimpleNamespace(model=model, prompts=prompts, data=data, cache=cache)


@pytest.fixture(scope="session")
def trained(distilled, tmp_path_factory) -> SimpleNamespace:
    """Medusa heads trained briefly on the tiny target's own continuations, saved to a folder."""
    from genrec_spec.llm.training.medusa import MedusaConfig, train_medusa

    model, data = distilled.model, distilled.data
    with single_thread():
        folder = tmp_path_factory.mktemp("drafter") / "medusa"
        config = MedusaConfig(steps=150, batch_positions=128, held_out=0.2)
        manifest = train_medusa(model, data, config, folder, {"command": "test"}, progress=False)
    return SimpleNamespace(
        model=model,
        data=data,
        folder=folder,
        manifest=manifest,
        config=config,
        greedy_prompts=GREEDY_PROMPTS,  # also among the training prompts: drafts get accepted
    )


def train_on_pairs(distilled, tmp_path_factory, kind: str, train, config) -> SimpleNamespace:
    """A drafter trained by ``train`` (``train_eagle``'s signature: it reads the prompts' pairs
    too) briefly on the tiny target's data with ``config``, saved to a folder."""
    from genrec_spec.llm.training.selfdistill import load_or_prefill

    model, data = distilled.model, distilled.data
    with single_thread():
        context = load_or_prefill(model, distilled.prompts, 9, cache_dir=distilled.cache)
        folder = tmp_path_factory.mktemp("drafter") / kind
        manifest = train(model, data, context, config, folder, {"command": "test"}, progress=False)
    return SimpleNamespace(
        model=model,
        data=data,
        context=context,
        prompts=distilled.prompts,
        cache=distilled.cache,
        folder=folder,
        manifest=manifest,
        config=config,
        greedy_prompts=GREEDY_PROMPTS,
    )


@pytest.fixture(scope="session")
def trained_eagle(distilled, tmp_path_factory) -> SimpleNamespace:
    """An EAGLE feature drafter trained briefly on the same data (with the prompts' pairs)."""
    from genrec_spec.llm.training.eagle import EagleConfig, train_eagle

    config = EagleConfig(steps=150, held_out=0.2, eval_depth=4)
    return train_on_pairs(distilled, tmp_path_factory, "eagle", train_eagle, config)


@pytest.fixture(scope="session")
def trained_eagle3(distilled, tmp_path_factory) -> SimpleNamespace:
    """An EAGLE-3 drafter (the tiny target's layers 0, 1, 2 fused) trained briefly on the same
    data with a 3-step training-time test."""
    from genrec_spec.llm.training.eagle3 import Eagle3Config, train_eagle3
    from genrec_spec.llm.training.selfdistill import load_or_prefill

    model, data, prompts = distilled.model, distilled.data, distilled.prompts
    with single_thread():
        context = load_or_prefill(model, prompts, 9, cache_dir=distilled.cache)
        folder = tmp_path_factory.mktemp("drafter") / "eagle3"
        config = Eagle3Config(steps=150, held_out=0.2, eval_depth=4)
        manifest = train_eagle3(
            model, data, context, prompts, config, folder, {"command": "test"}, progress=False
        )
    return SimpleNamespace(
        model=model,
        data=data,
        context=context,
        prompts=prompts,
        folder=folder,
        manifest=manifest,
        config=config,
        greedy_prompts=GREEDY_PROMPTS,
    )


@pytest.fixture(scope="session")
def trained_mtp(distilled, tmp_path_factory) -> SimpleNamespace:
    """Three MTP modules trained briefly on the same data (with the prompts' pairs)."""
    from genrec_spec.llm.training.mtp import MTPConfig, train_mtp

    config = MTPConfig(steps=150, depths=3, held_out=0.2)
    return train_on_pairs(distilled, tmp_path_factory, "mtp", train_mtp, config)


@pytest.fixture(scope="session")
def trained_layerskip(distilled, tmp_path_factory) -> SimpleNamespace:
    """An exit head after layer 1 of the tiny target's 2, trained briefly on the same data."""
    from genrec_spec.llm.training.layerskip import LayerSkipConfig, train_layerskip

    model, data = distilled.model, distilled.data
    with single_thread():
        folder = tmp_path_factory.mktemp("drafter") / "layerskip"
        config = LayerSkipConfig(
            n_layers=1,
            hidden_dim=64,
            steps=200,
            batch_positions=128,
            top_k=61,
            draft_vocab=0,
            held_out=0.2,
            eval_depth=4,
        )
        manifest = train_layerskip(
            model, distilled.prompts, data, config, folder, {"command": "test"}, progress=False
        )
    return SimpleNamespace(
        model=model,
        data=data,
        prompts=distilled.prompts,
        folder=folder,
        manifest=manifest,
        config=config,
        greedy_prompts=GREEDY_PROMPTS,
    )

"""A native Llama decodes exactly whichever CPU linear path is forced (``models.llm.cpu_linear``:
``GENREC_SPEC_CPU_LINEAR``): greedy decoding equals the cache-free loop and speculative greedy
equals plain; speculative sampling matches the exact distribution by enumeration (chi-square
and total variation, as tests/core/test_core_exactness.py does for the callable targets)."""

import pytest
import torch

from genrec_spec import ControllerConfig, NativeTarget, SamplingParams, generate
from genrec_spec.llm.proposers import DraftModelProposer
from genrec_spec.models.llm import cpu_linear

PATHS = cpu_linear.available_paths()


@pytest.mark.parametrize("path", PATHS)
def test_native_greedy_is_exact_under_each_path(tiny, path, linear_mode):
    linear_mode(path)
    model = tiny.native_llama(0)
    prompts = [[5, 9, 2, 33, 7, 5, 9, 2, 8], [4, 60], [12, 3, 3, 40, 22, 3]]
    plain = generate(NativeTarget(model), prompts, max_new_tokens=12)
    assert plain.tolist() == tiny.naive_greedy(
        lambda ids: model(ids, model.new_cache(ids.shape[0], ids.shape[1])), prompts, 12
    )
    draft_model = tiny.perturbed(model, 1, 0.05)
    draft = DraftModelProposer(NativeTarget(draft_model), k=3, width=2, children="top")
    spec = generate(NativeTarget(model), prompts, proposer=draft, max_new_tokens=12)
    assert spec.tolist() == plain.tolist()


@pytest.mark.parametrize("path", PATHS)
def test_native_sampling_is_exact_under_each_path(tiny, path, linear_mode):
    """Speculative sampling (a two-level tree drawn without replacement) against the exact
    distribution of the first 2 tokens (64 sequences), for two prompts of different lengths."""
    linear_mode(path)
    vocab, length, rows = 8, 2, 10000
    model = tiny.native_llama(2, vocab)
    sampling = SamplingParams(1.0)
    prompts = [[1, 2, 3, 1, 2], [5, 4]]
    out = generate(
        NativeTarget(model),
        [p for p in prompts for _ in range(rows)],
        proposer=DraftModelProposer(NativeTarget(tiny.perturbed(model, 3, 0.05)), k=2, width=2),
        sampling=sampling,
        max_new_tokens=length,
        generator=torch.Generator().manual_seed(0),
        controller=ControllerConfig(adaptive=False),
    ).tolist()

    class AsLM:  # the cache-free callable the enumeration reads
        def __init__(self):
            self.vocab = vocab

        def __call__(self, ids):
            return model(ids, model.new_cache(ids.shape[0], ids.shape[1]))

    for i, prompt in enumerate(prompts):
        counts = tiny.histogram(out[i * rows : (i + 1) * rows], vocab, length)
        probs = tiny.exact_distribution(AsLM(), prompt, length, sampling)
        assert tiny.chi_square_p(counts, probs) > 1e-3
        assert tiny.total_variation(counts, probs) < 1.5 * tiny.tv_noise(probs, rows)

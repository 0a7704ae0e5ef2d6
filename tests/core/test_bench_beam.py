"""`genrec-spec bench beam` on tiny models: every method runs (speculative ones drafting the
catalogue's continuations, or by prompt lookup without one), ours equal transformers' beam
search under a catalogue and without one, and the table prints."""

import pytest
import torch

from genrec_spec.bench.beam import (
    BenchBeamConfig,
    Workload,
    benchmark,
    format_table,
    hf_allowed_tokens,
)
from genrec_spec.bench.errors import BenchError
from genrec_spec.core.constraints import Catalogue
from genrec_spec.models.llm.llama import Llama

VOCAB, EOS = 40, 3


@pytest.fixture(scope="module")
def pair(tiny, tmp_path_factory):
    hf = tiny.hf_llama(VOCAB, seed=0, scale=2.5)
    folder = tmp_path_factory.mktemp("bench_beam_llama")
    hf.save_pretrained(folder)
    return Llama.from_hf(folder), hf


@pytest.mark.parametrize("constrained", [True, False])
def test_bench_beam_rows(pair, constrained):
    check_rows(*pair, constrained)


def check_rows(native, hf, constrained: bool) -> None:
    prompts = [[5, 9, 2, 33, 7], [4, 7, 8], [12, 30, 3, 20]]
    catalogue = allowed = None
    if constrained:
        items = [[4 + i % 5, 10 + i, 20 + i % 7] for i in range(18)] + [[9], [9, 30]]
        catalogue = Catalogue.of(items, VOCAB, eos_token_id=EOS)
        allowed = hf_allowed_tokens(catalogue, EOS)
    longest = catalogue.trie.longest if catalogue else 6
    work = Workload(prompts, catalogue, allowed, longest, EOS)
    config = BenchBeamConfig(
        beam_widths=(3,), k=2, batch_sizes=(1, 2), requests=3, repeats=1, draft_depth=4
    )
    rows = benchmark(native, hf, work, config, log=lambda line: None)
    # unconstrained, spec drafts by prompt lookup
    assert {r.method for r in rows} == {"hf", "beam", "spec", "hft-beam", "hft-spec"}
    assert all(r.exact == "3/3" for r in rows), format_table(rows)
    assert all(r.passes_per_request >= 1 for r in rows if r.method != "hf")
    assert "vs-hf" in format_table(rows)


def test_bad_settings_are_refused():
    with pytest.raises(BenchError, match="unknown methods"):
        BenchBeamConfig(methods=("hf", "greedy"))
    with pytest.raises(BenchError, match="unknown task"):
        BenchBeamConfig(task="poems")
    with pytest.raises(BenchError, match=">= 1"):
        BenchBeamConfig(beam_widths=(0,))
    with pytest.raises(BenchError, match="unknown pass cost"):
        BenchBeamConfig(pass_cost="free")
    with pytest.raises(BenchError, match="unknown device"):
        BenchBeamConfig(device="gpu0")
    if not torch.cuda.is_available():
        with pytest.raises(BenchError, match="no CUDA GPU"):
            BenchBeamConfig(device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("constrained", [True, False])
# transformers warns when generate's inputs are not on the model's device (they were once)
@pytest.mark.filterwarnings("error:You are calling .generate:UserWarning")
def test_bench_beam_rows_on_a_gpu(pair, constrained):
    """The same rows with both models on the GPU (`--device cuda`): every search's tables live
    beside its target's outputs there, and ours still equal transformers' (whose inputs are
    moved to the model's device)."""
    import copy

    check_rows(*(copy.deepcopy(m).to("cuda") for m in pair), constrained)

"""`genrec-spec bench llm` and its greedy-exactness check: the verdicts of compare_greedy on a
target with a planted tie; the whole benchmark on a tiny random Llama loaded both natively and
in transformers (same weights), B > 1 with uneven prompts, greedy and sampled; the CLI on the
real SmolLM2 (slow)."""

import argparse
import json

import pytest
import torch

from genrec_spec import CallableTarget
from genrec_spec.bench.llm import benchmark, format_table, time_methods
from genrec_spec.bench.llm_config import CPU_ONLY, HF_BATCH_1, METHODS, BenchLLMConfig
from genrec_spec.bench.llm_runners import make_runners
from genrec_spec.core.greedy_check import compare_greedy, first_divergence
from genrec_spec.core.types import SamplingParams
from genrec_spec.models.llm.llama import Llama

VOCAB = 8


def planted_tie_lm(ids: torch.Tensor) -> torch.Tensor:  # [B, T] -> [B, T, V]
    """Next token = last token + 1 (mod V), except after token 3, where 4 and 5 tie exactly."""
    logits = torch.nn.functional.one_hot((ids + 1) % VOCAB, VOCAB).float()
    logits[..., 5] += (ids == 3).float()
    return logits


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 9, 3]) == 1
    assert first_divergence([1, 2, 3], [1, 2]) == 2


def test_compare_greedy_verdicts():
    prompts = [[1], [0, 1], [6], [1], [1]]
    expected = [[2, 3, 4, 5], [2, 3, 4, 5], [7, 0, 1, 2], [2, 3, 4, 5], [2, 3, 4, 5]]
    got = [
        [2, 3, 5, 6],  # took the other side of the tie after token 3
        [2, 3, 4, 5],
        [7, 0, 2, 3],  # a real error: after 0 the next token is clearly 1
        [2, 3, 6, 7],  # at the tie, but 6 is not one of the tied pair (4, 5)
        [2, 3],  # stopped at the tie: no token is not a tied token
    ]
    verdicts = compare_greedy(CallableTarget(planted_tie_lm), prompts, expected, got)
    assert verdicts == ["tie@2", "yes", "no@2", "no@2", "no@2"]


@pytest.fixture(scope="module")
def tiny_pair(tiny, tmp_path_factory):
    """The same random weights in transformers and as the native Llama."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    hf = tiny.hf_llama(61, seed=0, scale=4.0)
    hf.save_pretrained(folder)
    return Llama.from_hf(folder), hf


def test_benchmark_on_tiny_models(tiny_pair):
    native, hf = tiny_pair
    prompts = [[5, 9, 2, 33, 7, 5, 9, 2, 8], [4, 60], [12, 3, 3, 40, 22, 3]]  # uneven
    settings = BenchLLMConfig(
        methods=METHODS,
        max_new_tokens=6,
        batch_sizes=(1, 2),
        temperatures=(0.0, 0.8),
        repeats=2,
        k=3,
        draft_layers=1,
        warmup_tokens=2,
    )
    lines = []
    rows = benchmark(native, hf, prompts, settings, eos=None, log=lines.append)
    assert len(lines) == 2 * 2 * 2  # one line per (B, T, repeat)
    # Every method at every (B, T), but HF's assisted generation only at batch 1.
    assert [(r.method, r.batch_size, r.temperature) for r in rows] == [
        (m, b, t)
        for b in (1, 2)
        for t in (0.0, 0.8)
        for m in METHODS
        if b == 1 or m not in HF_BATCH_1
    ]
    for row in rows:
        assert row.tokens_per_s > 0 and len(row.tokens_per_s_repeats) == 2
        assert row.vs_hf is not None
        if row.temperature == 0.0:
            # Every method, HF's own generate included, reproduces plain greedy decoding.
            assert row.exact == "ref" if row.method == "none" else row.exact == "yes", row
        else:
            assert row.exact == "-"
        if row.method.startswith("hf"):
            assert row.accepted_length is None and row.acceptance == ()
        else:
            assert row.accepted_length >= 1.0
            assert all(0.0 <= a <= 1.0 for a in row.acceptance)
        if row.method == "none":
            assert row.speedup == 1.0 and row.accepted_length == 1.0
    table = format_table(rows)
    assert all(method in table for method in METHODS)


def test_no_controller_drafts_full_depth(tiny_pair):
    """--pass-cost none: every step of every row drafts the proposer's full depth (the draft
    method always has k tokens to offer) but the first, whose token the prefill scored, and
    greedy output stays plain decoding's."""
    native, _ = tiny_pair
    prompts = [[5, 9, 2, 33, 7, 5, 9, 2, 8], [4, 60], [12, 3, 3, 40, 22, 3]]
    settings = BenchLLMConfig(
        methods=("none", "draft"), max_new_tokens=6, k=3, draft_layers=1, pass_cost="none"
    )
    runners = make_runners(native, None, settings, eos=None)
    tallies = time_methods(runners, [prompts[:2], prompts[2:]], SamplingParams(0.0), settings)
    (draft,), (plain,) = tallies["draft"], tallies["none"]
    assert draft.drafted == [draft.row_steps - len(prompts)] * 3
    assert draft.row_steps < plain.row_steps
    assert draft.outputs == plain.outputs


@pytest.fixture(scope="module")
def draft_cache(tiny_pair, tmp_path_factory):
    """A cache folder holding a one-layer draft model trained briefly for the tiny target, where
    the benchmark's distilled and hf-assist methods look for it (drafters/draft)."""
    from genrec_spec.llm.training.distill import DistillConfig, train_distilled
    from genrec_spec.llm.training.selfdistill import load_or_distill, load_or_prefill

    native, _ = tiny_pair
    cache = tmp_path_factory.mktemp("cache")
    prompts = [[5, 9, 2, 33, 7, 5, 9, 2, 8], [4, 60], [12, 3, 3, 40, 22, 3], [7, 7, 1]]
    data = load_or_distill(native, prompts, 12, 4, cache_dir=cache, progress=False)
    context = load_or_prefill(native, prompts, 4, cache_dir=cache)
    config = DistillConfig(layers=(1,), steps=20, batch_rows=2, held_out=0.25)
    train_distilled(native, data, context, prompts, config, cache / "drafters" / "draft", {}, False)
    return cache


def test_benchmark_on_request_methods(tiny_pair, draft_cache, monkeypatch):
    """Our distilled draft, in our decoder and as HF generate's assistant_model, and HF's early
    exit (both batch 1 only), greedy and sampled: greedy, all reproduce plain decoding; the HF
    ones count as HF options for vs-hf."""
    native, hf = tiny_pair
    monkeypatch.setenv("GENREC_SPEC_CACHE", str(draft_cache))
    prompts = [[5, 9, 2, 33, 7, 5, 9, 2, 8], [4, 60], [12, 3, 3, 40, 22, 3]]
    methods = ("none", "distilled", "hf-assist", "hf-early-exit")
    settings = BenchLLMConfig(
        methods=methods,
        max_new_tokens=6,
        batch_sizes=(1, 2),
        temperatures=(0.0, 0.8),
        k=3,
        draft_layers=1,  # HF's early exit after 1 of the 2 layers
        warmup_tokens=2,
    )
    rows = benchmark(native, hf, prompts, settings, eos=None)
    assert [(r.method, r.batch_size, r.temperature) for r in rows] == [
        (m, b, t)
        for b in (1, 2)
        for t in (0.0, 0.8)
        for m in methods
        if b == 1 or m not in HF_BATCH_1
    ]
    for row in rows:
        if row.temperature == 0.0:
            assert row.exact == ("ref" if row.method == "none" else "yes"), row
        assert (row.vs_hf is None) == (row.batch_size == 2)  # no HF option ran at B = 2
        if row.method == "distilled":
            assert row.accepted_length >= 1.0 and len(row.acceptance) == 3


def parse(argv: list[str]) -> argparse.Namespace:
    from genrec_spec.cli import bench_llm

    parser = argparse.ArgumentParser()
    bench_llm.add_arguments(parser)
    return parser.parse_args(argv)


@pytest.mark.gpu
def test_benchmark_on_tiny_models_on_a_gpu(tiny_pair):
    import copy

    native, hf = (copy.deepcopy(m).to("cuda") for m in tiny_pair)
    methods = tuple(m for m in METHODS if m not in CPU_ONLY)
    settings = BenchLLMConfig(
        methods=methods, max_new_tokens=6, batch_sizes=(1, 2), temperatures=(0.0, 0.8), k=3,
        draft_layers=1, warmup_tokens=2, device="cuda",
    )  # fmt: skip
    rows = benchmark(native, hf, [[5, 9, 2, 33, 7, 5, 9, 2, 8], [4, 60]], settings, eos=None)
    assert {r.method for r in rows} == set(methods)
    assert all(r.tokens_per_s > 0 for r in rows)
    assert all(r.exact == "yes" for r in rows if r.temperature == 0.0 and r.method != "none")


def test_settings_and_bad_input():
    from genrec_spec.cli.bench_llm import settings_from

    c = BenchLLMConfig()
    quick = settings_from(parse(["--quick", "--n", "3", "--methods", "ngram,none,hf"]))
    assert quick.n == 3 and quick.max_new_tokens == c.quick_max_new_tokens
    assert quick.batch_sizes == c.quick_batch_sizes and quick.temperatures == (0.0, 0.8)
    assert quick.methods == ("none", "ngram", "hf")  # the baseline first
    trained = settings_from(parse(["--methods", "medusa,eagle,eagle2,distilled,hf-assist"]))
    # run when asked for
    assert trained.methods == ("none", "medusa", "eagle", "eagle2", "distilled", "hf-assist")
    default = settings_from(parse(["--batch-sizes", "1,8", "--temperatures", "0,0.8"]))
    assert default.n == c.n and default.batch_sizes == (1, 8) and default.temperatures == (0, 0.8)
    assert default.tree_nodes is None and default.pass_cost == "measured"
    wide = ["--pass-cost", "none", "--tree-nodes", "60", "--tree-top-k", "10", "--tree-depth", "8"]
    wide = settings_from(parse(["--methods", "eagle2", *wide]))
    assert (wide.pass_cost, wide.tree_nodes, wide.tree_top_k, wide.tree_depth) == (
        "none",
        60,
        10,
        8,
    )
    on_gpu = settings_from(parse(["--device", "cuda"]))  # the default methods that run there
    assert on_gpu.device == "cuda" and not set(on_gpu.methods) & set(CPU_ONLY)
    assert set(on_gpu.methods) == set(c.methods) - set(CPU_ONLY)
    with pytest.raises(ValueError, match="run on the CPU only"):
        settings_from(parse(["--device", "cuda", "--methods", "none,quant"]))
    with pytest.raises(ValueError, match="unknown methods"):
        settings_from(parse(["--methods", "none,bogus"]))
    with pytest.raises(ValueError, match="use them with eagle2 or eagle3"):
        settings_from(parse(["--methods", "ngram,eagle", "--tree-top-k", "10"]))
    with pytest.raises(ValueError, match="use them with eagle2 or eagle3"):
        settings_from(parse(["--methods", "ngram", "--tree-depth", "8"]))
    with pytest.raises(ValueError, match=">= 1"):
        settings_from(parse(["--batch-sizes", "0,8"]))
    with pytest.raises(ValueError, match="temperatures"):
        settings_from(parse(["--temperatures=-1,2"]))


@pytest.mark.slow
def test_bench_llm_cli_on_smollm2(smollm2_model, monkeypatch, tmp_path, capsys):
    """The command end to end on the real model: every method of batch 2 (uneven prompts),
    greedy; all exact."""
    from genrec_spec.cli import bench_llm
    from genrec_spec.models.llm import smollm2

    monkeypatch.setattr(smollm2, "load_smollm2", lambda: smollm2_model)
    out, prompts = tmp_path / "bench.json", tmp_path / "prompts.txt"
    prompts.write_text("def fib(n):\nThe quick brown fox jumps over the lazy dog. The quick fox\n")
    argv = ["--prompts", str(prompts), "--split", "all", "--n", "2", "--max-new-tokens", "4"]
    argv += ["--batch-sizes", "2", "--json", str(out)]
    assert bench_llm.run(parse(argv)) == 0
    printed = capsys.readouterr().out
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert [row["method"] for row in rows] == [m for m in METHODS if m not in HF_BATCH_1]
    for row in rows:
        assert row["exact"] == "ref" or row["exact"].startswith(("yes", "tie@")), row
        assert row["method"] in printed
    assert report["settings"]["n"] == 2 and len(report["load_average"]) == 2


def test_settings_for_the_gemma3_target():
    """--model gemma3: cross-tokenizer drafting and HF's universal assisted generation by
    default; methods that need the native SmolLM2 are refused, as cross is on SmolLM2."""
    from genrec_spec.bench.llm_config import GEMMA3_METHODS
    from genrec_spec.cli.bench_llm import settings_from

    gemma = settings_from(parse(["--model", "gemma3"]))
    assert gemma.model == "gemma3" and gemma.methods == GEMMA3_METHODS
    picked = settings_from(parse(["--model", "gemma3", "--methods", "ngram,cross"]))
    assert picked.methods == ("none", "ngram", "cross")
    with pytest.raises(ValueError, match="--model gemma3 runs only"):
        settings_from(parse(["--model", "gemma3", "--methods", "none,eagle"]))
    with pytest.raises(ValueError, match="cross and hf-uag: --model gemma3"):
        settings_from(parse(["--methods", "none,hf-uag"]))


def test_llama_cpp_without_its_package_says_how_to_get_it(monkeypatch):
    """llama-cpp is on request and needs llama-cpp-python, which is not a dependency."""
    import sys

    from genrec_spec.bench.errors import BenchError
    from genrec_spec.bench.llm_runners import llama_cpp

    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # as if not installed
    with pytest.raises(BenchError, match="pip install llama-cpp-python"):
        llama_cpp(threads=1, eos=None)

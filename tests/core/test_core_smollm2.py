"""Greedy speculative decoding on the real SmolLM2-135M-Instruct (native Llama from the shipped
GGUF) equals plain greedy decoding for every proposer; a divergence is tolerated only where the
target's top-2 logits are a numerical tie (< 1e-4 apart), and the test checks that."""

import pytest
import torch

from genrec_spec import ControllerConfig, NativeTarget, generate
from genrec_spec.core.greedy_check import compare_greedy
from genrec_spec.core.types import DecodeInputError
from genrec_spec.llm.proposers import (
    DraftModelProposer,
    LookaheadProposer,
    PromptLookup,
    TrieProposer,
    layer_skip_copy,
)
from genrec_spec.llm.proposers.quantized import QuantizedSelfProposer
from genrec_spec.models.llm.quantized_draft import QuantizedDraft
from genrec_spec.models.llm.smollm2 import smollm2_gguf_path

pytestmark = pytest.mark.slow

PROMPTS = [
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n",
    "<|im_start|>user\nCount from 1 to 10.<|im_end|>\n<|im_start|>assistant\n",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
]


@pytest.fixture(scope="module")
def smollm2(smollm2_model):
    model, tokenizer = smollm2_model
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    plain = generate(model, prompts, max_new_tokens=24).tolist()
    return model, prompts, plain


def check_against_plain(model, prompts, plain, out):
    """Equal, or diverging only after a top-2 tie of the target at the divergence point."""
    verdicts = compare_greedy(model, prompts, plain, out)
    assert all(v == "yes" or v.startswith("tie@") for v in verdicts), (verdicts, plain, out)


PROPOSERS = {
    "prompt-lookup": lambda model: PromptLookup(k=4),
    "trie": lambda model: TrieProposer(k=4, max_nodes=12),
    "lookahead": lambda model: LookaheadProposer(window=4, ngram=3, verify=4),
    "draft-layer-skip": lambda model: DraftModelProposer(
        NativeTarget(layer_skip_copy(model, 10)), k=3, width=2, children="top"
    ),
    "quantized-self": lambda model: QuantizedSelfProposer(
        QuantizedDraft.from_gguf(model, smollm2_gguf_path()), k=6
    ),
}


@pytest.mark.parametrize("name", PROPOSERS)
def test_smollm2_speculative_greedy_equals_plain(smollm2, name):
    model, prompts, plain = smollm2
    with torch.inference_mode():
        out = generate(
            model,
            prompts,
            max_new_tokens=24,
            proposer=PROPOSERS[name](model),
            controller=ControllerConfig(adaptive=False),
        )
        check_against_plain(model, prompts, plain, out.tolist())
    # Every forward drafts but the prefill, which scores the first token
    assert out.stats.speculative_forwards == out.stats.target_forwards - 1
    assert out.stats.mean_accepted_length > 1.0  # drafts were accepted on real text


def test_generate_cli(smollm2_model, monkeypatch, capsys, tmp_path):
    """`genrec-spec generate` options end to end: lookahead prints plain decoding's text, its
    controller drafting against the target's pass cost, timed once into the cache, and the
    same text with no controller (--pass-cost none: the full draft every step); EAGLE-2's
    tree options with a method that drafts no such tree are refused before any loading."""
    import argparse
    import json

    from genrec_spec.cli import generate as generate_cli
    from genrec_spec.models.llm import smollm2

    monkeypatch.setattr(smollm2, "load_smollm2", lambda: smollm2_model)
    monkeypatch.setenv("GENREC_SPEC_CACHE", str(tmp_path))
    texts = {}
    runs = {"none": [], "lookahead": [], "full": ["--pass-cost", "none"]}
    for name, options in runs.items():
        parser = argparse.ArgumentParser()
        generate_cli.add_arguments(parser)
        args = parser.parse_args(
            [
                *options,
                "--method",
                "lookahead" if name == "full" else name,
                "--prompt",
                PROMPTS[2],
                "--prompt",
                PROMPTS[0],
                "--max-new-tokens",
                "12",
                "--batch-size",
                "2",
                "--json",
            ]
        )
        assert generate_cli.run(args) == 0
        report = json.loads(capsys.readouterr().out)
        texts[name] = [r["text"] for r in report["results"]]
        assert report["summary"]["generated_tokens"] == 24
    assert texts["none"] == texts["lookahead"] == texts["full"]
    assert len(list((tmp_path / "pass_cost").glob("*.json"))) == 1
    parser = argparse.ArgumentParser()
    generate_cli.add_arguments(parser)
    args = parser.parse_args(["--method", "ngram", "--prompt", "x", "--tree-nodes", "60"])
    with pytest.raises(DecodeInputError, match="no chosen method drafts"):
        generate_cli.run(args)


def test_generate_cli_beam_search(smollm2_model, monkeypatch, capsys, tmp_path):
    """`genrec-spec generate --num-beams`: each prompt's K best sequences with their scores;
    prompt-lookup drafts (--method ngram) give plain beam search's sequences; beam search with
    sampling or a single-path method, or K > W, is refused before any loading."""
    import argparse
    import json

    from genrec_spec.cli import generate as generate_cli
    from genrec_spec.core.beam import BeamConfig, beam_search
    from genrec_spec.models.llm import smollm2

    model, tokenizer = smollm2_model
    monkeypatch.setattr(smollm2, "load_smollm2", lambda: smollm2_model)
    monkeypatch.setenv("GENREC_SPEC_CACHE", str(tmp_path))

    def run(*options):
        parser = argparse.ArgumentParser()
        generate_cli.add_arguments(parser)
        return generate_cli.run(parser.parse_args(list(options)))

    common = ["--prompt", PROMPTS[0], "--prompt", PROMPTS[2], "--max-new-tokens", "10"]
    common += ["--num-beams", "3", "--num-return-sequences", "2", "--batch-size", "2"]
    reports = {}
    for method in ("none", "ngram"):
        assert run(*common, "--method", method, "--json") == 0
        reports[method] = json.loads(capsys.readouterr().out)
    expected = beam_search(
        model,
        [tokenizer(p)["input_ids"] for p in (PROMPTS[0], PROMPTS[2])],
        config=BeamConfig(num_beams=3, num_return_sequences=2),
        max_new_tokens=10,
        eos_token_id=tokenizer.eos_token_id,
    )
    for report in reports.values():
        for result, sequences, scores in zip(
            report["results"], expected.tolist(), expected.scores.tolist(), strict=True
        ):
            assert [b["text"] for b in result["beams"]] == [tokenizer.decode(s) for s in sequences]
            assert [b["score"] for b in result["beams"]] == pytest.approx(scores, abs=1e-4)
            assert result["text"] == result["beams"][0]["text"]
        assert report["summary"]["target_forwards"] >= 1
    assert run(*common, "--method", "ngram") == 0  # the text table: K beams a prompt, scored
    assert capsys.readouterr().out.count("[score ") == 4
    refused = {
        "deterministic": ["--temperature", "0.7"],
        "cannot draft for beam search": ["--method", "lookahead"],
        "num-return-sequences": ["--num-return-sequences", "4"],
    }
    for message, options in refused.items():
        with pytest.raises(DecodeInputError, match=message):
            run(*common, *options)

"""Generate text with SmolLM2-135M-Instruct (the native Llama from the shipped GGUF), plainly or
with a speculative method, and print the text and the decoding statistics. The trained methods
load their drafter from --drafter (made by `genrec-spec train-drafter`). All methods are
lossless: the text is what plain decoding gives (greedy) or is distributed as it (sampling).
Example:

    genrec-spec generate --method lookahead --prompt "def fib(n):" --max-new-tokens 64

``--model gemma3`` decodes with Gemma-3-270M instead (a transformers model), with the
model-free methods or cross (cross-tokenizer drafting by SmolLM2-135M):

    genrec-spec generate --model gemma3 --method cross --prompt "def fib(n):"

``--num-beams W`` runs beam search instead and prints each prompt's K best sequences
(``--num-return-sequences``) with their scores, plain (``--method none``) or drafting by prompt
lookup (``--method ngram``, where drafting paid in the earlier batches):

    genrec-spec generate --num-beams 4 --num-return-sequences 2 --method ngram --prompt "def f(n):"
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from genrec_spec.cli.args import config_from_args
from genrec_spec.llm import methods


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from genrec_spec.llm.generation import GenerationConfig

    c = GenerationConfig()
    parser.epilog = "methods:\n" + methods.describe()
    parser.add_argument(
        "--model",
        choices=methods.MODELS,
        default=c.model,
        help="target: SmolLM2-135M-Instruct (native) or Gemma-3-270M (transformers; methods "
        f"{', '.join(methods.for_model('gemma3'))})",
    )
    parser.add_argument("--method", choices=tuple(methods.METHODS), default=c.method)
    parser.add_argument(
        "--drafter",
        type=Path,
        default=c.drafter,
        help=f"trained drafter folder for {', '.join(methods.TRAINED)} "
        "(default $GENREC_SPEC_CACHE/drafters/METHOD; eagle2 reads the eagle drafter, distilled "
        "the draft one)",
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", action="append", help="a prompt (repeat for several)")
    source.add_argument(
        "--prompts",
        type=Path,
        help='file with one prompt per line, or .jsonl lines {"prompt": ...}',
    )
    parser.add_argument(
        "--chat",
        action="store_true",
        help="wrap each prompt in the model's chat template as a user turn",
    )
    parser.add_argument("--max-new-tokens", type=int, default=c.max_new_tokens)
    parser.add_argument("--temperature", type=float, default=c.temperature, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=c.top_k, help="0 = off")
    parser.add_argument("--top-p", type=float, default=c.top_p, help="1 = off")
    parser.add_argument("--seed", type=int, default=c.seed)
    parser.add_argument("--batch-size", type=int, default=c.batch_size)
    parser.add_argument(
        "--k",
        type=int,
        default=c.k,
        help=f"draft depth (draft, ngram, trie, distilled, layerskip: default {methods.DEFAULT_K}; "
        "quant: the deepest chain the controller may draft, default 16: proposers.quantized)",
    )
    parser.add_argument(
        "--draft-layers",
        type=int,
        default=c.draft_layers,
        help="layers of the target the draft method keeps",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=c.threads,
        help="torch CPU threads; 0 (the default): the fastest for the model and batch size on "
        "this CPU, timed once (a few seconds) and cached under $GENREC_SPEC_CACHE/threads",
    )
    parser.add_argument(
        "--pass-cost",
        choices=methods.PASS_COSTS,
        default=c.pass_cost,
        help="speculation controller's cost of scoring n tokens: the target's forward timed once "
        "per machine and thread count (cached under $GENREC_SPEC_CACHE/pass_cost), or the "
        "linear default model; none: no controller, every step drafts the full tree (where "
        "verification is nearly free, as on a GPU)",
    )
    add_tree_arguments(parser)
    parser.add_argument(
        "--num-beams",
        type=int,
        default=c.num_beams,
        help="W > 1: beam search (greedy), with --method none or ngram (prompt lookup drafts)",
    )
    parser.add_argument(
        "--num-return-sequences", type=int, default=c.num_return_sequences, help="K <= W"
    )
    parser.add_argument(
        "--length-penalty",
        type=float,
        default=c.length_penalty,
        help="beam search: a finished sequence scores its summed log-probs / length ** this",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def add_tree_arguments(parser: argparse.ArgumentParser) -> None:
    """EAGLE-2's tree options (generate and bench llm)."""
    for_tree = " or ".join(methods.TREE)
    parser.add_argument(
        "--tree-nodes",
        type=int,
        help=f"{for_tree}: draft nodes of EAGLE-2's tree (default 12; the paper's 60)",
    )
    parser.add_argument(
        "--tree-top-k",
        type=int,
        help=f"{for_tree}: children per expanded node (default 4; the paper's 10)",
    )
    parser.add_argument(
        "--tree-depth",
        type=int,
        help=f"{for_tree}: the tree's deepest draft level (default 6)",
    )


def run(args: argparse.Namespace) -> int:
    from genrec_spec.llm.generation import GenerationConfig, generate_texts
    from genrec_spec.llm.prompts import read_prompt_file

    prompts = list(args.prompt) if args.prompt else read_prompt_file(args.prompts)
    config = config_from_args(GenerationConfig, args)
    report = generate_texts(prompts, config)
    if args.json:
        print(json.dumps(report))
        return 0
    for result in report["results"]:
        for beam in result.get("beams", [result]):
            score = f"[score {beam['score']:.3f}] " if "score" in beam else ""
            print(score + result["prompt"] + beam["text"])
        print("-" * 40)
    print(
        " ".join(
            f"{key}={value:.3f}" if isinstance(value, float) else f"{key}={value}"
            for key, value in report["summary"].items()
        )
    )
    return 0

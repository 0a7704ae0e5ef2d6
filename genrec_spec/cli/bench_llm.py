"""`genrec-spec bench llm`: plain decoding vs every speculative method vs Hugging Face and
llama.cpp, same run (``genrec_spec.bench.llm``)."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from genrec_spec.bench.llm_config import (
    ALL_METHODS,
    CPU_ONLY,
    GEMMA3_METHODS,
    BenchLLMConfig,
)
from genrec_spec.cli.args import comma_list
from genrec_spec.cli.generate import add_tree_arguments
from genrec_spec.llm.methods import DEFAULT_K, PASS_COSTS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from genrec_spec.bench import llm

    c = BenchLLMConfig()
    parser.description = llm.__doc__  # the methods, columns and timing
    parser.add_argument(
        "--model",
        choices=("smollm2", "gemma3"),
        default=c.model,
        help="the target: SmolLM2-135M-Instruct, or Gemma-3-270M with cross-tokenizer drafting "
        f"(default methods {','.join(GEMMA3_METHODS)})",
    )
    parser.add_argument(
        "--prompts", default=c.prompts, help="humaneval, fortunes or a prompts file"
    )
    parser.add_argument("--split", default=c.split, choices=["bench", "train", "all"])
    parser.add_argument("--n", type=int, help=f"prompts (default {c.n}; --quick {c.quick_n})")
    parser.add_argument("--max-new-tokens", type=int, help=f"default {c.max_new_tokens}")
    parser.add_argument(
        "--methods",
        type=comma_list(str),
        default=None,
        help=f"of {','.join(ALL_METHODS)} (default {','.join(c.methods)}; --model gemma3: "
        f"{','.join(GEMMA3_METHODS)})",
    )
    parser.add_argument("--batch-sizes", type=comma_list(int), help="e.g. 1,8 (default 1)")
    parser.add_argument("--temperatures", type=comma_list(float), help="e.g. 0,0.8 (default 0)")
    parser.add_argument("--repeats", type=int, default=c.repeats)
    parser.add_argument("--threads", type=int, default=c.threads, help="torch CPU threads")
    parser.add_argument(
        "--device",
        default=c.device,
        help='where the target runs ("cuda" for a GPU; the default methods then leave out '
        f"{','.join(CPU_ONLY)})",
    )
    parser.add_argument("--seed", type=int, default=c.seed)
    parser.add_argument(
        "--k",
        type=int,
        default=c.k,
        help=f"draft depth (draft, ngram, trie, distilled, layerskip: default {DEFAULT_K}; quant: "
        "the deepest chain, default 16)",
    )
    parser.add_argument(
        "--draft-layers",
        type=int,
        default=c.draft_layers,
        help="target layers the draft method keeps and hf-early-exit exits after",
    )
    parser.add_argument(
        "--pass-cost",
        choices=PASS_COSTS,
        default=c.pass_cost,
        help="speculation controller's cost of scoring n tokens: timed once before the run, or "
        "the linear default model; none: no controller, every step drafts the full tree (the "
        "accepted length where verification is nearly free, as on a GPU)",
    )
    add_tree_arguments(parser)
    parser.add_argument("--json", type=Path, help="also write the rows to this JSON file")
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"smoke test: n={c.quick_n}, {c.quick_max_new_tokens} tokens, "
        f"B={c.quick_batch_sizes}, T={c.quick_temperatures} unless given",
    )


def settings_from(args: argparse.Namespace) -> BenchLLMConfig:
    """The run's settings: explicit options, else --quick's, else the defaults; checked."""
    from genrec_spec.bench.llm_config import check_settings

    c = BenchLLMConfig()

    def pick(value, quick, default):
        return value if value is not None else quick if args.quick else default

    methods = args.methods or (GEMMA3_METHODS if args.model == "gemma3" else c.methods)
    if not args.methods and args.device != "cpu":
        methods = tuple(m for m in methods if m not in CPU_ONLY)
    settings = replace(
        c,
        model=args.model,
        prompts=args.prompts,
        split=args.split,
        n=pick(args.n, c.quick_n, c.n),
        max_new_tokens=pick(args.max_new_tokens, c.quick_max_new_tokens, c.max_new_tokens),
        # plain decoding first: it is every speedup's denominator
        methods=("none",) + tuple(dict.fromkeys(m for m in methods if m != "none")),
        batch_sizes=pick(args.batch_sizes, c.quick_batch_sizes, c.batch_sizes),
        temperatures=pick(args.temperatures, c.quick_temperatures, c.temperatures),
        repeats=args.repeats,
        threads=args.threads,
        device=args.device,
        seed=args.seed,
        k=args.k,
        draft_layers=args.draft_layers,
        pass_cost=args.pass_cost,
        tree_nodes=args.tree_nodes,
        tree_top_k=args.tree_top_k,
        tree_depth=args.tree_depth,
    )
    check_settings(settings)
    return settings


def run(args: argparse.Namespace) -> int:
    from genrec_spec.bench.llm import bench_llm, format_table

    report = bench_llm(
        settings_from(args), log=lambda line: print(line, file=sys.stderr, flush=True)
    )
    print(report.header)
    print("\n".join(report.machine))
    print(format_table(report.rows))
    if args.json:
        args.json.write_text(json.dumps(report.as_json(), indent=1))
    return 0

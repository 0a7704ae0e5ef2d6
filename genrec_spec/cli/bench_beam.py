"""`genrec-spec bench beam`: transformers' beam search vs the core's plain and speculative beam
search, catalogue-constrained or not, same run (``genrec_spec.bench.beam``)."""

from __future__ import annotations

import argparse

from genrec_spec.bench import beam
from genrec_spec.bench.beam import METHODS, TASKS, BenchBeamConfig, bench_beam
from genrec_spec.cli.args import comma_list, config_from_args
from genrec_spec.llm.methods import PASS_COSTS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    c = BenchBeamConfig()
    parser.description = beam.__doc__  # the methods, tasks, columns and timing
    parser.add_argument("--task", choices=TASKS, default=c.task)
    parser.add_argument(
        "--methods", type=comma_list(str), default=c.methods, help=f"of {','.join(METHODS)}"
    )
    parser.add_argument(
        "--beam-widths", type=comma_list(int), default=c.beam_widths, help="e.g. 5,10,20"
    )
    parser.add_argument("--k", type=int, default=c.k, help="results per request (at most W)")
    parser.add_argument(
        "--batch-sizes", type=comma_list(int), default=c.batch_sizes, help="e.g. 1,8"
    )
    parser.add_argument("--requests", type=int, default=c.requests, help="users or prompts")
    parser.add_argument("--repeats", type=int, default=c.repeats)
    parser.add_argument("--threads", type=int, default=c.threads, help="torch CPU threads")
    parser.add_argument("--max-new-tokens", type=int, default=c.max_new_tokens, help="code task")
    parser.add_argument("--length-penalty", type=float, default=c.length_penalty)
    parser.add_argument("--early-stopping", choices=("true", "false", "never"), default="false")
    parser.add_argument("--draft-depth", type=int, default=c.draft_depth)
    parser.add_argument("--draft-fanout", type=int, default=c.draft_fanout)
    parser.add_argument("--draft-items", type=int, default=c.draft_items)
    parser.add_argument(
        "--draft-nodes", type=int, default=c.draft_nodes, help="per pass, over all rows"
    )
    parser.add_argument(
        "--lookup-depth", type=int, default=c.lookup_depth, help="code task: drafted a beam"
    )
    parser.add_argument(
        "--pass-cost",
        choices=PASS_COSTS,
        default=c.pass_cost,
        help="spec: how drafted nodes are priced when a search decides from the earlier ones "
        "whether to draft (measured: timed once per machine and cached; none: always drafts)",
    )
    parser.add_argument("--seed", type=int, default=c.seed)
    parser.add_argument("--device", default=c.device, help="cpu, or cuda for a GPU")


def run(args: argparse.Namespace) -> int:
    stopping = {"true": True, "false": False, "never": "never"}[args.early_stopping]
    config = config_from_args(BenchBeamConfig, args, early_stopping=stopping)
    print(bench_beam(config))
    return 0

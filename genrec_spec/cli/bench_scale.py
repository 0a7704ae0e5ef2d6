"""`genrec-spec bench scale`: prepare time and memory, trie, model memory and decoder latency
against synthetic catalogue size (``genrec_spec.bench.scale``), written to --out."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from genrec_spec.bench import scale
from genrec_spec.bench.scale import (
    DECODERS,
    INDEX_KINDS,
    ITEM_TABLES,
    MODELS,
    BenchScaleConfig,
    bench_scale,
)
from genrec_spec.bench.scale_report import format_text, write
from genrec_spec.cli.args import comma_list, config_from_args
from genrec_spec.data_pipelines.atomic import check_writable_folder

# Its catalogues reach 10^7 items in memory: what it frees goes back to the system (cli's rule)
KEEPS_FREED_MEMORY = False


def add_arguments(parser: argparse.ArgumentParser) -> None:
    c = BenchScaleConfig()
    parser.description = scale.__doc__  # what is measured and how
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--sizes", type=comma_list(int), default=c.sizes, help="catalogue sizes")
    parser.add_argument(
        "--data-root",
        default=c.data_root,
        help="folder the catalogues are prepared in and reused from (default: a temp folder)",
    )
    parser.add_argument(
        "--levels", type=int, default=c.levels, help="Semantic-ID levels; 0 = prepare's choice"
    )
    parser.add_argument(
        "--prepare-options",
        type=shlex.split,
        default=c.prepare_options,
        help='other arguments of genrec-spec prepare, e.g. "--codebook-size 64"',
    )
    parser.add_argument(
        "--decoders", type=comma_list(str), default=c.decoders, help=f"of {','.join(DECODERS)}"
    )
    parser.add_argument("--beam-widths", type=comma_list(int), default=c.beam_widths)
    parser.add_argument("--batch-sizes", type=comma_list(int), default=c.batch_sizes)
    parser.add_argument("--k", type=int, default=c.k, help="recommendations per user")
    parser.add_argument("--repeats", type=int, default=c.repeats, help="timed calls per cell")
    parser.add_argument("--recall-users", type=int, default=c.recall_users)
    parser.add_argument("--item-table", choices=ITEM_TABLES, default=c.item_table)
    parser.add_argument(
        "--index-kind",
        choices=INDEX_KINDS,
        default=c.index_kind,
        help="the item index dense-index searches (recsys.item_index)",
    )
    parser.add_argument(
        "--model",
        choices=MODELS,
        default=c.model,
        help="code levels: the default config's (read every item under a prefix) or plain "
        "code heads (trie-bounded)",
    )
    parser.add_argument(
        "--max-gather-gib",
        type=float,
        default=c.max_gather_gib,
        help="skip a cell whose tied levels would gather more (default: 4 on a CPU, a quarter "
        "of a GPU's memory)",
    )
    parser.add_argument("--max-call-s", type=float, default=c.max_call_s)
    parser.add_argument("--threads", type=int, default=c.threads, help="torch and faiss threads")
    parser.add_argument("--seed", type=int, default=c.seed)
    parser.add_argument(
        "--device", default=c.device, help='where the model, trie and histories live ("cuda")'
    )
    parser.add_argument(
        "--out", type=Path, help="write scale.json, scale.md and scale.png to this folder"
    )


def run(args: argparse.Namespace) -> int:
    settings = config_from_args(
        BenchScaleConfig,
        args,
        levels=args.levels or None,
        prepare_options=tuple(args.prepare_options),
    )

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    written = []

    def measured(header: str, reports: list) -> None:  # the report of the sizes so far
        written[:] = write(header, reports, settings, args.out)
        log(f"  report of {len(reports)} size(s) written to {args.out}")

    if args.out:  # checked before the work, whose report it holds
        check_writable_folder(args.out)
    header, reports = bench_scale(settings, log, measured if args.out else lambda *_: None)
    print(format_text(header, reports))
    if args.out:
        if args.out / "scale.png" not in written:
            print("matplotlib is not installed: no plot", file=sys.stderr)
        print("wrote " + ", ".join(str(p) for p in written))
    return 0

"""`genrec-spec bench q4`: the 4-bit CPU matmul against ATen's int4 kernel and fp32
(``genrec_spec.bench.q4``)."""

import argparse

from genrec_spec.bench import q4
from genrec_spec.bench.q4 import Q4BenchConfig, benchmark


def add_arguments(parser: argparse.ArgumentParser) -> None:
    c = Q4BenchConfig()
    parser.description = q4.__doc__  # the methods and columns
    parser.add_argument(
        "--rows",
        default=",".join(map(str, c.rows)),
        help="rows of x (batch sizes), comma-separated",
    )
    parser.add_argument("--layers", type=int, default=c.layers, help="layers in the `layers` case")
    parser.add_argument("--repeats", type=int, default=c.repeats, help="timed calls (>= 1)")
    parser.add_argument("--warmup", type=int, default=c.warmup)
    parser.add_argument("--threads", type=int, default=c.threads, help="torch CPU threads")


def run(args: argparse.Namespace) -> int:
    rows = tuple(int(r) for r in args.rows.split(","))
    benchmark(Q4BenchConfig(rows, args.layers, args.repeats, args.warmup, args.threads))
    return 0

"""`genrec-spec bench kernel`: shared-context tree attention, every implementation side by side
(``genrec_spec.bench.kernel``)."""

import argparse
import sys
from dataclasses import replace

from genrec_spec.bench import kernel
from genrec_spec.bench.kernel import DTYPES, TREES, BenchConfig, KernelBench, benchmark
from genrec_spec.bench.kernel_tune import GRIDS, tune_kernel


def add_arguments(parser: argparse.ArgumentParser) -> None:
    c = BenchConfig()
    parser.description = kernel.__doc__  # the methods and columns
    parser.add_argument("--quick", action="store_true", help=f"only {c.quick_shapes}")
    parser.add_argument("--shapes", nargs="+", help="BxSxN shapes (default: a grid per device)")
    parser.add_argument("--trees", nargs="+", choices=list(TREES), default=list(c.trees))
    parser.add_argument("--heads", help=f"Hq/Hkv (default {c.cpu_heads} CPU, {c.gpu_heads} GPU)")
    parser.add_argument("--head-dim", type=int, default=c.head_dim)
    parser.add_argument("--dtype", choices=list(DTYPES), help="default float32 CPU, bf16 GPU")
    parser.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--repeats", type=int, default=c.repeats, help="timed calls (>= 1)")
    parser.add_argument("--warmup", type=int, default=c.warmup)
    parser.add_argument("--threads", type=int, default=c.threads, help="torch CPU threads")
    parser.add_argument(
        "--tune",
        action="store_true",
        help="CUDA only: sweep the Triton kernel's launch parameters on each shape, timed by "
        f"CUDA-graph replay (default shapes {' '.join(c.tune_shapes)}, medusa tree)",
    )
    parser.add_argument(
        "--peak-gbs", type=float, default=c.peak_gbs, help="--tune: the GPU's memory bandwidth"
    )
    parser.add_argument(
        "--grid", choices=list(GRIDS), default="full", help="--tune: the launches swept"
    )


def run(args: argparse.Namespace) -> int:
    config = replace(
        BenchConfig(),
        trees=tuple(args.trees),
        head_dim=args.head_dim,
        repeats=args.repeats,
        warmup=args.warmup,
        threads=args.threads,
    )
    shapes = tuple(args.shapes) if args.shapes else None
    run = KernelBench(shapes, args.quick, args.heads, args.dtype, args.device)
    if args.tune:
        tune_kernel(run, config, args.peak_gbs, GRIDS[args.grid])
    else:
        benchmark(run, config)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m genrec_spec.cli.bench_kernel``: the command without the `genrec-spec` group."""
    parser = argparse.ArgumentParser(
        prog="python -m genrec_spec.cli.bench_kernel",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

"""`genrec-spec gpu-check`: every GPU check in one command (``genrec_spec.bench.gpu_check``)."""

import argparse
from pathlib import Path

from genrec_spec.bench import gpu_check
from genrec_spec.bench.kernel_tune import GRIDS
from genrec_spec.cli.args import comma_list


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = gpu_check.__doc__
    parser.add_argument("--out", type=Path, required=True, help="folder for the results")
    parser.add_argument(
        "--ckpt", type=Path, help="a recommender checkpoint (`train` output) for bench recsys"
    )
    parser.add_argument("--data", type=Path, help="its prepared data folder (default: its own)")
    parser.add_argument(
        "--tests", type=Path, default=Path("tests"), help="the test folder (run from the repo)"
    )
    parser.add_argument(
        "--catalogues",
        type=Path,
        help="where bench scale prepares its synthetic catalogues and reuses them (default: "
        "OUT/catalogues)",
    )
    parser.add_argument(
        "--tune-grid",
        choices=sorted(GRIDS),
        default=gpu_check.GpuCheckConfig.tune_grid,
        help="the launch grid the tune check sweeps",
    )

    parser.add_argument(
        "--checks",
        type=comma_list(str),
        help="run only these kinds of check, e.g. tests,recsys (of tests, tune, recsys, llm, "
        "beam, scale, kernel; default: all)",
    )


def run(args: argparse.Namespace) -> int:
    config = gpu_check.GpuCheckConfig(tune_grid=args.tune_grid)
    only = None if args.checks is None else set(args.checks)
    outcomes = gpu_check.gpu_check(
        args.out, args.ckpt, args.data, args.tests, args.catalogues, config, only
    )
    return 0 if all(o.status == "ok" for o in outcomes) else 1

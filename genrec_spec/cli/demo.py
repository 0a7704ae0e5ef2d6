"""The main job on the embedded default (MovieLens-100K): ``genrec-spec demo``.

    genrec-spec demo [--out runs/demo] [--k 10] [--config configs/ml-100k-demo.json]

Runs prepare -> train -> batch (spec_beam candidates of every user) -> replay (beam against
spec_beam on the test split, with an HTML report) into --out, printing each step's command and
summary, then one summary: the test metrics, spec_beam's speed against beam's and the exactness
check (spec_beam's lists must equal beam's for every user). See `genrec_spec.jobs.demo`.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from genrec_spec.jobs.demo import CONFIG

    parser.add_argument(
        "--out", type=Path, default=Path("runs/demo"), help="demo output folder (replaced)"
    )
    parser.add_argument("--k", type=int, default=10, help="list length and metric cut-off")
    parser.add_argument(
        "--config", type=Path, default=CONFIG, help="training config (default: the demo's)"
    )


def run(args: argparse.Namespace) -> int:
    from genrec_spec.jobs.demo import run_demo

    run_demo(args.out, args.k, args.config)
    return 0

"""`genrec-spec bench train`: training throughput, sequences (users) per second of optimiser
steps, against variants of the config in the same run (``genrec_spec.bench.train``)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from genrec_spec.bench import train as bench
from genrec_spec.bench.errors import BenchError
from genrec_spec.bench.train import BenchTrainConfig, bench_training, format_report
from genrec_spec.cli.args import config_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    c = BenchTrainConfig()
    parser.description = bench.__doc__  # the timing and the columns
    parser.add_argument("--data", required=True, type=Path, help="folder from genrec-spec prepare")
    parser.add_argument("--config", type=Path, default=None, help="JSON config (configs/*.json)")
    parser.add_argument("--steps", type=int, default=c.steps, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=c.warmup, help="untimed steps first")
    parser.add_argument("--block", type=int, default=c.block, help="steps per turn")
    parser.add_argument("--profile", type=int, default=c.profile, help="profiled steps after")
    parser.add_argument(
        "--against",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="a variant with one config field changed (JSON value), e.g. train.batch_size=32; "
        "repeatable",
    )


def run(args: argparse.Namespace) -> int:
    from genrec_spec.recsys.train_config import load_config

    variants = {"baseline": load_config(args.config, {"train": {"progress": False}})}
    for spec in args.against:
        section, key, value = _setting(spec)
        overrides = {"train": {"progress": False}, "model": {}}
        overrides[section][key] = value
        variants[spec] = load_config(args.config, overrides)
    config = config_from_args(BenchTrainConfig, args)
    result = bench_training(args.data, variants, config)
    if result["rank"] == 0:
        print(format_report(result, args.data, config), flush=True)
    return 0


def _setting(spec: str) -> tuple[str, str, object]:
    """("train" or "model", key, value) of SECTION.KEY=VALUE; the value is JSON where it parses
    (numbers, true, null, objects), else the string."""
    name, sep, text = spec.partition("=")
    section, dot, key = name.partition(".")
    if not sep or not dot or section not in ("train", "model"):
        raise BenchError(
            f"--against {spec!r} is not SECTION.KEY=VALUE with SECTION train or model",
            "write e.g. --against train.batch_size=32",
        )
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = text
    return section, key, value

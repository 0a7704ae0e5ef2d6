"""Batch candidate generation: ``genrec-spec batch``.

    genrec-spec batch --ckpt CKPT --users users.parquet --out DIR --k 50 --decoder beam
    genrec-spec batch --ckpt CKPT --users all --out DIR --decoder spec_beam --option beam_width=64
    genrec-spec batch --ckpt CKPT --users all --out DIR --engine ray --actors 2
    genrec-spec batch --ckpt CKPT --users all --out DIR --engine ray --ray-address HEAD:6379

Writes the top-k items of every user as parquet shards plus ``_manifest.json`` under DIR (read
them with ``pd.read_parquet(DIR)``). Killed at any point, the same command run again finishes
the job: every user ends up in the output exactly once. Once a shard is complete, the same DIR
with other arguments is refused. ``--users all`` means every user of the data's test split; a
user's history is all the data holds for them (test history plus held-out item). See
``genrec_spec.jobs.batch``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from genrec_spec.cli.args import config_from_args
from genrec_spec.cli.evaluate import option_argument as parse_option
from genrec_spec.jobs.batch import ENGINES, BatchConfig, format_summary, run_batch
from genrec_spec.recsys.decoders.registry import decoder_names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    c = BatchConfig()
    parser.add_argument("--ckpt", required=True, type=Path, help="checkpoint folder (train)")
    parser.add_argument("--data", type=Path, help="prepared data (default: the trained-on one)")
    parser.add_argument(
        "--users", required=True, help="parquet file with a user_id column, or `all`"
    )
    parser.add_argument("--out", required=True, type=Path, help="output folder (created)")
    parser.add_argument("--k", type=int, default=c.k, help="items per user")
    parser.add_argument("--decoder", default=c.decoder, help=f"one of {decoder_names()}")
    parser.add_argument(
        "--option",
        type=parse_option,
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="decoder option, e.g. beam_width=20 (repeatable)",
    )
    parser.add_argument("--engine", default=c.engine, choices=ENGINES)
    parser.add_argument("--ray-address", default=c.ray_address, help="Ray cluster HOST:PORT")
    parser.add_argument("--actors", type=int, default=c.actors, help="Ray actors (1 CPU each)")
    parser.add_argument(
        "--ray-cpus", type=int, default=c.ray_cpus, help="CPUs of a Ray started here"
    )
    parser.add_argument("--shards", type=int, default=c.shards, help="output files")
    parser.add_argument("--batch-size", type=int, default=c.batch_size, help="users per call")
    parser.add_argument(
        "--threads",
        type=int,
        default=c.threads,
        help="torch CPU threads (default: every core; one per Ray actor)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    config = config_from_args(BatchConfig, args, progress=not args.no_progress)
    summary = run_batch(
        args.ckpt, args.users, args.out, config, data_dir=args.data, options=dict(args.option)
    )
    print(format_summary(summary))
    return 0

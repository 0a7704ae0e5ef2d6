"""Offline A/B replay of two recommendation arms: ``genrec-spec replay``.

    genrec-spec replay --ckpt CKPT --a "decoder=beam,beam_width=20" --b "decoder=spec_beam" \\
        --split test --out replay_beam_vs_spec
    genrec-spec replay --ckpt CKPT --ckpt-b CKPT2 --a decoder=beam --b decoder=beam \\
        --log events.parquet --out replay_ckpts --users 500 --bootstrap 2000

An arm is ``decoder=NAME[,OPTION=VALUE...]`` (the decoder's options, e.g. beam_width=20); arm B
decodes with --ckpt-b when given, which must be trained on the same prepared data as --ckpt.
Events come from the data's valid or test split (one per user: history -> held-out item) or from
a log file of user_id, timestamp, item_id, where every event is predicted from the user's train
history plus their earlier log events; all in time order (`genrec_spec.jobs.replay_events`).

Both arms decode the same batches; the statistics are paired bootstrap intervals of B - A
that resample users, so a user's several log events count as one correlated unit
(`genrec_spec.jobs.replay`). --out receives, atomically (nothing on failure): report.html
(self-contained, plots embedded), metrics.json and per_user.parquet (one row per event). The
verdict is printed.
"""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

from genrec_spec.cli.args import config_from_args
from genrec_spec.jobs.replay_arms import ReplayConfig, parse_arm
from genrec_spec.jobs.replay_events import SPLITS
from genrec_spec.jobs.replay_report import FILES, replay_to_folder
from genrec_spec.recsys.decoders.registry import decoder_names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    c = ReplayConfig()
    parser.add_argument("--ckpt", required=True, type=Path, help="checkpoint of arm A (and B)")
    parser.add_argument("--ckpt-b", type=Path, help="checkpoint of arm B (same data as --ckpt)")
    parser.add_argument("--data", type=Path, help="prepared data (default: the trained-on one)")
    parser.add_argument(
        "--a",
        required=True,
        help=f'arm A, e.g. "decoder=beam,beam_width=20"; decoders: {decoder_names()}',
    )
    parser.add_argument(
        "--b", required=True, help=f'arm B, e.g. "decoder=spec_beam"; decoders: {decoder_names()}'
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--split", choices=SPLITS, help="replay this split's held-out items")
    source.add_argument(
        "--log", type=Path, help="replay a parquet/csv log: user_id,timestamp,item_id"
    )
    parser.add_argument(
        "--out", required=True, type=Path, help="output folder (written atomically)"
    )
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    parser.add_argument("--k", type=int, default=c.k, help="list length and metric cut-off")
    parser.add_argument("--users", type=int, default=c.users, help="random subset; 0 = all")
    parser.add_argument("--seed", type=int, default=c.seed, help="user subset and bootstrap")
    parser.add_argument("--bootstrap", type=int, default=c.bootstrap, help="resamples")
    parser.add_argument("--batch-size", type=int, default=c.batch_size, help="events per call")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")


def command_line(args: argparse.Namespace) -> str:
    """The command that reproduces this run, for the report."""
    flags = ["ckpt", "ckpt_b", "data", "a", "b", "split", "log", "out", "k", "users", "seed"]
    flags += ["bootstrap", "batch_size", "threads"]
    words = ["genrec-spec", "replay"]
    for flag in flags:
        if getattr(args, flag) is not None:
            words += ["--" + flag.replace("_", "-"), str(getattr(args, flag))]
    return shlex.join(words + (["--overwrite"] if args.overwrite else []))


def run(args: argparse.Namespace) -> int:
    config = config_from_args(ReplayConfig, args)
    result = replay_to_folder(
        parse_arm(args.a, args.ckpt, "--a"),
        parse_arm(args.b, args.ckpt_b or args.ckpt, "--b"),
        config,
        args.out,
        command_line(args),
        overwrite=args.overwrite,
        split=args.split,
        log=args.log,
        data_dir=args.data,
        threads=args.threads,
    )
    print("\n".join(result.summary["verdict"]))
    print(f"wrote {', '.join(FILES)} to {args.out}")
    return 0

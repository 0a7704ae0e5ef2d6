"""Ranking quality of recommendation decoders on a held-out split: ``genrec-spec evaluate``.

    genrec-spec evaluate --ckpt CKPT --split test --decoder beam,heads,rpg,nezha --k 10,50,200

Protocol (time-ordered leave-one-out, ranked against the full catalogue): every user of the
split (or a fixed random subset, ``--users N``) gets a top-max(K) list from the decoder, which
chooses among all catalogue items; the user's held-out next item is looked up in that list and
HR@K, NDCG@K and MRR (over the whole list) are averaged over users (`recsys.metrics`). All
decoders of one run see the same users. The table also gives each decoder's wall time per
user, its sequential backbone passes per batch, and the count of invalid or repeated items in its
lists (always 0 for a correct decoder).

``--exclude-history`` leaves each user's history items out of the ranking: the items the model
reads (its most recent ``max_len``), dropped from a longer list (`recommend.decode_excluding`).
That is the protocol of the HSTU repository (its evaluation filters the ids of the model's input
sequence, `filter_invalid_ids`, by default, "as in SASRec"); a MovieLens user rates a movie
once, so the held-out item is never among them.

Decoder options go through ``--option NAME=VALUE`` (repeatable), given to every listed decoder
that takes an option of that name, e.g. ``--option beam_width=50 --option mode=exact``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from genrec_spec.cli.args import config_from_args
from genrec_spec.recsys.decoders.registry import decoder_names, parse_option
from genrec_spec.recsys.errors import DecodeOptionError, RecommendInputError
from genrec_spec.recsys.evaluate import EvaluateConfig, evaluate_checkpoint, format_table


def option_argument(text: str) -> tuple[str, object]:
    """argparse type of ``--option NAME=VALUE`` (`registry.parse_option`)."""
    try:
        return parse_option(text)
    except DecodeOptionError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def add_checkpoint_arguments(parser: argparse.ArgumentParser, llm: bool = False) -> None:
    """--ckpt and --data, read by every command that loads a trained recommender; with ``llm``,
    --llm NAME instead of --ckpt: an instruct LLM naming items by title (needs --data)."""
    source = parser.add_mutually_exclusive_group(required=True) if llm else parser
    source.add_argument("--ckpt", required=not llm, type=Path, help="checkpoint folder (train)")
    if llm:
        from genrec_spec.llm.title_recommender import TITLE_LLMS

        source.add_argument(
            "--llm",
            choices=TITLE_LLMS,
            help="recommend by title with this LLM, constrained to the catalogue (zero-shot)",
        )
    parser.add_argument("--data", type=Path, help="prepared data (default: the trained-on one)")


def require_data(args: argparse.Namespace) -> None:
    """--llm reads titles and users from a prepared folder: --data is then required."""
    if args.llm and args.data is None:
        raise RecommendInputError(
            "--llm needs the prepared data (its item titles and users)",
            "pass --data DIR, a folder `genrec-spec prepare` wrote",
        )


def refuse_for_llm(given: dict[str, bool]) -> None:
    """Refuse the flags given (flag -> whether it was) that the LLM's title search does not
    read: taken silently, --exclude-seen returned items of the history."""
    named = [flag for flag, present in given.items() if present]
    if named:
        raise RecommendInputError(
            f"{', '.join(named)} do not apply to --llm: the LLM beam-searches K titles of the "
            "catalogue, with no decoder options, exclusion or timestamps",
            "leave them out with --llm",
        )


def check_json_path(path: Path | None) -> None:
    """Refuse a --json file that could not be written, before the evaluation it would hold."""
    if path is not None and (path.is_dir() or not path.absolute().parent.is_dir()):
        raise RecommendInputError(
            f"--json {path}: a folder, or in a folder that does not exist",
            "pass a file path in an existing folder",
        )


def add_option_argument(parser: argparse.ArgumentParser, help_text: str) -> None:
    """--option NAME=VALUE (repeatable): decoder options, parsed as `registry.parse_option`."""
    parser.add_argument(
        "--option",
        type=option_argument,
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help=help_text,
    )


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of integers"
        ) from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give one or more cut-offs >= 1")
    return values


def _name_list(text: str) -> tuple[str, ...]:
    names = tuple(dict.fromkeys(x.strip() for x in text.split(",") if x.strip()))
    if not names:  # (an empty table, exit 0, before)
        raise argparse.ArgumentTypeError(f"{text!r}: give one or more decoder names")
    return names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    c = EvaluateConfig()
    add_checkpoint_arguments(parser, llm=True)
    parser.add_argument("--split", default=c.split, choices=["valid", "test"])
    parser.add_argument(
        "--decoder",
        type=_name_list,
        default=c.decoders,
        help=f"decoder name(s), comma-separated: {decoder_names()}",
    )
    parser.add_argument("--k", type=_int_list, default=c.ks, help="cut-offs, e.g. 10,50,200")
    parser.add_argument("--users", type=int, default=c.users, help="random subset; 0 = all")
    parser.add_argument(
        "--batch-size",
        type=int,
        help=f"users per decoder call (default {c.batch_size}; with --llm 1: a beam search "
        "per user)",
    )
    parser.add_argument("--seed", type=int, default=c.seed, help="draws the --users subset")
    parser.add_argument(
        "--threads", type=int, default=c.threads, help="torch CPU threads (default: every core)"
    )
    add_option_argument(
        parser, "decoder option, given to every listed decoder that takes it (repeatable)"
    )
    parser.add_argument(
        "--exclude-history",
        action="store_true",
        help="leave the history items the model reads out of each list (the HSTU protocol)",
    )
    parser.add_argument("--json", type=Path, help="also write the results to this JSON file")


def run(args: argparse.Namespace) -> int:
    check_json_path(args.json)
    if args.llm:
        return _run_llm(args)
    config = config_from_args(
        EvaluateConfig,
        args,
        decoders=args.decoder,
        ks=args.k,
        batch_size=args.batch_size or EvaluateConfig.batch_size,
    )
    options = dict(args.option)
    header, report = evaluate_checkpoint(
        args.ckpt,
        args.data,
        config,
        options,
        log=lambda line: print(line, file=sys.stderr, flush=True),
    )
    print(header)
    print(format_table(report["results"], args.k))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


def _run_llm(args: argparse.Namespace) -> int:
    from genrec_spec.jobs.title_recommend import evaluate_titles

    require_data(args)
    refuse_for_llm(
        {
            "--decoder": args.decoder != EvaluateConfig.decoders,
            "--option": bool(args.option),
            "--exclude-history": args.exclude_history,
        }
    )
    batch = {} if args.batch_size is None else {"batch_size": args.batch_size}
    metrics = evaluate_titles(
        args.data,
        llm=args.llm,
        split=args.split,
        ks=args.k,
        users=args.users,
        seed=args.seed,
        **batch,
        threads=args.threads,
        log=lambda line: print(line, file=sys.stderr, flush=True),
    )
    print(f"{args.llm} by title (zero-shot, catalogue-constrained beam) on {args.split}:")
    print(format_table({args.llm: metrics}, args.k))
    if args.json:
        args.json.write_text(json.dumps(metrics, indent=1) + "\n")
    return 0

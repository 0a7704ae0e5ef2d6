"""Top-K recommendations for one user: ``genrec-spec recommend``.

    genrec-spec recommend --ckpt CKPT --user 196 --k 10 --decoder beam --json
    genrec-spec recommend --ckpt CKPT --history 242,302,377 --k 10 --decoder heads
    genrec-spec recommend --llm smollm2 --data DIR --user 196 --k 10

``--llm`` has an instruct LLM name the items by title instead of a trained checkpoint: the prompt
lists the user's recent titles and the reply is beam-searched under the catalogue of every title,
so all K results are items (zero-shot; ``genrec_spec.llm.title_recommender``).

Ids are the raw ids of the prepared data (``items.parquet`` item_id, ``user_id`` of the splits),
in and out. ``--user`` reads every interaction of that user the data holds (the test split's
history plus its held-out item), oldest first; ``--history`` takes item ids as given, oldest
first (comma-separated, or a JSON list where ids hold commas, as MovieLens titles do). An
unknown id is an error that names it. An empty history (``--history ""``) is the cold-start
case: the model then recommends from its start-of-history state alone (the same list for every
new user). A history longer than the model's context keeps its most recent items, and the output
says so (``truncated``). ``--exclude-seen`` leaves the history's items out of the list (what
`serve`'s ``exclude_seen`` does). Decoder options go through ``--option NAME=VALUE``.
"""

from __future__ import annotations

import argparse
import json

from genrec_spec.cli.evaluate import (
    add_checkpoint_arguments,
    add_option_argument,
    refuse_for_llm,
    require_data,
)
from genrec_spec.recsys.decoders.registry import decoder_names
from genrec_spec.recsys.errors import RecommendInputError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_checkpoint_arguments(parser, llm=True)
    who = parser.add_mutually_exclusive_group(required=True)
    who.add_argument("--user", help="a user id of the data: recommend from all they did")
    who.add_argument(
        "--history",
        help="item ids, oldest first: comma-separated, or a JSON list where ids hold commas "
        '(MovieLens titles: \'["American President, The (1995)"]\'); "" = none',
    )
    parser.add_argument(
        "--history-times",
        help="timestamps (seconds) of the --history items, comma-separated: what a time-aware "
        "model reads (a --user's come from the data)",
    )
    parser.add_argument(
        "--at",
        type=int,
        help="the time (seconds) to recommend at, for a time-aware model (default: the "
        "history's last timestamp)",
    )
    parser.add_argument("--k", type=int, default=10, help="recommendations")
    parser.add_argument("--decoder", default="beam", help=f"one of {decoder_names()}")
    add_option_argument(parser, "decoder option, e.g. beam_width=50 (repeatable)")
    parser.add_argument(
        "--exclude-seen", action="store_true", help="leave the history's items out of the list"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--json", action="store_true", help="print JSON")


def run(args: argparse.Namespace) -> int:
    from genrec_spec.recsys.recommend_user import recommend_for

    history = None if args.history is None else _history(args.history)
    if args.llm:
        return _run_llm(args, history)
    answer = recommend_for(
        args.ckpt,
        args.data,
        user_id=args.user,
        history_ids=history,
        history_times=_times(args.history_times),
        at=args.at,
        k=args.k,
        decoder=args.decoder,
        options=dict(args.option),
        exclude_seen=args.exclude_seen,
        threads=args.threads,
    )
    if args.json:
        print(json.dumps(answer, indent=1))
        return 0
    note = " (cold start: empty history)" if answer["cold_start"] else ""
    if answer["truncated"]:
        note = f" (the most recent {answer['history_used']} items read)"
    print(
        f"top {len(answer['items'])} by {args.decoder} for a history of "
        f"{answer['history_length']} items{note}:"
    )
    for entry in answer["items"]:
        text = f"  {entry['text']}" if "text" in entry else ""
        print(f"{entry['rank']:>3}  {entry['item_id']:<12} {entry['score']:>9.4f}{text}")
    return 0


def _history(text: str) -> list[str]:
    """--history as item ids: a JSON list (ids with commas, such as titles), or comma-separated."""
    if not text.lstrip().startswith("["):
        return [x.strip() for x in text.split(",") if x.strip()]
    try:
        ids = json.loads(text)
    except json.JSONDecodeError as exc:
        raise RecommendInputError(
            f"--history starts with '[' but is not JSON ({exc})",
            'pass a JSON list of ids, e.g. \'["Toy Story (1995)", "Heat (1995)"]\', or ids '
            "separated by commas",
        ) from None
    if not isinstance(ids, list) or not all(isinstance(i, str | int) for i in ids):
        raise RecommendInputError(
            f"--history {text[:80]!r} is JSON but not a list of item ids",
            "pass a list of strings (or integers), e.g. '[\"Toy Story (1995)\"]'",
        )
    return [str(i) for i in ids]


def _times(text: str | None) -> list[int] | None:
    """--history-times as integers."""
    if text is None:
        return None
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise RecommendInputError(
            f"--history-times {text!r} is not a list of integers",
            "pass Unix seconds separated by commas, e.g. 978300760,978302109",
        ) from None


def _run_llm(args: argparse.Namespace, history: list[str] | None) -> int:
    from genrec_spec.jobs.title_recommend import recommend_titles_for

    require_data(args)
    refuse_for_llm(
        {
            "--decoder": args.decoder != "beam",
            "--option": bool(args.option),
            "--exclude-seen": args.exclude_seen,
            "--history-times": args.history_times is not None,
            "--at": args.at is not None,
        }
    )
    answer = recommend_titles_for(
        args.data,
        llm=args.llm,
        user_id=args.user,
        history_ids=history,
        k=args.k,
        threads=args.threads,
    )
    if args.json:
        print(json.dumps(answer, indent=1))
        return 0
    print(f"top {len(answer['items'])} by {args.llm} for a history of {answer['history_length']}")
    for entry in answer["items"]:
        print(
            f"{entry['rank']:>3}  {entry['item_id']:<12} {entry['score']:>9.4f}  {entry['title']}"
        )
    return 0

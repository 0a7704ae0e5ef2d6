"""Top-K recommendations for one user: ``genrec-spec recommend``.

    genrec-spec recommend --ckpt CKPT --user 196 --k 10 --decoder beam --json
    genrec-spec recommend --ckpt CKPT --history 242,302,377 --k 10 --decoder heads

Ids are the raw ids of the prepared data (``items.parquet`` item_id, ``user_id`` of the splits),
in and out. ``--user`` reads every interaction of that user the data holds (the test split's
history plus its held-out item), oldest first; ``--history`` takes item ids as given, oldest
first. An unknown id is an error that names it. An empty history (``--history ""``) is the
cold-start case: the model then recommends from its start-of-history state alone (the same list
for every new user). A history longer than the model's context keeps its most recent items, and
the output says so (``truncated``). ``--exclude-seen`` leaves the history's items out of the
list (what `serve`'s ``exclude_seen`` does). Decoder options go through ``--option NAME=VALUE``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pandas as pd
import torch

from genrec_spec.recsys.checkpoint import load_model_and_data
from genrec_spec.recsys.decoders.registry import decoder_names, parse_option
from genrec_spec.recsys.recommend import recommend


def user_history(data, user_id: str) -> list[int]:
    """Every known interaction of a user (test history + test target), as item indices."""
    test = data.test
    try:
        row = test.user_ids.index(user_id)
    except ValueError:
        examples = ", ".join(test.user_ids[:5])
        raise ValueError(
            f"unknown user id {user_id!r}: the data has {len(test)} users (e.g. {examples}); "
            "pass --history ID,ID,... for a user it does not know"
        ) from None
    history = test.values[test.offsets[row] : test.offsets[row + 1]].tolist()
    return history + [int(test.targets[row])]


def item_indices(data, item_ids: list[str]) -> list[int]:
    """Raw item ids -> item indices; every unknown id is named in the error."""
    index = {item: i for i, item in enumerate(data.item_ids)}
    unknown = [item for item in item_ids if item not in index]
    if unknown:
        examples = ", ".join(data.item_ids[:5])
        raise ValueError(
            f"{len(unknown)} unknown item id(s) in --history: {', '.join(unknown[:10])}; the "
            f"catalogue has {len(data.item_ids)} items (ids like {examples})"
        )
    return [index[item] for item in item_ids]


def item_texts(data) -> list[str] | None:
    """The items' text (e.g. title and genres) from items.parquet, if it has a text column."""
    items = pd.read_parquet(data.path / "items.parquet")
    if "text" not in items:
        return None
    return items.sort_values("item_index")["text"].astype(str).tolist()


def recommend_one(
    model,
    data,
    history: list[int],
    k: int,
    decoder: str,
    options: dict,
    exclude_seen: bool = False,
) -> dict:
    """The JSON-able answer for one history of item indices."""
    exclude = [history] if exclude_seen else None  # repeats count once (an item mask)
    out = recommend(model, [history], k=k, decoder=decoder, exclude=exclude, **options)
    texts = item_texts(data)
    items = []
    ranked = zip(out.items[0].tolist(), out.scores[0].tolist(), strict=True)
    for rank, (item, score) in enumerate(ranked, 1):
        if item < 0:  # fewer than k items reachable
            continue
        entry = {"rank": rank, "item_id": data.item_ids[item], "score": score}
        if texts is not None:
            entry["text"] = texts[item]
        items.append(entry)
    return {
        "decoder": decoder,
        "k": k,
        "history_length": len(history),
        "history_used": min(len(history), model.config.max_len),
        "truncated": bool(out.stats.get("truncated_histories", 0)),
        "cold_start": not history,
        "exclude_seen": exclude_seen,
        "items": items,
        "stats": out.stats,
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ckpt", required=True, type=Path, help="checkpoint folder (train)")
    parser.add_argument("--data", type=Path, help="prepared data (default: the trained-on one)")
    who = parser.add_mutually_exclusive_group(required=True)
    who.add_argument("--user", help="a user id of the data: recommend from all they did")
    who.add_argument("--history", help='item ids, comma-separated, oldest first ("" = none)')
    parser.add_argument("--k", type=int, default=10, help="recommendations")
    parser.add_argument("--decoder", default="beam", help=f"one of {decoder_names()}")
    parser.add_argument(
        "--option",
        type=parse_option,
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="decoder option, e.g. beam_width=50 (repeatable)",
    )
    parser.add_argument(
        "--exclude-seen", action="store_true", help="leave the history's items out of the list"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--json", action="store_true", help="print JSON")


def run(args: argparse.Namespace) -> int:
    if args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    torch.set_num_threads(args.threads)
    model, data = load_model_and_data(args.ckpt, args.data)
    if args.user is not None:
        history = user_history(data, args.user)
    else:
        history = item_indices(data, [x.strip() for x in args.history.split(",") if x.strip()])
    answer = recommend_one(
        model, data, history, args.k, args.decoder, dict(args.option), args.exclude_seen
    )
    if args.user is not None:
        answer = {"user_id": args.user} | answer
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

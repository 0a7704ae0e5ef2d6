"""One user's recommendations by raw ids, in and out (what ``genrec-spec recommend`` prints).

Ids are the raw ids of the prepared data (``items.parquet`` item_id, ``user_id`` of the splits).
A known user stands for every interaction the data holds of them (the test split's history plus
its held-out item), oldest first; a history is given as item ids, oldest first. An unknown id is
an error that names it. An empty history is the cold-start case (the same list for every new
user); a history longer than the model's context keeps its most recent items, and the answer
says so (``truncated``). ``exclude_seen`` leaves the history's items out of the list. A
time-aware model (`models.recsys.times`) reads a known user's timestamps from the data, a given
history's from ``history_times``, and recommends for the time ``at`` (default: the history's last
timestamp, the moment after its last interaction).
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import torch

from genrec_spec.machine import set_threads
from genrec_spec.models.recsys.times import HistoryTimes
from genrec_spec.recsys.checkpoint import load_model_and_data
from genrec_spec.recsys.data import id_key, item_lookup
from genrec_spec.recsys.errors import RecommendInputError
from genrec_spec.recsys.recommend import recommend


def user_history(data, user_id: str) -> list[int]:
    """Every known interaction of a user (test history + test target), as item indices."""
    test = data.test
    try:
        row = test.user_ids.index(user_id)
    except ValueError:
        examples = ", ".join(test.user_ids[:5])
        raise RecommendInputError(
            f"unknown user id {user_id!r}: the data has {len(test)} users (e.g. {examples})",
            "pass --history ID,ID,... (or a JSON list of ids) for a user it does not know",
        ) from None
    history = test.values[test.offsets[row] : test.offsets[row + 1]].tolist()
    return history + [int(test.targets[row])]


def user_times(data, user_id: str) -> list[int]:
    """The timestamps of `user_history` (data with times: `PreparedData.with_times`)."""
    test = data.test
    row = test.user_ids.index(user_id)
    times = test.times[test.offsets[row] : test.offsets[row + 1]].tolist()
    return times + [int(test.target_times[row])]


def times_for(
    model, history: list[int], history_times: list[int] | None, at: int | None
) -> HistoryTimes | None:
    """The times a time-aware model reads with one history (module docstring); None for other
    models."""
    if not model.uses_times:
        return None
    if history_times is None or len(history_times) != len(history):
        got = "none" if history_times is None else len(history_times)
        raise RecommendInputError(
            f"this model reads the time of every history item (it was trained with "
            f"time_bias): {len(history)} items, {got} timestamps",
            "pass --history-times T,T,... (seconds), one per --history item",
        )
    if at is None and not history_times:
        raise RecommendInputError(
            "an empty history has no last timestamp to recommend at", "pass --at SECONDS"
        )
    at = history_times[-1] if at is None else at
    return HistoryTimes(torch.tensor(history_times), torch.tensor([at]))


def item_indices(data, item_ids: list[str]) -> list[int]:
    """Raw item ids -> item indices; every unknown id is named in the error."""
    index = item_lookup(data.item_ids)
    unknown = [item for item in item_ids if id_key(item) not in index]
    if unknown:
        examples = ", ".join(data.item_ids[:5])
        # (each quoted: a title split at its comma, shown joined, read as the real title)
        raise RecommendInputError(
            f"{len(unknown)} unknown item id(s) in --history: "
            f"{', '.join(repr(item) for item in unknown[:10])}",
            f"use item ids of the catalogue ({len(data.item_ids)} items, ids like {examples}); "
            "ids that hold commas go as a JSON list: --history "
            + """'["American President, The (1995)"]'""",
        )
    return [index[id_key(item)] for item in item_ids]


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
    times: HistoryTimes | None = None,  # a time-aware model's (`times_for`)
) -> dict:
    """The JSON-able answer for one history of item indices."""
    exclude = [history] if exclude_seen else None  # repeats count once (an item mask)
    out = recommend(model, [history], k=k, decoder=decoder, exclude=exclude, times=times, **options)
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
        "truncated": bool(out.stats.truncated_histories),
        "cold_start": not history,
        "exclude_seen": exclude_seen,
        "items": items,
        "stats": out.stats.as_dict(),
    }


def recommend_for(
    ckpt: Path | str,
    data_dir: Path | str | None,
    *,
    user_id: str | None = None,  # a user of the data, or
    history_ids: list[str] | None = None,  # raw item ids, oldest first ([] = a new user)
    history_times: list[int] | None = None,  # their timestamps (a time-aware model's)
    at: int | None = None,  # the time to recommend at (a time-aware model's)
    k: int = 10,
    decoder: str = "beam",
    options: dict | None = None,
    exclude_seen: bool = False,
    threads: int = 1,  # torch CPU threads
) -> dict:
    """The answer (`recommend_one`, with `user_id` first when given) for one user or history of
    a checkpoint."""
    set_threads(threads)
    if (user_id is None) == (history_ids is None):
        raise RecommendInputError(
            "give exactly one of a user id or a history", "pass --user ID or --history IDS"
        )
    model, data = load_model_and_data(ckpt, data_dir)
    if user_id is not None:
        history = user_history(data, user_id)
        if model.uses_times:
            history_times = user_times(data, user_id)
    else:
        history = item_indices(data, history_ids)
    times = times_for(model, history, history_times, at)
    answer = recommend_one(model, data, history, k, decoder, options or {}, exclude_seen, times)
    return answer if user_id is None else {"user_id": user_id} | answer

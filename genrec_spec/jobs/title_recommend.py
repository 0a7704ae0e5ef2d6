"""Catalogue-grounded LLM recommendation over a prepared data folder (``llm.title_recommender``):
what ``genrec-spec recommend --llm`` prints, what ``evaluate --llm`` reports and what the
service's ``llm`` decoder answers.

The items' titles come from the folder's ``items.parquet`` (title and year columns, as
``prepare`` writes them for MovieLens); users and their histories from its splits, as for the
Semantic-ID recommender, so both answer the same users with the same metrics.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch

from genrec_spec.llm.title_recommender import (
    TitleRecommender,
    TitleRecommenderConfig,
    folder_titles,
    load_title_llm,
)
from genrec_spec.machine import set_threads
from genrec_spec.recsys.data import PreparedData, load_prepared, sample_users
from genrec_spec.recsys.errors import RecommendInputError
from genrec_spec.recsys.metrics import ranking_metrics, ranks_from_topk
from genrec_spec.recsys.recommend_user import item_indices, user_history


def load_title_recommender(
    data: PreparedData, llm: str = "smollm2", config: TitleRecommenderConfig | None = None
) -> TitleRecommender:
    """The LLM over the titles of a prepared folder; refuses a folder without titles."""
    titles = folder_titles(data.path)
    if titles is None:
        raise RecommendInputError(
            f"{data.path / 'items.parquet'} has no title column: the LLM names items by title",
            "prepare a dataset with item titles (ml-100k, ml-1m, movielens:PATH, amazon:PATH)",
        )
    model, tokenizer = load_title_llm(llm)
    return TitleRecommender(model, tokenizer, titles, config)


def answer(recommender: TitleRecommender, data: PreparedData, history: list[int], k: int) -> dict:
    """The JSON-able answer for one history of item indices."""
    out = recommender.recommend([history], k=k)
    items = [
        {
            "rank": rank,
            "item_id": data.item_ids[item],
            "title": recommender.titles[item],
            "score": score,
        }
        for rank, (item, score) in enumerate(
            zip(out.items[0].tolist(), out.scores[0].tolist(), strict=True), 1
        )
    ]
    return {
        "llm": True,
        "k": k,
        "history_length": len(history),
        "history_used": min(len(history), recommender.config.history),
        "items": items,
        "stats": out.stats.as_dict(),
    }


def recommend_titles_for(
    data_dir: Path | str,
    *,
    llm: str = "smollm2",
    user_id: str | None = None,
    history_ids: list[str] | None = None,
    k: int = 10,
    config: TitleRecommenderConfig | None = None,
    threads: int = 1,
) -> dict:
    """One user's (or history's) K items named by the LLM (``answer``)."""
    if k < 1:  # (beam search's message named num_beams)
        raise RecommendInputError(f"--k must be >= 1, got {k}", "ask for 1 item or more")
    if (user_id is None) == (history_ids is None):
        raise RecommendInputError(
            "give exactly one of a user id or a history", "pass --user ID or --history IDS"
        )
    set_threads(threads)
    data = load_prepared(data_dir)
    check_k(k, data)
    history = (
        user_history(data, user_id) if user_id is not None else item_indices(data, history_ids)
    )
    if not history:
        raise RecommendInputError(
            "the LLM needs at least one item to recommend from", "pass a non-empty history"
        )
    out = answer(load_title_recommender(data, llm, config), data, history, k)
    return out if user_id is None else {"user_id": user_id} | out


def evaluate_titles(
    data_dir: Path | str,
    *,
    llm: str = "smollm2",
    split: str = "test",
    ks: tuple[int, ...] = (10,),
    users: int = 100,
    seed: int = 0,
    batch_size: int = 1,
    config: TitleRecommenderConfig | None = None,
    threads: int = 1,
    log: Callable[[str], None] = lambda line: None,
) -> dict:
    """HR / NDCG@K and MRR of the LLM's lists (max(ks) long) on a split's users (a seeded
    subset of ``users``; 0 = all), with the time and passes per user."""
    set_threads(threads)
    if batch_size < 1 or not 0 <= seed < 2**63:  # (torch's messages, after the LLM loaded)
        raise RecommendInputError(
            f"--batch-size {batch_size} and --seed {seed}",
            "pass a batch size >= 1 and a seed in 0 .. 2^63 - 1",
        )
    data = load_prepared(data_dir)
    check_k(max(ks), data)
    histories = getattr(data, split)
    rows = sample_users(len(histories), users, seed)  # (refuses a bad count before the LLM)
    recommender = load_title_recommender(data, llm, config)
    ranks, seconds, passes, invalid, count = [], 0.0, 0, 0, 0
    for count, part in enumerate(rows.split(batch_size), 1):
        chosen = histories.select(part)
        lists = [
            chosen.values[chosen.offsets[i] : chosen.offsets[i + 1]].tolist()
            for i in range(len(part))
        ]
        start = time.perf_counter()
        out = recommender.recommend(lists, k=max(ks))
        seconds += time.perf_counter() - start
        passes += out.stats.target_forwards
        invalid += int((out.items < 0).sum())  # a list that left the catalogue (never)
        ranks.append(ranks_from_topk(out.items, chosen.targets))
        done = min(count * batch_size, len(rows))
        log(f"{done}/{len(rows)} users, {seconds / done:.2f} s/user")
    metrics = ranking_metrics(torch.cat(ranks), ks, max_k=max(ks))
    return metrics | {
        "users": len(rows),
        "wall_s_per_user": seconds / len(rows),
        "target_passes_per_batch": passes / count,
        "invalid_items": invalid,
    }


def check_k(k: int, data: PreparedData) -> None:
    """Refuse more items than the catalogue holds before the LLM loads (beam search's own
    message came after it, in its words)."""
    if k > len(data.item_ids):
        raise RecommendInputError(
            f"--k {k} is larger than the catalogue ({len(data.item_ids)} titles)",
            f"ask for at most {len(data.item_ids)} items",
        )

"""The recommender behind /v1/recommend: raw ids in, raw ids out, many requests per decoder call.

`Retriever.prepare` checks one request (user, item ids, k, decoder options) and turns it into a
batch key and a query; `Retriever.run` answers a batch of queries of one key with ONE
`recommend` call. The key holds everything the call must share (decoder, k, fetch size, options),
so each request's answer is the one it would get alone (the same items; scores agree to float
rounding, as batched matrix products sum in another order).

A user id stands for everything the data holds of the user: the test split's history plus its
held-out item, oldest first (as ``genrec-spec recommend --user``). ``exclude_seen`` leaves the
items of that history out of the list (`recsys.recommend`'s `exclude`).

A time-aware model (`models.recsys.times`) reads each history item's timestamp (the data's for a
user id, the request's ``history_times`` otherwise) and the time the list is for (``time``, by
default the request's arrival); it keeps no history cache (its states depend on that time).

With a history cache (`genrec-spec serve --history-cache-mb`, on by default) the encoded
histories stay between requests: a user asking again, or with a few new items at the end of
their history, skips (most of) the history pass (`recsys.history_cache`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from genrec_spec.models.recsys.times import HistoryTimes
from genrec_spec.recsys.checkpoint import load_model_and_data
from genrec_spec.recsys.data import id_key, item_lookup
from genrec_spec.recsys.decoders.registry import (
    DECODERS,
    check_option,
    get_decoder,
    plain_options,
)
from genrec_spec.recsys.history_cache import HistoryCache
from genrec_spec.recsys.item_trie import item_trie
from genrec_spec.recsys.recommend import fetch_size, recommend
from genrec_spec.recsys.recommend_user import user_times
from genrec_spec.serve.errors import ServeInputError
from genrec_spec.serve.schemas import RecommendRequest


@dataclass(frozen=True)
class BatchKey:
    """What the requests of one decoder call share."""

    decoder: str
    k: int
    fetch: int  # items asked of the decoder (k, or more when seen items are dropped)
    options: tuple[tuple[str, object], ...]  # sorted (name, value) pairs


@dataclass(frozen=True)
class Query:
    user_id: str | None
    history: list[int]  # item indices, oldest first
    exclude: list[int]  # item indices to leave out of the list ([] = none)
    times: list[int] | None = None  # the history's timestamps (a time-aware model's)
    time: int | None = None  # the time the list is for (a time-aware model's)


class Retriever:
    """A loaded recommender checkpoint, its data and the lookups requests need."""

    def __init__(self, model, data, max_k: int, history_cache_bytes: int = 0) -> None:
        self.model, self.data = model, data
        # Encoded histories across requests (`recsys.history_cache`); None when 0 bytes, or for
        # a time-aware model, whose states depend on each request's time.
        self.history_cache = None
        if history_cache_bytes and not model.uses_times:
            self.history_cache = HistoryCache(model, max_bytes=history_cache_bytes)
        self.max_k = min(max_k, model.num_items)
        self.trie = item_trie(model)
        self.item_index = item_lookup(data.item_ids)
        self.user_row = {user: row for row, user in enumerate(data.test.user_ids)}
        self.options = {name: plain_options(get_decoder(name)) for name in DECODERS}

    @classmethod
    def load(
        cls, ckpt: Path | str, data_dir: Path | str | None, max_k: int, history_cache_bytes: int = 0
    ) -> Retriever:
        model, data = load_model_and_data(ckpt, data_dir)
        return cls(model, data, max_k, history_cache_bytes)

    @property
    def user_ids(self) -> list[str]:
        return self.data.test.user_ids

    def user_history(self, user_id: str) -> list[int]:
        """Every interaction the data holds of a user (test history + held-out item)."""
        row = self.user_row.get(user_id)
        if row is None:
            examples = ", ".join(self.user_ids[:5])
            raise ServeInputError(
                f"unknown user_id {user_id!r}: the data has {len(self.user_ids)} users (e.g. "
                f"{examples})",
                "send a history of item ids for a user it does not know",
            )
        test = self.data.test
        history = test.values[test.offsets[row] : test.offsets[row + 1]].tolist()
        return history + [int(test.targets[row])]

    def user_times(self, user_id: str) -> list[int]:
        """The timestamps of `user_history` (the data's times: a time-aware model's data)."""
        return user_times(self.data, user_id)

    def item_indices(self, item_ids: Sequence[str | int]) -> list[int]:
        indices = [self.item_index.get(id_key(str(item)), -1) for item in item_ids]
        unknown = [str(item) for item, i in zip(item_ids, indices, strict=True) if i < 0]
        if unknown:
            examples = ", ".join(self.data.item_ids[:5])
            raise ServeInputError(
                f"{len(unknown)} unknown item id(s) in history: {', '.join(unknown[:10])}",
                f"send raw item ids of the catalogue ({len(self.item_index)} items, ids like "
                f"{examples})",
            )
        return indices

    def check_k(self, k: int) -> None:
        if k > self.max_k:
            raise ServeInputError(
                f"k={k} is too large: this service returns at most {self.max_k} items "
                f"(catalogue of {self.model.num_items})",
                "ask for fewer",
            )

    def history_of(self, request: RecommendRequest) -> list[int]:
        """The request's history as item indices: a known user's, or its item ids'."""
        if request.user_id is not None:
            return self.user_history(request.user_id)
        return self.item_indices(request.history)

    def prepare(self, request: RecommendRequest) -> tuple[BatchKey, Query]:
        """Check a request and turn it into (batch key, query); ServeInputError names what is
        wrong."""
        self.check_k(request.k)
        servable = self.options[request.decoder]
        unknown = sorted(set(request.options) - set(servable))
        if unknown:
            raise ServeInputError(
                f"decoder {request.decoder!r} takes no option(s) {unknown}",
                f"use its options: {sorted(servable)}",
            )
        for name, value in request.options.items():
            check_option(request.decoder, name, value, servable[name], self.model.num_items)
        history = self.history_of(request)
        times = self.times_of(request)
        exclude = sorted(set(history)) if request.exclude_seen else []
        key = BatchKey(
            decoder=request.decoder,
            k=request.k,
            fetch=fetch_size(request.k, len(exclude), self.model.num_items),
            options=tuple(sorted(request.options.items())),
        )
        return key, Query(request.user_id, history, exclude, *times)

    def times_of(self, request: RecommendRequest) -> tuple[list[int] | None, int | None]:
        """(the history's timestamps, the time the list is for) that a time-aware model reads;
        (None, None) for other models."""
        if not self.model.uses_times:
            return None, None
        now = request.time if request.time is not None else int(time.time())
        if request.user_id is not None:
            return self.user_times(request.user_id), now
        if request.history_times is None:
            raise ServeInputError(
                "this model reads the time of every history item (it was trained with "
                "time_bias), and the request has no history_times",
                "send history_times: one timestamp (seconds) per history item",
            )
        return list(request.history_times), now

    @torch.inference_mode()
    def run(self, key: BatchKey, queries: Sequence[Query]) -> tuple[list[dict], dict]:
        """Answers (response fields but latency) for a batch of queries of one key, and the
        decoder call's stats (with a history cache: how many of the batch's histories it served
        whole, extended or missed)."""
        cache = self.history_cache
        before = dict(cache.counts) if cache is not None else {}
        times = None
        if self.model.uses_times:
            times = HistoryTimes(
                torch.tensor([t for q in queries for t in q.times], dtype=torch.long),
                torch.tensor([q.time for q in queries], dtype=torch.long),
            )
        out = recommend(
            self.model,
            [q.history for q in queries],
            k=key.k,
            decoder=key.decoder,
            exclude=[q.exclude for q in queries],
            history_cache=cache,
            times=times,
            trie=self.trie,
            **dict(key.options),
        )
        stats = out.stats.as_dict() | {f"history_{n}": cache.counts[n] - before[n] for n in before}
        context = self.model.config.max_len
        answers = []
        for row, query in enumerate(queries):
            real = out.items[row] >= 0  # [K] -1 pads where fewer than k items remain
            answers.append(
                {
                    "user_id": query.user_id,
                    "decoder": key.decoder,
                    "k": key.k,
                    "items": [self.data.item_ids[i] for i in out.items[row][real].tolist()],
                    "scores": out.scores[row][real].tolist(),
                    "history_length": len(query.history),
                    "history_used": min(len(query.history), context),
                    "truncated": len(query.history) > context,
                    "cold_start": not query.history,
                    "excluded": len(query.exclude),
                    "batch_size": len(queries),
                    "stats": stats,
                }
            )
        return answers, stats

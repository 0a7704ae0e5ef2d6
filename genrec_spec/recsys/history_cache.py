"""A cache of encoded user histories across requests, for an online service.

Every decoder starts with the backbone's pass over the user's history (`encode_history`), and at
batch 1 that pass is most of what the one-pass decoders cost. A user's history changes between
two requests by the few items they interacted with since, so the service keeps each history's
per-layer keys and values (`HistoryState`, one row) and on the next request

- answers the same history from the cache (an exact hit: no history pass at all),
- or finds a cached prefix, the history without its last 1..`max_extend` items, and runs only
  the new items (`SemanticIdRecommender.extend_history`, each new token attending over the
  cached keys),
- or encodes the history afresh (a miss),

then stores the new state. Entries are keyed by the history's item indices, not by user id, so
a hit can never hand one user another's history. Positions are absolute, so a history longer
than the model's context (`max_len`) is read as its most recent max_len items, a window that
slides with every new item: such histories only hit exactly. Least-recently used entries are
evicted beyond `max_bytes`.

The result equals `encode_history` of the same histories up to float rounding (attention over
the same keys in other shapes sums in another order), the same tolerance batching already has.
A cache belongs to one model with frozen weights: entries are states of that model, and not to
a time-aware model (`models.recsys.times`), whose states depend on the time of the request.

    cache = HistoryCache(model, max_bytes=256 << 20)
    recommend(model, histories, k=10, decoder="heads", history_cache=cache)

Shape letters: B users, M history items, T history tokens (BOS included), N tree nodes,
H heads, Dh head width.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor

from genrec_spec.data_pipelines.jagged import lengths_to_offsets
from genrec_spec.models.recsys.blocks import HistoryState
from genrec_spec.recsys.errors import RecommendInputError


@dataclass(frozen=True)
class Entry:
    """One encoded history, trimmed to its own tokens."""

    keys: Tensor  # [layers, H, T, Dh]
    values: Tensor  # [layers, H, T, Dh]
    hidden: Tensor  # [D]
    level0_log_probs: Tensor  # [V0]
    truncated: bool

    @property
    def nbytes(self) -> int:
        tensors = (self.keys, self.values, self.hidden, self.level0_log_probs)
        return sum(t.numel() * t.element_size() for t in tensors)


def split_rows(state: HistoryState) -> list[Entry]:
    """A batched state as one entry per row (copies: an entry must not hold the batch alive)."""
    lengths = state.lengths.tolist()
    return [
        Entry(
            keys=state.keys[:, b, :, :tokens].clone(),
            values=state.values[:, b, :, :tokens].clone(),
            hidden=state.hidden[b].clone(),
            level0_log_probs=state.level0_log_probs[b].clone(),
            truncated=bool(state.truncated[b]),
        )
        for b, tokens in enumerate(lengths)
    ]


def stack_rows(entries: list[Entry]) -> HistoryState:
    """Entries as one batched state, right-padded with zeros (finite, as the tree mask needs)."""
    first = entries[0].keys
    tokens = max(e.keys.shape[2] for e in entries)
    shape = (first.shape[0], len(entries), first.shape[1], tokens, first.shape[3])
    keys, values = first.new_zeros(shape), first.new_zeros(shape)
    for b, e in enumerate(entries):
        keys[:, b, :, : e.keys.shape[2]] = e.keys
        values[:, b, :, : e.values.shape[2]] = e.values
    return HistoryState(
        keys=keys,
        values=values,
        lengths=torch.tensor([e.keys.shape[2] for e in entries], device=first.device),
        hidden=torch.stack([e.hidden for e in entries]),
        level0_log_probs=torch.stack([e.level0_log_probs for e in entries]),
        truncated=torch.tensor([e.truncated for e in entries], device=first.device),
    )


def ragged(rows: list[list[int]], device: torch.device) -> tuple[Tensor, Tensor]:
    """Item lists as (values [M], offsets [B+1])."""
    values = torch.tensor([i for row in rows for i in row], dtype=torch.long, device=device)
    lengths = torch.tensor([len(row) for row in rows], dtype=torch.long, device=device)
    return values, lengths_to_offsets(lengths)


def rows_of(values: Tensor, offsets: Tensor) -> list[list[int]]:
    """(values [M], offsets [B+1]) as B item lists (one host copy, not one per row)."""
    flat, bounds = values.tolist(), offsets.tolist()
    return [flat[a:b] for a, b in itertools.pairwise(bounds)]


class HistoryCache:
    """Encoded histories of one model, least recently used evicted beyond `max_bytes`."""

    def __init__(self, model, max_bytes: int = 256 << 20, max_extend: int = 16) -> None:
        if max_bytes < 0 or max_extend < 0:
            raise RecommendInputError(
                f"max_bytes and max_extend must be >= 0, got {max_bytes} and {max_extend}",
                "pass 0 or more bytes and items",
            )
        if model.uses_times:
            raise RecommendInputError(
                "a time-aware model (model.time_bias) cannot reuse encoded histories: its last "
                "history token reads the time of each request",
                "serve it without a history cache (serve --history-cache-mb 0)",
            )
        self.model, self.max_bytes, self.max_extend = model, max_bytes, max_extend
        self.entries: OrderedDict[tuple[int, ...], Entry] = OrderedDict()
        self.bytes = 0
        # Rows answered each way since the cache was made, and new history tokens encoded.
        self.counts = {"exact": 0, "extended": 0, "missed": 0, "tokens_encoded": 0}

    def __len__(self) -> int:
        return len(self.entries)

    @cached_property
    def recommender(self) -> CachedRecommender:
        """The model with its history passes served by this cache, one object per cache (what
        a decoder derives from the model it is given, such as its core target, is made once)."""
        return CachedRecommender(self)

    def encode(self, values: Tensor, offsets: Tensor) -> HistoryState:
        """`model.encode_history(values, offsets)`, served from the cache where it can be
        (module docstring)."""
        return self.encode_rows(rows_of(values, offsets))

    def encode_rows(self, rows: list[list[int]]) -> HistoryState:
        """The same for histories given as item-index lists."""
        out: list[Entry | None] = [None] * len(rows)
        extend: list[tuple[int, Entry, int]] = []  # (row, cached prefix, new items)
        missed: list[int] = []
        for b, row in enumerate(rows):
            key = tuple(row)
            if key in self.entries:
                self.entries.move_to_end(key)
                out[b] = self.entries[key]
                continue
            found = None
            if len(row) <= self.model.config.max_len:  # longer windows slide: no prefix holds
                for new in range(1, min(self.max_extend, len(row)) + 1):
                    found = self.entries.get(key[:-new])
                    if found is not None:
                        extend.append((b, found, new))
                        break
            if found is None:
                missed.append(b)
        device = self.model.item_codes.device
        if missed:
            state = self.model.encode_history(*ragged([rows[b] for b in missed], device))
            self._fill(out, rows, missed, state)
            if len(missed) == len(rows):  # the batch as encoded: no copy of it to restack
                self._count(rows, missed, extend)
                return state
        if extend:
            prefix = stack_rows([entry for _, entry, _ in extend])
            added = ragged([rows[b][-new:] for b, _, new in extend], device)
            state = self.model.extend_history(prefix, *added)
            self._fill(out, rows, [b for b, _, _ in extend], state)
        self._count(rows, missed, extend)
        return stack_rows(out)

    def _count(self, rows: list[list[int]], missed: list[int], extend: list[tuple]) -> None:
        """Add a call's rows to `counts` (history tokens encoded: BOS + the window on a miss)."""
        self.counts["exact"] += len(rows) - len(missed) - len(extend)
        self.counts["extended"] += len(extend)
        self.counts["missed"] += len(missed)
        window = self.model.config.max_len
        self.counts["tokens_encoded"] += sum(min(len(rows[b]), window) + 1 for b in missed)
        self.counts["tokens_encoded"] += sum(new for _, _, new in extend)

    def _fill(
        self, out: list, rows: list[list[int]], which: list[int], state: HistoryState
    ) -> None:
        """Store the rows `which` of the batch from their encoded `state`, and answer them."""
        for b, entry in zip(which, split_rows(state), strict=True):
            out[b] = entry
            self._put(tuple(rows[b]), entry)

    def _put(self, key: tuple[int, ...], entry: Entry) -> None:
        if entry.nbytes > self.max_bytes:
            return
        old = self.entries.pop(key, None)
        if old is not None:
            self.bytes -= old.nbytes
        self.entries[key] = entry
        self.bytes += entry.nbytes
        while self.bytes > self.max_bytes:
            _, evicted = self.entries.popitem(last=False)
            self.bytes -= evicted.nbytes


class CachedRecommender:
    """A recommender whose history passes go through a `HistoryCache`; every other attribute is
    the model's, so the decoders run on it unchanged."""

    def __init__(self, cache: HistoryCache) -> None:
        self.cache = cache

    def __getattr__(self, name: str):
        return getattr(self.cache.model, name)

    def encode_history(self, values: Tensor, offsets: Tensor, times=None) -> HistoryState:
        # The cache's model reads no times (`HistoryCache` refuses one that does)
        return self.cache.encode(values, offsets)

    def encode_history_and_tree(
        self,
        values: Tensor,  # [M]
        offsets: Tensor,  # [B+1]
        codes: Tensor,  # [B, N]
        levels: Tensor,  # [B, N]
        parents: Tensor,  # [B, N]
        times=None,  # read by no model a cache holds
    ) -> tuple[HistoryState, Tensor]:
        """The cached history, then the tree in its own pass (the model fuses the two when it
        has to read the whole history anyway)."""
        state = self.encode_history(values, offsets)
        return state, self.cache.model.score_tree(state, codes, levels, parents)

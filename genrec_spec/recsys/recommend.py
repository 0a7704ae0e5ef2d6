"""Top-K items for user histories with any decoder: the public Python entry point.

    genrec_spec.recommend(model, histories, k=10, decoder="beam", **options) -> Recommendations

`histories` is a list of item-index lists (one per user, oldest first) or a pair
(values [M], offsets [B+1]); `options` go to the decoder (e.g. `beam_width=50`, `draft="none"`,
`trie=` another `PrefixTrie` of the catalogue; by default `item_trie(model)`, built once
per model). Decoders are looked up by name in the registry
(`recsys.decoders.registry.DECODERS`) and imported only when asked for.

Bad input and edge cases:
- an item index outside the catalogue, a non-integer id, malformed offsets: `RecommendInputError`
  naming the offending values and the valid range (map raw ids with items.parquet first);
- an empty history is the cold start: the model reads its BOS token alone, so every decoder
  returns the items it finds most likely for a new user (the same list for all new users);
- a history longer than the model's context (`model.config.max_len`): the most recent items are
  read, and `stats.truncated_histories` counts the rows that were cut;
- k < 1 or k larger than the catalogue: `RecommendInputError` (a list cannot hold more items
  than exist; ask for k <= the catalogue size);
- an unknown decoder or an option the decoder does not take: `RecommendInputError` listing the
  valid names.

Time: a model with a time bias (`models.recsys.times`) reads `times`, a `HistoryTimes` of every
history item's timestamp and each row's time of prediction (the request's); other models ignore
them. Without them, such a model raises `RecommenderInputError`.

Across calls: `history_cache` (a `recsys.history_cache.HistoryCache` of this model) keeps the
encoded histories, so a repeated history skips its history pass and a history that grew by a
few items since its last call encodes only those (what an online service wants; same lists up
to float rounding).

Excluding items (e.g. those a user has already seen): `exclude` holds one item-index list per
user. The decoder is asked for `fetch_size(k, ...)` items, k plus the row's count of distinct
excluded items rounded up to a power of two (capped at the catalogue), the excluded ones are
dropped and the first k that remain are kept (-1 / -inf pads when fewer remain). The rounding
lets rows with similar counts share one decoder call: a call is asked for the largest fetch size
of its rows, so rows of equal fetch size get the same list together as alone (a beam decoder's
list depends on its width, which grows with the fetch size). `stats.fetched` is that size.

Shape letters: B users, M history items, K recommendations.
"""

from __future__ import annotations

import inspect
import numbers
from collections.abc import Sequence
from dataclasses import replace

import torch
from torch import Tensor

from genrec_spec.models.recsys.times import HistoryTimes
from genrec_spec.recsys.decoders.registry import check_option_values, get_decoder
from genrec_spec.recsys.errors import RecommendInputError
from genrec_spec.recsys.history_cache import HistoryCache
from genrec_spec.recsys.inference import inference
from genrec_spec.recsys.item_trie import item_trie
from genrec_spec.recsys.types import Recommendations

MAP_IDS = "map raw ids to item indices (items.parquet item_index) first"


def as_values_offsets(
    histories: Sequence[Sequence[int]] | tuple[Tensor, Tensor],
    num_items: int,
    device: torch.device,
) -> tuple[Tensor, Tensor]:  # values [M] int64, offsets [B+1] int64
    """Histories as ragged values + offsets, checked against the catalogue."""
    if isinstance(histories, tuple) and len(histories) == 2 and isinstance(histories[0], Tensor):
        values, offsets = (t.to(device) for t in histories)
        if values.dtype.is_floating_point or offsets.dtype.is_floating_point:
            raise RecommendInputError(
                f"history values and offsets must be integer tensors, got {values.dtype} and "
                f"{offsets.dtype}",
                "pass int64 tensors of item indices and row offsets",
            )
        values, offsets = values.long(), offsets.long()
    else:
        rows = [list(row) for row in histories]
        if not rows:
            raise RecommendInputError("histories is empty", "pass one item list per user")
        flat = [item for row in rows for item in row]
        bad = [i for i in flat if not isinstance(i, numbers.Integral) or isinstance(i, bool)]
        if bad:
            raise RecommendInputError(
                f"history items must be integer item indices, got {bad[:5]}", MAP_IDS
            )
        values = torch.tensor([int(i) for i in flat], dtype=torch.long, device=device)
        lengths = torch.tensor([len(row) for row in rows], dtype=torch.long, device=device)
        offsets = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
    if offsets.dim() != 1 or offsets.numel() < 2 or int(offsets[0]) != 0:
        raise RecommendInputError(
            f"offsets must be [B+1] starting at 0, got {offsets.tolist()}",
            "pass offsets [0, len(row 0), len(row 0) + len(row 1), ...]",
        )
    if values.numel():
        outside = values[(values < 0) | (values >= num_items)]
        if outside.numel():
            raise RecommendInputError(
                f"unknown item indices {outside[:10].tolist()}: the catalogue holds item "
                f"indices 0..{num_items - 1}",
                MAP_IDS,
            )
    return values, offsets


def fetch_size(k: int, excluded: int, num_items: int) -> int:
    """Items to ask a decoder for so that k remain after dropping `excluded` distinct items:
    k + excluded rounded up to a power of two, capped at the catalogue (module docstring)."""
    if excluded <= 0:
        return k
    return min(num_items, k + (1 << (excluded - 1).bit_length()))


def drop_excluded(
    items: Tensor,  # [B, F] int64 item indices, best first; -1 pads
    scores: Tensor,  # [B, F] float32
    excluded: Tensor,  # [B, I] bool: item i is excluded from row b
    k: int,
) -> tuple[Tensor, Tensor]:  # items [B, K], scores [B, K]; -1 / -inf pads
    """The first k items of each row that are not excluded, in their order."""
    hit = excluded.gather(1, items.clamp(min=0)) | (items < 0)  # [B, F]
    # A stable sort on the hit flag moves the kept items to the front in their order.
    order = torch.sort(hit.to(torch.uint8), dim=1, stable=True).indices[:, :k]  # [B, K]
    dropped = hit.gather(1, order)
    items = torch.where(dropped, -1, items.gather(1, order))
    scores = torch.where(dropped, float("-inf"), scores.gather(1, order))
    return items, scores


@inference
def recommend(
    model,  # SemanticIdRecommender
    histories: Sequence[Sequence[int]] | tuple[Tensor, Tensor],
    k: int = 10,
    decoder: str = "beam",
    exclude: Sequence[Sequence[int]] | None = None,  # [B] item-index lists to leave out
    history_cache: HistoryCache | None = None,  # serves the history passes across calls
    times: HistoryTimes | None = None,  # the histories' timestamps (a time-aware model's)
    **options,
) -> Recommendations:  # items [B, K], scores [B, K], stats
    """The top-k items of every history by the named decoder, without each row's `exclude`
    items when given (module docstring)."""
    decode = get_decoder(decoder)
    if history_cache is not None:
        if history_cache.model is not model:
            raise RecommendInputError(
                "history_cache holds another model's histories", "make one HistoryCache per model"
            )
        model = history_cache.recommender
    if not 1 <= k <= model.num_items:
        raise RecommendInputError(
            f"k must lie in 1..{model.num_items} (the catalogue size), got {k}",
            f"ask for 1 to {model.num_items} items (a list cannot hold more items than exist)",
        )
    accepted = inspect.signature(decode).parameters
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        valid = [n for n, p in accepted.items() if p.kind == p.KEYWORD_ONLY and n != "k"]
        raise RecommendInputError(
            f"decoder {decoder!r} takes no option(s) {unknown}; its options: {valid}",
            "drop the option or correct its name",
        )
    check_option_values(decoder, decode, options)
    device = model.item_codes.device
    values, offsets = as_values_offsets(histories, model.num_items, device)
    if options.get("trie") is None:
        options["trie"] = item_trie(model)
    if times is not None:
        times = HistoryTimes(times.values.to(device), times.query.to(device))
    if exclude is None:
        return decode(model, values, offsets, k=k, times=times, **options)
    drop_values, drop_offsets = as_values_offsets(exclude, model.num_items, device)
    return decode_excluding(
        decode, model, values, offsets, drop_values, drop_offsets, k=k, times=times, **options
    )


def decode_excluding(
    decode,  # a decoder: decode(model, values, offsets, *, k, trie, **options)
    model,
    values: Tensor,  # [M] int64 histories
    offsets: Tensor,  # [B+1] int64
    drop_values: Tensor,  # [X] int64 item indices to leave out, row by row
    drop_offsets: Tensor,  # [B+1] int64
    *,
    k: int,
    **options,
) -> Recommendations:  # items [B, K], scores [B, K], stats with `fetched`
    """`decode`'s top k of every history without its row's excluded items: asks for
    `fetch_size` items and drops the excluded ones (module docstring)."""
    if drop_offsets.numel() != offsets.numel():
        raise RecommendInputError(
            f"exclude holds {drop_offsets.numel() - 1} item lists for {offsets.numel() - 1} "
            "histories",
            "pass one list per history (an empty list excludes nothing)",
        )
    device = values.device
    rows = torch.repeat_interleave(
        torch.arange(drop_offsets.numel() - 1, device=device), drop_offsets.diff()
    )
    excluded = torch.zeros(len(drop_offsets) - 1, model.num_items, dtype=torch.bool, device=device)
    excluded[rows, drop_values] = True  # [B, I]
    most = int(excluded.sum(1).max()) if len(excluded) else 0
    fetch = fetch_size(k, most, model.num_items)
    width = options.get("beam_width")
    if most and width is not None and width < fetch:  # (the decoder's would name k = fetch)
        raise RecommendInputError(
            f"beam_width {width} is below the {fetch} items the decoder must find to keep k = "
            f"{k} after leaving out up to {most} excluded items (exclude_seen leaves out the "
            "history's)",
            f"pass beam_width >= {fetch}, leave it unset, or exclude fewer items",
        )
    out = decode(model, values, offsets, k=fetch, **options)
    items, scores = drop_excluded(out.items, out.scores, excluded, k)
    return Recommendations(items=items, scores=scores, stats=replace(out.stats, fetched=fetch))

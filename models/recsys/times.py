"""Time in the recommender's attention: HSTU's time buckets and the times of history tokens.

HSTU's relative attention bias (Zhai et al., 2024; ``RelativeBucketedTimeAndPositionBasedBias``
in its code) adds to q . k a learned number for the query-key *time gap* beside the one for
their distance (``RecommenderConfig.time_bias``). The gap is the time the query predicts minus
the key's time, in seconds, bucketed on a log scale: floor(ln(max(|gap|, 1)) / 0.301), clamped
to 0..128, as HSTU's code does (0.301 is log10 2: a bucket spans a factor of about 1.35, so
seconds, hours and years all get buckets of their own).

The times of a history x_0..x_{n-1}, read as tokens BOS, x_0, .., x_{n-1} (token t predicts
x_t, the last token the next item):

- as a key, token t holds the time of the item it shows, x_{t-1}'s; BOS holds the first item's
  (the query time when the history is empty);
- as a query, token t asks for the time of the item it predicts: x_t's, and the last token the
  time of the prediction (`HistoryTimes.query`). Scoring a test split, that is the target's time:
  HSTU's protocol writes the target's timestamp after the history, as training does for every
  position. A service passes the time of the request;
- a code token (spelling an item's codes) asks for the time of that item, as its anchor does.

A training window x_0..x_{n-1} is the history x_0..x_{n-2} whose prediction time is x_{n-1}'s, so
training and decoding build the same times (`token_times`).

Shape letters: B rows, M history items, T history tokens (BOS included), Q queries, K keys.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

NUM_TIME_BUCKETS = 128  # HSTU's: buckets 0..128, one learned number each


@dataclass(frozen=True)
class HistoryTimes:
    """The timestamps a time-aware model reads beside B histories of item indices."""

    values: Tensor  # [M] int64 seconds of each history item, parallel to the item values
    query: Tensor  # [B] int64 seconds of each row's prediction (the target's, or the request's)


def time_buckets(gap: Tensor) -> Tensor:  # [...] int64 seconds -> [...] int64 in 0..128
    """HSTU's log-scale bucket of a time gap (module docstring)."""
    scaled = torch.log(gap.abs().clamp(min=1).double()) / 0.301
    return scaled.long().clamp(0, NUM_TIME_BUCKETS)


def time_gaps(query: Tensor, key: Tensor) -> Tensor:  # [B, Q] and [B, K] -> [B, Q, K] int64
    """The time bucket of every (query, key) pair of each row."""
    return time_buckets(query[:, :, None] - key[:, None, :])


def token_times(times: HistoryTimes, offsets: Tensor, tokens: int) -> tuple[Tensor, Tensor]:
    """The (key, query) times ([B, T] int64 each, T = `tokens` >= 1 + the longest row) of the
    history tokens of B rows bounded by `offsets` [B+1] (module docstring); the padding past a
    row's last token holds its query time."""
    lengths = offsets[1:] - offsets[:-1]  # [B]
    # Slot t: x_t's time, the query time from the row's last token on (what token t predicts).
    predicted = times.query[:, None].repeat(1, tokens)  # [B, T]
    real = torch.arange(tokens, device=offsets.device) < lengths[:, None]  # [B, T]
    predicted[real] = times.values  # a row-major mask visits the items in ragged order
    # Token t shows x_{t-1}; BOS the first item (or the query time of an empty history).
    shown = torch.cat([predicted[:, :1], predicted[:, :-1]], dim=1)
    return shown, predicted

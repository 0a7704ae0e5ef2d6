"""The events an A/B replay decodes, in time order: each is a user's history -> the next item.

- **split** (``valid`` / ``test``): one event per user of the prepared data's split: the user's
  history -> the held-out item (time-ordered leave-one-out). Events are ordered by the held-out
  item's timestamp, from data with times (`PreparedData.with_times`, read off the folder's
  ``interactions.parquet``); data without them is replayed in split order and gets no
  timestamps.
- **log**: a parquet or csv file with columns ``user_id, timestamp, item_id`` (raw ids of the
  prepared data; other columns are ignored; timestamps are numbers in seconds, as the data's,
  or dates). Every event is
  predicted from the user's *train* history (the split's ``train`` part, which holds neither the
  valid nor the test item) followed by all of that user's log events that come before it.
  "Before" is the replay order: timestamp ascending, equal timestamps in file order. A log made
  of each user's valid and test items therefore replays the valid split and then the test split
  exactly. Users and items the data does not know are an error (the model has no history or no
  Semantic ID for them). Histories keep the most recent ``keep_last`` items (the models'
  context); decoders would drop older ones anyway.

``users`` draws a fixed random subset of users (all their events), seeded as in
``genrec-spec evaluate``. With data with times, every event's history carries its items'
timestamps and the event's own as the time of the prediction (`Histories.history_times`: what
a time-aware model reads).

Shape letters: E events, M history items.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from torch import Tensor

from genrec_spec.jobs.errors import ReplayInputError
from genrec_spec.recsys.data import Histories, sample_users

LOG_COLUMNS = ("user_id", "timestamp", "item_id")
SPLITS = ("valid", "test")


@dataclass(frozen=True)
class Events:
    """The events to replay, in replay (time) order."""

    histories: Histories  # E events: user_ids, values [M], offsets [E+1], targets [E], times
    timestamps: Tensor | None  # [E] int64 time of each target; None when the data has none
    source: str  # "test split", "valid split" or "log FILE"
    history_lengths: Tensor  # [E] int64 items before each event (histories may keep fewer)

    @property
    def is_split(self) -> bool:
        return self.source.endswith("split")


def split_events(data, split: str, users: int, seed: int) -> Events:
    """One event per user of the valid or test split, ordered by the held-out item's time."""
    if split not in SPLITS:
        raise ReplayInputError(f"unknown split {split!r}", f"use one of {SPLITS}")
    part = getattr(data, split)
    histories = part.select(sample_users(len(part), users, seed))
    times = histories.target_times
    if times is not None:
        histories = histories.select(torch.sort(times, stable=True).indices)  # ties: split order
    return Events(histories, histories.target_times, f"{split} split", histories.lengths)


def read_log(path: Path) -> pd.DataFrame:
    """The log's user_id (str), timestamp (int64) and item_id (str) columns, checked."""
    path = Path(path)
    if not path.is_file():
        raise ReplayInputError(f"log file {path} does not exist", "pass a parquet or csv file")
    if path.suffix in (".parquet", ".pq"):
        frame = pd.read_parquet(path)
    elif path.suffix == ".csv":
        frame = pd.read_csv(path, dtype={"user_id": str, "item_id": str})
    else:
        raise ReplayInputError(
            f"log file {path} is neither .parquet nor .csv", "use a .parquet or .csv file"
        )
    missing = [c for c in LOG_COLUMNS if c not in frame]
    if missing:
        raise ReplayInputError(
            f"log file {path} lacks column(s) {missing}; it has {list(frame.columns)}",
            f"give it the columns {list(LOG_COLUMNS)} (raw ids of the prepared data, one row per "
            "event)",
        )
    frame = frame[list(LOG_COLUMNS)]
    if len(frame) == 0 or frame.isna().any().any():
        raise ReplayInputError(
            f"log file {path} is empty or has missing values",
            "give every event a user_id, timestamp and item_id",
        )
    stamps = frame["timestamp"]
    if not pd.api.types.is_numeric_dtype(stamps):
        try:
            stamps = pd.to_datetime(stamps).astype("int64") // 10**9  # seconds, as the data's
        except (ValueError, TypeError):
            raise ReplayInputError(
                f"log file {path}: timestamps are neither numbers nor dates, e.g. "
                f"{frame['timestamp'].iloc[0]!r}",
                "write timestamp as numbers or dates",
            ) from None
    return pd.DataFrame(
        {
            "user_id": frame["user_id"].astype(str),
            "timestamp": stamps.astype("int64"),
            "item_id": frame["item_id"].astype(str),
        }
    )


def log_events(
    data, log: pd.DataFrame, users: int, seed: int, keep_last: int, source: str = "log"
) -> Events:
    """Every log event: train history + the user's earlier log items -> the event's item."""
    index = {item: i for i, item in enumerate(data.item_ids)}
    rows = {user: i for i, user in enumerate(data.train.user_ids)}
    for column, known, what in (("item_id", index, "items"), ("user_id", rows, "users")):
        unknown = sorted(set(log[column]) - set(known))
        if unknown:
            raise ReplayInputError(
                f"the log names {len(unknown)} {what} the data does not know "
                f"({', '.join(unknown[:10])}); the data ({data.path}) has {len(known)} {what} "
                f"(ids like {', '.join(list(known)[:5])})",
                "replay a log of the same dataset",
            )
    log = log.iloc[np.argsort(log["timestamp"].to_numpy(), kind="stable")]
    chosen = sorted(set(log["user_id"]))
    chosen = {chosen[int(i)] for i in sample_users(len(chosen), users, seed)}
    log = log[log["user_id"].isin(chosen)]
    train, offsets = data.train.values.tolist(), data.train.offsets.tolist()
    # With the data's times, each history carries its items' timestamps: the train items' and
    # the earlier log events'
    timed = data.train.times is not None
    train_times = data.train.times.tolist() if timed else []
    past: dict[str, tuple[list[int], list[int]]] = {}  # user -> (items, their times) so far
    histories, history_times, targets, full_lengths = [], [], [], []
    for user, item, at in zip(log["user_id"], log["item_id"], log["timestamp"], strict=True):
        if user not in past:
            span = slice(offsets[rows[user]], offsets[rows[user] + 1])
            past[user] = (train[span], train_times[span])
        items, times = past[user]
        histories.append(items[-keep_last:])
        history_times.append(times[-keep_last:])
        full_lengths.append(len(items))
        targets.append(index[item])
        items.append(index[item])
        times.append(int(at))
    lengths = torch.tensor([len(h) for h in histories], dtype=torch.long)
    stamps = torch.tensor(log["timestamp"].to_numpy(np.int64))
    return Events(
        Histories(
            user_ids=log["user_id"].tolist(),
            values=torch.tensor([i for h in histories for i in h], dtype=torch.long),
            offsets=torch.cat([lengths.new_zeros(1), lengths.cumsum(0)]),
            targets=torch.tensor(targets, dtype=torch.long),
            times=torch.tensor([t for h in history_times for t in h]) if timed else None,
            target_times=stamps if timed else None,
        ),
        stamps,
        source,
        torch.tensor(full_lengths, dtype=torch.long),
    )

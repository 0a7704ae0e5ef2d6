"""Time-ordered leave-one-out split per user (the TIGER / RecBole protocol), ragged data as
values + offsets.

Conventions:

- Item index: item ids map to 0..I-1 in the order of the items table (`build_item_index`).
- User order: first appearance in the interactions table.
- The stable rule: each user's interactions are sorted by timestamp ascending; equal timestamps
  keep their source-row order.
- Held-out items, as RecBole's leave-one-out (`_split_index_by_leave_one_out`, 2 parts):
  a user with n interactions keeps min(2, n - 1) items out of train, test first.

      n >= 3  train: items[:-2]   valid: items[:-2] -> items[-2]   test: items[:-1] -> items[-1]
      n == 2  train: items[:1]    (no valid)                       test: items[:1]  -> items[1]
      n == 1  train: items        (no valid, no test)

  So every interaction is exactly one train item or one valid / test target, and every user
  keeps at least one train item. A history is always the user's items before the target.
"""

from dataclasses import dataclass

import numpy as np
import pandas as pd

from genrec_spec.data_pipelines.errors import DataError

INTERACTION_COLUMNS = ("user_id", "item_id", "timestamp")


@dataclass(frozen=True)
class UserSequences:
    """Every user's time-ordered interactions (the stable rule), ragged over U users."""

    user_ids: np.ndarray  # [U] str (object array), first-appearance order
    item_values: np.ndarray  # [M] int64 item indices
    time_values: np.ndarray  # [M] int64 timestamps, non-decreasing within a user
    offsets: np.ndarray  # [U+1] int64, offsets[0] == 0, offsets[-1] == M
    num_items: int  # I: size of the item index the values point into

    @property
    def lengths(self) -> np.ndarray:  # [U] int64 interactions per user
        return np.diff(self.offsets)


@dataclass(frozen=True)
class Split:
    """One part of the split for B users: histories as values + offsets, and the targets."""

    user_ids: np.ndarray  # [B] str (object array)
    values: np.ndarray  # [M] int64 item indices of the histories, oldest first
    offsets: np.ndarray  # [B+1] int64, offsets[0] == 0
    targets: np.ndarray | None  # [B] int64 item index after each history; None for train

    def to_frame(self) -> pd.DataFrame:
        """Columns user_id (str), history (list of int64) and, unless train, target (int64):
        ready for `DataFrame.to_parquet`, which keeps the list column."""
        bounds = zip(self.offsets[:-1], self.offsets[1:], strict=True)  # empty when B == 0
        columns = {
            "user_id": pd.Series(self.user_ids, dtype=str),
            "history": [self.values[start:end] for start, end in bounds],
        }
        if self.targets is not None:
            columns["target"] = self.targets
        return pd.DataFrame(columns)

    @classmethod
    def from_frame(cls, frame: pd.DataFrame) -> "Split":
        """Inverse of `to_frame` (e.g. after `pd.read_parquet`)."""
        histories = [np.asarray(history, dtype=np.int64) for history in frame["history"]]
        lengths = np.array([len(history) for history in histories], dtype=np.int64)
        values = np.concatenate(histories) if histories else np.zeros(0, dtype=np.int64)
        targets = frame["target"].to_numpy(dtype=np.int64) if "target" in frame else None
        user_ids = frame["user_id"].to_numpy(dtype=object)
        return cls(user_ids, values, _offsets(lengths), targets)


@dataclass(frozen=True)
class LeaveOneOut:
    """The three parts of the split (module docstring): train has every user (targets None),
    valid the users with >= 3 interactions, test the users with >= 2."""

    train: Split
    valid: Split
    test: Split
    num_items: int

    def to_frames(self) -> dict[str, pd.DataFrame]:
        """{'train' | 'valid' | 'test': Split.to_frame()}."""
        return {name: getattr(self, name).to_frame() for name in ("train", "valid", "test")}

    def summary(self) -> dict[str, int]:
        """Counts for logs and reports."""
        users = len(self.train.user_ids)
        valid, test = len(self.valid.targets), len(self.test.targets)
        return {
            "users": users,
            "items": self.num_items,
            "interactions": len(self.train.values) + valid + test,
            "train_interactions": len(self.train.values),
            "valid_users": valid,
            "test_users": test,
            "users_without_valid": users - valid,
            "users_without_test": users - test,
        }


def build_item_index(items: pd.DataFrame) -> pd.Index:
    """item_id -> position in the items table (the item index 0..I-1); ids must be unique."""
    if "item_id" not in items:
        raise DataError("the items table has no item_id column", "pass RawDataset.items")
    index = pd.Index(items["item_id"], name="item_id")
    if not index.is_unique:
        repeated = index[index.duplicated()][:5].tolist()
        raise DataError(f"item ids repeat in the items table: {repeated}", "keep one row per item")
    return index


def user_sequences(interactions: pd.DataFrame, item_index: pd.Index) -> UserSequences:
    """Group interactions by user (first-appearance order) and order each user's items by the
    stable rule: timestamp ascending, ties in source-row order."""
    missing = [column for column in INTERACTION_COLUMNS if column not in interactions]
    if missing:
        raise DataError(
            f"the interactions table lacks columns {missing}", "pass RawDataset.interactions"
        )
    if len(interactions) == 0:
        raise DataError("the interactions table is empty", "load a dataset with interactions")
    items = item_index.get_indexer(interactions["item_id"])
    if (items < 0).any():
        row = int(np.argmax(items < 0))
        raise DataError(
            f"item {interactions['item_id'].iloc[row]!r} of interaction row {row} is not in the "
            "item index",
            "build the item index from the items table of the same RawDataset",
        )
    users, user_ids = pd.factorize(interactions["user_id"], sort=False)
    times = interactions["timestamp"].to_numpy(dtype=np.int64)
    return ordered_sequences(users, user_ids, items, times, len(item_index))


def ordered_sequences(
    users: np.ndarray,  # [N] int64 each interaction's user, 0..U-1 in first-appearance order
    user_ids: np.ndarray,  # [U] the users' ids
    items: np.ndarray,  # [N] int64 item indices
    times: np.ndarray,  # [N] int64 timestamps
    num_items: int,
) -> UserSequences:
    """Interactions in source order grouped by user, each user's ordered by the stable rule:
    timestamp ascending, ties in source-row order."""
    order = np.lexsort((np.arange(len(users)), times, users))  # by user, time, source row
    return UserSequences(
        user_ids=np.asarray(user_ids, dtype=object),
        item_values=items[order].astype(np.int64),
        time_values=times[order],
        offsets=_offsets(np.bincount(users, minlength=len(user_ids))),
        num_items=num_items,
    )


def leave_one_out(seqs: UserSequences) -> LeaveOneOut:
    """Split every user's sequence as the module docstring says."""
    lengths = seqs.lengths
    held_out = np.clip(lengths - 1, 0, 2)  # RecBole: min(2, n - 1) items leave train
    every = np.ones(len(lengths), dtype=bool)
    return LeaveOneOut(
        train=_part(seqs, every, lengths - held_out, with_targets=False),
        valid=_part(seqs, held_out == 2, lengths - 2, with_targets=True),
        test=_part(seqs, held_out >= 1, lengths - 1, with_targets=True),
        num_items=seqs.num_items,
    )


def _part(seqs: UserSequences, rows: np.ndarray, keep: np.ndarray, with_targets: bool) -> Split:
    """For each selected user: the first `keep` items as history and, if asked, the next item
    as target. rows: [U] bool; keep: [U] int64 history length per user."""
    starts = seqs.offsets[:-1][rows]  # [B]
    keep = keep[rows]  # [B]
    offsets = _offsets(keep)
    # Position of every history item in seqs.item_values: its user's start + rank in history.
    positions = np.repeat(starts - offsets[:-1], keep) + np.arange(offsets[-1])
    targets = seqs.item_values[starts + keep] if with_targets else None
    return Split(seqs.user_ids[rows], seqs.item_values[positions], offsets, targets)


def _offsets(lengths: np.ndarray) -> np.ndarray:  # [B] -> [B+1] int64 starting at 0
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)

"""A prepared data folder (`genrec-spec prepare`) as tensors, and training batches from it.

`load_prepared(dir)` reads the item table (Semantic IDs, long IDs) and the three splits as
ragged values + offsets; `PreparedData.with_times()` adds the timestamp of every history item and
target, re-derived from interactions.parquet (the prepared files stay as they are, so their data
hash and the checkpoints trained on them stay valid). `epoch_batches` cuts one epoch of training
users into batches and `training_windows` cuts each user's train sequence to a window the model
can read; `sample_users` draws the fixed user subsets that evaluation and benchmarks read.

Shape letters: U users of a split, B users of a batch, M history items, I items, L code levels,
Q long-ID digits.
"""

from __future__ import annotations

import json
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch
from torch import Tensor

from genrec_spec.data_pipelines.errors import DataError
from genrec_spec.data_pipelines.split import UserSequences, ordered_sequences
from genrec_spec.models.recsys.times import HistoryTimes

SPLITS = ("train", "valid", "test")
REQUIRED_FILES = ("manifest.json", "items.parquet", *(f"{name}.parquet" for name in SPLITS))
WINDOW_MODES = ("random", "last")


@dataclass(frozen=True)
class Histories:
    """One split: every user's history as values + offsets, and the held-out target; the
    times are None unless added by `PreparedData.with_times`."""

    user_ids: list[str]  # [U]
    values: Tensor  # [M] int64 item indices, oldest first within a user
    offsets: Tensor  # [U+1] int64
    targets: Tensor | None  # [U] int64 item after each history; None for train
    times: Tensor | None = None  # [M] int64 timestamp (seconds) of each history item
    target_times: Tensor | None = None  # [U] int64 timestamp of each target; None for train

    @property
    def lengths(self) -> Tensor:  # [U] int64
        return self.offsets[1:] - self.offsets[:-1]

    def __len__(self) -> int:
        return len(self.user_ids)

    def select(self, users: Tensor) -> Histories:  # users: [B] int64 rows of this split
        """The histories (targets, times) of some users, in the given order."""
        users = users.to(self.offsets.device)
        start, lengths = self.offsets[users], self.lengths[users]  # [B], [B]
        offsets = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
        row = torch.repeat_interleave(torch.arange(len(users), device=users.device), lengths)
        index = start[row] + torch.arange(int(offsets[-1]), device=users.device) - offsets[row]
        return Histories(
            user_ids=[self.user_ids[int(u)] for u in users],
            values=self.values[index],
            offsets=offsets,
            targets=None if self.targets is None else self.targets[users],
            times=None if self.times is None else self.times[index],
            target_times=None if self.target_times is None else self.target_times[users],
        )

    def history_times(self) -> HistoryTimes | None:
        """The times a time-aware model reads with these histories: each item's, and the
        target's as the time of the prediction (HSTU's protocol); None without times."""
        if self.times is None or self.target_times is None:
            return None
        return HistoryTimes(self.times, self.target_times)

    def to(self, device: torch.device | str) -> Histories:
        """The same histories with their tensors on `device`."""

        def move(tensor: Tensor | None) -> Tensor | None:
            return None if tensor is None else tensor.to(device)

        return replace(
            self,
            values=self.values.to(device),
            offsets=self.offsets.to(device),
            targets=move(self.targets),
            times=move(self.times),
            target_times=move(self.target_times),
        )


def id_key(item_id: str) -> str:
    """An item id as lookups compare it: in Unicode NFC, so that a title typed or sent in another
    normal form ("é" as "e" and a combining accent, as some keyboards and macOS file names give
    it) finds its item."""
    return unicodedata.normalize("NFC", item_id)


def item_lookup(item_ids: Sequence[str]) -> dict[str, int]:
    """Raw item id (`id_key`) -> item index."""
    return {id_key(item): i for i, item in enumerate(item_ids)}


@dataclass(frozen=True)
class PreparedData:
    path: Path
    manifest: dict
    item_ids: list[str]  # [I] raw item id of each item index
    item_codes: Tensor  # [I, L] int64 Semantic IDs (collision code last)
    codebook_sizes: list[int]  # [L]
    long_ids: Tensor | None  # [I, Q] int64 long PQ IDs; None when prepared without them
    long_id_sizes: list[int] | None  # [Q]
    train: Histories
    valid: Histories
    test: Histories

    @property
    def data_hash(self) -> str:
        return self.manifest["data_hash"]

    @property
    def num_items(self) -> int:
        return self.item_codes.shape[0]

    def with_times(self) -> PreparedData:
        """This data with `times` on every split and `target_times` on valid and test (unchanged
        if it has them already). The split is a function of interactions.parquet
        (`data_pipelines.split`): each user's interactions in the stable order, every history a
        prefix of them and the target the next one; so the times are read off that order, once
        it is checked to give exactly the stored histories and targets."""
        if self.train.times is not None:
            return self
        file = self.path / "interactions.parquet"
        fix = (
            f"re-create the folder with `genrec-spec prepare --dataset "
            f"{self.manifest.get('dataset', '...')} --out {self.path} --overwrite`"
        )
        sequences = _time_ordered(file, self.num_items, fix)
        return replace(
            self,
            **{
                name: _with_times(getattr(self, name), name, sequences, file, fix)
                for name in SPLITS
            },
        )


def _remake_fix(path: Path) -> str:
    """How to remake a broken data folder (read only when refusing one): with --overwrite only
    where prepare wrote it (its manifest names the Semantic IDs); anything else (a checkpoint,
    a user's own folder) that option would delete."""
    try:
        ours = "semantic_id" in json.loads((path / "manifest.json").read_text())
    except (OSError, ValueError, TypeError):
        ours = False
    if ours:
        return f"re-create it with `genrec-spec prepare --dataset ... --out {path} --overwrite`"
    return "pass the folder `genrec-spec prepare --out` wrote, or prepare one into a new folder"


def load_prepared(path: Path | str) -> PreparedData:
    """Read a folder written by `genrec-spec prepare`; a missing file names the fix."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise DataError(
            f"data path {path} is a file, not a prepared folder",
            "pass the folder `genrec-spec prepare --out` wrote (the one holding manifest.json)",
        )
    if not path.is_dir():
        raise DataError(
            f"data folder {path} does not exist",
            f"make it with `genrec-spec prepare --dataset ml-1m --out {path}`",
        )
    for name in REQUIRED_FILES:
        if not (path / name).is_file():
            raise DataError(
                f"data folder {path} has no {name} (incomplete or not a prepared folder)",
                _remake_fix(path),
            )
    try:
        manifest = json.loads((path / "manifest.json").read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise DataError(f"{path / 'manifest.json'} is not JSON ({exc})", _remake_fix(path)) from exc
    missing = [key for key in ("data_hash", "semantic_id") if key not in manifest]
    if missing:
        raise DataError(
            f"{path / 'manifest.json'} lacks {missing} (written by an older or other tool)",
            f"re-create the folder with `genrec-spec prepare --dataset ... --out {path} "
            "--overwrite`",
        )
    # Read through arrow, not pandas: a list column becomes one flat array, not an object per
    # item (at millions of items, the per-item objects cost most of the load).
    items = _read_table(path / "items.parquet")
    for column in ("item_index", "item_id", "semantic_id"):
        if column not in items.column_names:
            raise DataError(
                f"{path / 'items.parquet'} has no {column} column",
                f"re-create the folder with `genrec-spec prepare --dataset ... --out {path} "
                "--overwrite`",
            )
    order = np.argsort(items["item_index"].to_numpy(), kind="stable")  # [I]
    if not np.array_equal(items["item_index"].to_numpy()[order], np.arange(len(order))):
        raise DataError(
            f"item_index in {path / 'items.parquet'} is not 0..I-1",
            "re-create the folder with `genrec-spec prepare`",
        )
    item_codes = torch.from_numpy(_fixed_width(items, "semantic_id", path)[order])
    long_ids, long_id_sizes = None, None
    if "long_id" in items.column_names and manifest.get("long_id"):
        long_ids = torch.from_numpy(_fixed_width(items, "long_id", path)[order])
        long_id_sizes = [int(v) for v in manifest["long_id"]["codebook_sizes"]]
    splits = {name: _read_split(path / f"{name}.parquet") for name in SPLITS}
    return PreparedData(
        path=path,
        manifest=manifest,
        item_ids=pc.cast(items["item_id"], pa.string())
        .to_numpy(zero_copy_only=False)[order]
        .tolist(),
        item_codes=item_codes,
        codebook_sizes=[int(v) for v in manifest["semantic_id"]["codebook_sizes"]],
        long_ids=long_ids,
        long_id_sizes=long_id_sizes,
        **splits,
    )


def _fixed_width(table: pa.Table, column: str, path: Path) -> np.ndarray:  # [I, width] int64
    """A list column whose lists all have one length, as a matrix."""
    lists = table[column].combine_chunks()
    widths = np.diff(lists.offsets.to_numpy())
    if len(widths) and (widths != widths[0]).any():
        raise DataError(
            f"{column} in {path / 'items.parquet'} has lists of lengths {widths.min()} to "
            f"{widths.max()}; every item needs one of each",
            "re-create the folder with `genrec-spec prepare`",
        )
    flat = lists.flatten().to_numpy().astype(np.int64)
    return flat.reshape(len(widths), -1)


def _read_table(file: Path) -> pa.Table:
    """A parquet table of a prepared folder, or a DataError naming the file and the fix (a
    truncated or foreign file gives arrow's message alone)."""
    try:
        return pq.read_table(file)
    except MemoryError:  # (arrow's too: not the file's fault)
        raise
    except (pa.ArrowException, OSError) as exc:
        raise DataError(
            f"{file} cannot be read as parquet ({exc})", _remake_fix(file.parent)
        ) from exc


def _read_split(file: Path) -> Histories:
    table = _read_table(file)
    histories = table["history"].combine_chunks()
    offsets = histories.offsets.to_numpy().astype(np.int64)  # [U + 1]
    values = histories.flatten().to_numpy().astype(np.int64)  # [M]
    return Histories(
        user_ids=pc.cast(table["user_id"], pa.string()).to_pylist(),
        values=torch.from_numpy(values),
        offsets=torch.from_numpy(offsets - offsets[0]),
        targets=(
            torch.from_numpy(table["target"].to_numpy().astype(np.int64))
            if "target" in table.column_names
            else None
        ),
    )


def _time_ordered(file: Path, num_items: int, fix: str) -> UserSequences:
    """interactions.parquet grouped by user in the split's stable order
    (`data_pipelines.split.ordered_sequences`), read through arrow (the item indices are a
    column: no id lookup)."""
    if not file.is_file():
        raise DataError(f"{file} does not exist (the item timestamps are read from it)", fix)
    columns = ["user_id", "timestamp", "item_index"]
    missing = [column for column in columns if column not in pq.read_schema(file).names]
    if missing:
        raise DataError(f"{file} lacks the columns {missing}", fix)
    table = pq.read_table(file, columns=columns)
    empty = [column for column in columns if table[column].null_count]
    if empty:
        raise DataError(f"{file} has missing values in {empty}", fix)
    users = pc.dictionary_encode(table["user_id"].combine_chunks())  # codes by first appearance
    return ordered_sequences(
        users.indices.to_numpy().astype(np.int64),
        pc.cast(users.dictionary, pa.string()).to_numpy(zero_copy_only=False),
        table["item_index"].to_numpy().astype(np.int64),
        table["timestamp"].to_numpy().astype(np.int64),
        num_items,
    )


def _with_times(
    split: Histories, name: str, seqs: UserSequences, file: Path, fix: str
) -> Histories:
    """`split` with the times of its histories (and targets), each history being the start of
    its user's ordered interactions and the target the next one; refuses any user for whom
    that does not hold."""
    known = pa.array(seqs.user_ids, pa.string())
    rows = pc.index_in(pa.array(split.user_ids, pa.string()), value_set=known)  # [U]
    if rows.null_count:
        absent = split.user_ids[int(np.argmax(rows.is_null().to_numpy(zero_copy_only=False)))]
        raise DataError(f"user {absent!r} of {name}.parquet has no interactions in {file}", fix)
    rows = rows.to_numpy().astype(np.int64)
    start = seqs.offsets[rows]  # [U] where each user's ordered interactions begin in seqs
    lengths = split.lengths.numpy()  # [U]
    needed = lengths + (0 if split.targets is None else 1)  # [U] history + target
    short = needed > seqs.offsets[rows + 1] - start  # [U]
    _refuse_users(
        split, short, f"have more items in {name}.parquet than interactions in {file}", fix
    )
    # Each history item's position in seqs: its user's start + its rank in the history.
    offsets = split.offsets.numpy()  # [U+1]
    positions = np.repeat(start - offsets[:-1], lengths) + np.arange(offsets[-1])  # [M]
    wrong = seqs.item_values[positions] != split.values.numpy()  # [M]
    bad = np.zeros(len(rows), dtype=bool)  # [U]
    bad[np.repeat(np.arange(len(rows)), lengths)[wrong]] = True
    target_times = None
    if split.targets is not None:
        bad |= seqs.item_values[start + lengths] != split.targets.numpy()
        target_times = torch.from_numpy(seqs.time_values[start + lengths])
    what = f"in {name}.parquet do not follow the time order of {file}: made from other data?"
    _refuse_users(split, bad, what, fix)
    times = torch.from_numpy(seqs.time_values[positions])
    return replace(split, times=times, target_times=target_times)


def _refuse_users(split: Histories, wrong: np.ndarray, what: str, fix: str) -> None:
    """DataError naming how many users `what` holds for (wrong: [U] bool) and the first."""
    if wrong.any():
        first = split.user_ids[int(np.argmax(wrong))]
        raise DataError(f"{int(wrong.sum())} users (first {first!r}) {what}", fix)


def sample_users(count: int, users: int, seed: int) -> Tensor:  # [U] int64 rows of a split
    """A fixed random subset of `users` of `count` rows (all rows when users is 0), in order."""
    if users < 0:
        raise DataError(f"--users must be >= 0, got {users}", "pass 0 (every user) or a count")
    if users == 0 or users >= count:
        return torch.arange(count)
    rows = torch.randperm(count, generator=torch.Generator().manual_seed(seed))[:users]
    return rows.sort().values


def epoch_batches(
    lengths: Tensor,  # [U] train items per user; users with none are skipped
    batch_size: int,
    generator: torch.Generator,
    bucket: int = 32,  # batches per length-sorted bucket
) -> list[Tensor]:  # batches of user rows, [B] int64 each (the last one may be smaller)
    """Shuffle the users, sort each run of `bucket` batches by length (rows of one batch then
    need little padding) and shuffle the batch order."""
    users = torch.nonzero(lengths > 0).squeeze(1)
    users = users[torch.randperm(len(users), generator=generator)]
    batches = []
    for run in users.split(batch_size * bucket):
        run = run[torch.sort(lengths[run], stable=True).indices]
        batches.extend(run.split(batch_size))
    order = torch.randperm(len(batches), generator=generator)
    return [batches[int(i)] for i in order]


def training_windows(
    histories: Histories,  # B users' train sequences (each >= 1 item)
    window: int,  # most items per window (the model's max_len + 1: inputs + the last target)
    mode: str,  # "random": a uniformly placed window; "last": the most recent items
    generator: torch.Generator,
) -> tuple[Tensor, Tensor, Tensor | None]:  # (values [M'], offsets [B+1], times [M'] or None)
    """Cut every sequence longer than `window` to `window` consecutive items (and their times,
    when `histories` has them). "random" shows a long user's older items too over the epochs;
    "last" always trains on the most recent."""
    if mode not in WINDOW_MODES:
        raise DataError(f"unknown window mode {mode!r}", f"use one of {WINDOW_MODES}")
    lengths = histories.lengths  # [B]
    slack = (lengths - window).clamp(min=0)  # [B] possible start positions - 1
    if mode == "random":
        start = (torch.rand(len(lengths), generator=generator) * (slack + 1)).long()
    else:
        start = slack
    kept = lengths - slack  # [B]
    offsets = torch.cat([kept.new_zeros(1), kept.cumsum(0)])
    row = torch.repeat_interleave(torch.arange(len(kept)), kept)
    index = histories.offsets[row] + start[row] + torch.arange(int(offsets[-1])) - offsets[row]
    times = None if histories.times is None else histories.times[index]
    return histories.values[index], offsets, times

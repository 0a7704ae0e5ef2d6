"""Item timestamps of a prepared folder (``PreparedData.with_times``): re-derived from
interactions.parquet they match an independent pandas reference, `select`, `to` and
`training_windows` keep them aligned with the items, and a folder whose interactions do not give
its splits is refused with the fix."""

import shutil

import numpy as np
import pandas as pd
import pytest
import torch

from genrec_spec.data_pipelines.errors import DataError
from genrec_spec.recsys.data import Histories, load_prepared, training_windows


@pytest.fixture(scope="module")
def ml100k(ml100k_dir):
    return load_prepared(ml100k_dir).with_times()


def _rows(values: torch.Tensor, offsets: torch.Tensor) -> list[list[int]]:
    return [values[a:b].tolist() for a, b in offsets.unfold(0, 2, 1)]


@pytest.mark.slow
def test_times_match_the_interactions_in_time_order(ml100k, ml100k_dir):
    plain = load_prepared(ml100k_dir)
    assert plain.train.times is None and plain.test.target_times is None
    assert ml100k.with_times() is ml100k
    # Reference: each user's interactions sorted by pandas, timestamp then source row.
    inter = pd.read_parquet(ml100k_dir / "interactions.parquet")
    inter["row"] = np.arange(len(inter))
    ordered = inter.sort_values(["user_id", "timestamp", "row"]).groupby("user_id")
    items = ordered["item_index"].apply(list).to_dict()
    times = ordered["timestamp"].apply(list).to_dict()
    for name in ("train", "valid", "test"):
        split, before = getattr(ml100k, name), getattr(plain, name)
        assert torch.equal(split.values, before.values)  # the items are untouched
        assert split.times.dtype == torch.int64 and split.times.shape == split.values.shape
        history_items = _rows(split.values, split.offsets)
        history_times = _rows(split.times, split.offsets)
        assert all(row == sorted(row) for row in history_times)
        for u, user in enumerate(split.user_ids):
            n = len(history_times[u])
            assert history_times[u] == times[user][:n]
            assert history_items[u] == items[user][:n]
            if split.targets is not None:
                assert int(split.target_times[u]) == times[user][n] >= history_times[u][-1]
    assert ml100k.train.target_times is None
    assert ml100k.valid.target_times.shape == ml100k.valid.targets.shape


@pytest.mark.slow
def test_select_and_to_keep_times_with_their_items(ml100k):
    valid = ml100k.valid
    rows = torch.tensor([5, 0, 17, 5, 900])
    part = valid.select(rows)
    times = _rows(valid.times, valid.offsets)
    assert _rows(part.times, part.offsets) == [times[int(r)] for r in rows]
    assert torch.equal(part.target_times, valid.target_times[rows])
    moved = part.to("meta")
    assert moved.times.device.type == moved.target_times.device.type == "meta"
    assert ml100k.train.select(rows).target_times is None


@pytest.mark.parametrize("mode", ["random", "last"])
def test_windows_cut_times_at_the_positions_of_the_items(mode):
    # Times equal to each item's position: the cut times then say which items were kept.
    lengths = torch.tensor([3, 12, 1, 9, 7])
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    values = torch.randint(0, 50, (int(offsets[-1]),), generator=torch.Generator().manual_seed(0))
    histories = Histories(
        [f"u{i}" for i in range(5)], values, offsets, None, times=torch.arange(len(values))
    )
    window = 5
    g = torch.Generator().manual_seed(1)
    cut_values, cut_offsets, cut_times = training_windows(histories, window, mode, g)
    assert torch.equal(cut_values, values[cut_times])
    assert torch.equal(cut_offsets.diff(), lengths.clamp(max=window))
    for row, times in enumerate(_rows(cut_times, cut_offsets)):
        start, end = int(offsets[row]), int(offsets[row + 1])
        assert times == list(range(times[0], times[0] + len(times)))  # consecutive items
        assert start <= times[0] and times[-1] < end  # of this user
        if mode == "last":
            assert times[-1] == end - 1
    plain = Histories(histories.user_ids, values, offsets, None)
    assert training_windows(plain, window, mode, torch.Generator().manual_seed(1))[2] is None


def _reverse_one_user(inter: pd.DataFrame) -> pd.DataFrame:
    """The first user's interactions in reverse source order (distinct, decreasing times)."""
    mine = inter["user_id"] == inter["user_id"].iloc[0]
    inter.loc[mine, "timestamp"] = -np.arange(int(mine.sum()))
    return inter


def _drop_one_test_target(inter: pd.DataFrame) -> pd.DataFrame:
    """Without the first user's latest interaction (the stable rule's last): test.parquet then
    holds one item more for that user than the interactions do."""
    mine = inter[inter["user_id"] == inter["user_id"].iloc[0]]
    latest = mine.assign(row=np.arange(len(mine))).sort_values(["timestamp", "row"]).index[-1]
    return inter.drop(index=latest)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (None, "does not exist"),
        (lambda inter: inter.drop(columns="timestamp"), "lacks the columns .'timestamp'."),
        (lambda inter: inter[inter["user_id"] != inter["user_id"].iloc[-1]], "no interactions"),
        (_reverse_one_user, "do not follow the time order"),
        (_drop_one_test_target, "more items in test.parquet than interactions"),
    ],
)
def test_interactions_that_do_not_give_the_split_are_refused(ml100k_dir, tmp_path, damage, message):
    folder = tmp_path / "ml-100k"
    shutil.copytree(ml100k_dir, folder)
    file = folder / "interactions.parquet"
    if damage is None:
        file.unlink()
    else:
        damage(pd.read_parquet(file)).to_parquet(file, index=False)
    data = load_prepared(folder)
    with pytest.raises(DataError, match=message) as error:
        data.with_times()
    assert str(file) in error.value.problem
    assert f"genrec-spec prepare --dataset ml-100k --out {folder} --overwrite" in error.value.fix

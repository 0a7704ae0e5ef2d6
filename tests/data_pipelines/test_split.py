"""Leave-one-out split: the stable rule, RecBole's rule for short users, values + offsets,
parquet round-trips, and the real ML-100K split."""

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from genrec_spec.data_pipelines.errors import DataError
from genrec_spec.data_pipelines.loaders import load_dataset
from genrec_spec.data_pipelines.split import (
    Split,
    build_item_index,
    leave_one_out,
    user_sequences,
)


def _table(rows):
    user_ids, item_ids, times = zip(*rows, strict=True)
    return pd.DataFrame({"user_id": user_ids, "item_id": item_ids, "timestamp": times})


# Four users with 4 / 3 / 2 / 1 interactions, interleaved, with timestamp ties.
ROWS = [
    ("u1", "a", 10),
    ("u2", "b", 5),
    ("u1", "b", 30),
    ("u1", "c", 20),
    ("u3", "a", 7),
    ("u1", "d", 20),  # ties with row 3: c stays before d
    ("u2", "c", 5),  # ties with row 1: b stays before c
    ("u4", "d", 1),
    ("u3", "b", 3),  # earlier than row 4: u3 reads b, a
    ("u2", "a", 9),
]
ITEMS = pd.DataFrame({"item_id": ["d", "c", "b", "a"]})  # index order d=0 c=1 b=2 a=3


def _lists(split):
    bounds = zip(split.offsets[:-1], split.offsets[1:], strict=True)
    return [split.values[start:end].tolist() for start, end in bounds]


def test_user_sequences_follow_the_stable_rule():
    index = build_item_index(ITEMS)
    assert index.tolist() == ["d", "c", "b", "a"]
    seqs = user_sequences(_table(ROWS), index)
    assert seqs.user_ids.tolist() == ["u1", "u2", "u3", "u4"]  # first appearance
    assert seqs.offsets.tolist() == [0, 4, 7, 9, 10] and seqs.offsets.dtype == np.int64
    assert seqs.item_values.tolist() == [3, 1, 0, 2, 2, 1, 3, 2, 3, 0]
    assert seqs.time_values.tolist() == [10, 20, 20, 30, 5, 5, 9, 3, 7, 1]
    assert seqs.lengths.tolist() == [4, 3, 2, 1] and seqs.num_items == 4


def test_leave_one_out_by_user_length():
    loo = leave_one_out(user_sequences(_table(ROWS), build_item_index(ITEMS)))
    assert loo.train.user_ids.tolist() == ["u1", "u2", "u3", "u4"] and loo.train.targets is None
    assert _lists(loo.train) == [[3, 1], [2], [2], [0]]
    assert loo.valid.user_ids.tolist() == ["u1", "u2"]  # n >= 3
    assert _lists(loo.valid) == [[3, 1], [2]] and loo.valid.targets.tolist() == [0, 1]
    assert loo.test.user_ids.tolist() == ["u1", "u2", "u3"]  # n >= 2
    assert _lists(loo.test) == [[3, 1, 0], [2, 1], [2]] and loo.test.targets.tolist() == [2, 3, 3]
    for part in (loo.train, loo.valid, loo.test):
        assert part.values.dtype == np.int64 and part.offsets.dtype == np.int64
        assert part.offsets[0] == 0 and len(part.offsets) == len(part.user_ids) + 1
    assert loo.summary() == {
        "users": 4,
        "items": 4,
        "interactions": 10,
        "train_interactions": 5,
        "valid_users": 2,
        "test_users": 3,
        "users_without_valid": 2,
        "users_without_test": 1,
    }


def _recbole_reference(rows, items):
    """Plain-Python oracle: sort each user's rows by (timestamp, row), then RecBole's
    `_split_index_by_leave_one_out(grouped_index, leave_one_num=2)`."""
    index = {item: i for i, item in enumerate(items)}
    users = list(dict.fromkeys(user for user, _, _ in rows))
    train, valid, test = {}, {}, {}
    for user in users:
        mine = sorted((t, r, index[i]) for r, (u, i, t) in enumerate(rows) if u == user)
        seq = [item for _, _, item in mine]
        held = min(2, len(seq) - 1)
        train[user] = seq[: len(seq) - held]
        if held == 2:
            valid[user] = (seq[:-2], seq[-2])
        if held >= 1:
            test[user] = (seq[:-1], seq[-1])
    return train, valid, test


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from("pqrst"), st.sampled_from("ABCDE"), st.integers(0, 3)),
        min_size=1,
        max_size=30,
    )
)
def test_leave_one_out_matches_recbole_reference(rows):
    index = build_item_index(pd.DataFrame({"item_id": list("EDCBA")}))
    loo = leave_one_out(user_sequences(_table(rows), index))
    train, valid, test = _recbole_reference(rows, "EDCBA")
    assert dict(zip(loo.train.user_ids, _lists(loo.train), strict=True)) == train
    got_valid = zip(loo.valid.user_ids, _lists(loo.valid), loo.valid.targets.tolist(), strict=True)
    assert {user: (history, target) for user, history, target in got_valid} == valid
    got_test = zip(loo.test.user_ids, _lists(loo.test), loo.test.targets.tolist(), strict=True)
    assert {user: (history, target) for user, history, target in got_test} == test
    assert loo.summary()["interactions"] == len(rows)


ONE_EACH = [("u1", "a", 3), ("u2", "b", 1), ("u3", "a", 2)]  # no valid or test users at all


@pytest.mark.parametrize("rows", [ROWS, ONE_EACH], ids=["mixed", "one_each"])
def test_frames_round_trip_through_parquet(tmp_path, rows):
    loo = leave_one_out(user_sequences(_table(rows), build_item_index(ITEMS)))
    frames = loo.to_frames()
    assert list(frames["train"].columns) == ["user_id", "history"]
    assert list(frames["test"].columns) == ["user_id", "history", "target"]
    for name, frame in frames.items():
        path = tmp_path / f"{name}.parquet"
        frame.to_parquet(path)
        back = pd.read_parquet(path)
        assert [list(history) for history in back["history"]] == _lists(getattr(loo, name))
        split = Split.from_frame(back)
        original = getattr(loo, name)
        assert split.user_ids.tolist() == original.user_ids.tolist()
        np.testing.assert_array_equal(split.values, original.values)
        np.testing.assert_array_equal(split.offsets, original.offsets)
        if original.targets is None:
            assert split.targets is None
        else:
            np.testing.assert_array_equal(split.targets, original.targets)


def test_bad_input_raises_data_error():
    index = build_item_index(ITEMS)
    with pytest.raises(DataError, match="item 'zz' of interaction row 1 is not in the item index"):
        user_sequences(_table([("u1", "a", 1), ("u1", "zz", 2)]), index)
    with pytest.raises(DataError, match=r"lacks columns \['timestamp'\]"):
        user_sequences(_table(ROWS).drop(columns="timestamp"), index)
    with pytest.raises(DataError, match="is empty"):
        user_sequences(_table(ROWS).iloc[:0], index)
    with pytest.raises(DataError, match=r"item ids repeat in the items table: \['b'\]"):
        build_item_index(pd.DataFrame({"item_id": ["a", "b", "b"]}))
    with pytest.raises(DataError, match="no item_id column"):
        build_item_index(pd.DataFrame({"id": ["a"]}))


@pytest.mark.slow
def test_real_ml100k_split():
    data = load_dataset("ml-100k")
    index = build_item_index(data.items)
    seqs = user_sequences(data.interactions, index)
    loo = leave_one_out(seqs)
    assert loo.summary() == {
        "users": 943,
        "items": 1682,
        "interactions": 100_000,
        "train_interactions": 100_000 - 2 * 943,
        "valid_users": 943,  # every ML-100K user has >= 20 ratings
        "test_users": 943,
        "users_without_valid": 0,
        "users_without_test": 0,
    }
    # Within each user, time never goes backwards (boundaries between users excluded).
    steps = np.diff(seqs.time_values)
    inside = np.ones(len(steps), dtype=bool)
    inside[seqs.offsets[1:-1] - 1] = False
    assert (steps[inside] >= 0).all()
    # test history = valid history + valid target, and the test target is the last item.
    valid, test = _lists(loo.valid), _lists(loo.test)
    for v_hist, v_target, t_hist, t_target, train in zip(
        valid, loo.valid.targets, test, loo.test.targets, _lists(loo.train), strict=True
    ):
        assert t_hist == v_hist + [v_target] and train == v_hist
        # MovieLens has one rating per (user, movie): targets never repeat the history.
        assert t_target not in t_hist and v_target not in v_hist
    assert loo.valid.targets.max() < 1682 and loo.test.targets.min() >= 0

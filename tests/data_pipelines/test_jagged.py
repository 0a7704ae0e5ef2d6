"""Jagged batching: fbgemm and torch paths equal a plain-Python reference; KJTs feed torchrec."""

import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torchrec import EmbeddingCollection, EmbeddingConfig

from genrec_spec.data_pipelines.errors import DataError
from genrec_spec.data_pipelines.jagged import (
    code_key,
    history_kjt,
    jagged_to_padded,
    lengths_to_offsets,
    offsets_to_lengths,
    padded_to_jagged,
    spell_out_ranges,
    truncate_jagged,
)

BACKENDS = ("torch", "fbgemm")
PAD = -7


def random_values(num_values: int, width: int | None, dtype: torch.dtype, seed: int):
    """[M] or [M, E] values; integers in a range where every entry is distinct from PAD."""
    generator = torch.Generator().manual_seed(seed)
    shape = (num_values,) if width is None else (num_values, width)
    if dtype.is_floating_point:
        return torch.rand(shape, generator=generator, dtype=dtype)
    return torch.randint(0, 1000, shape, generator=generator, dtype=dtype)


def reference_padded(values, lengths, max_len):
    """Right-padded [B, T(, E)] built row by row in Python, keeping each row's last T items."""
    rows, start = [], 0
    for length in lengths:
        row = values[start : start + length][max(0, length - max_len) :]
        pad = values.new_full((max_len - row.shape[0], *values.shape[1:]), PAD)
        rows.append(torch.cat([row, pad]))
        start += length
    return torch.stack(rows)


jagged_batches = st.fixed_dictionaries(
    {
        # B = 1 and B > 1; rows may be empty or longer than max_len.
        "lengths": st.lists(st.integers(0, 7), min_size=1, max_size=5),
        "max_len": st.integers(0, 6),
        "width": st.sampled_from([None, 1, 3]),
        "dtype": st.sampled_from([torch.int64, torch.int32, torch.float32]),
        "seed": st.integers(0, 2**16),
    }
)


@settings(max_examples=60, deadline=None)
@given(batch=jagged_batches)
def test_jagged_to_padded_backends_match_reference(batch):
    lengths = torch.tensor(batch["lengths"])  # [B]
    values = random_values(int(lengths.sum()), batch["width"], batch["dtype"], batch["seed"])
    offsets = lengths_to_offsets(lengths)  # [B+1]
    expected = reference_padded(values, batch["lengths"], batch["max_len"])
    for backend in BACKENDS:
        padded = jagged_to_padded(values, offsets, batch["max_len"], PAD, backend=backend)
        assert padded.dtype == values.dtype
        assert torch.equal(padded, expected), backend


@settings(max_examples=60, deadline=None)
@given(batch=jagged_batches)
def test_padded_to_jagged_backends_agree_and_invert_padding(batch):
    lengths = torch.tensor(batch["lengths"])  # [B]
    values = random_values(int(lengths.sum()), batch["width"], batch["dtype"], batch["seed"])
    offsets = lengths_to_offsets(lengths)  # [B+1]
    max_len = batch["max_len"]
    kept_values, kept_offsets = truncate_jagged(values, offsets, max_len)
    padded = jagged_to_padded(values, offsets, max_len, PAD, backend="torch")
    for backend in BACKENDS:
        back_values, back_offsets = padded_to_jagged(
            padded, lengths.clamp(max=max_len), backend=backend
        )
        assert torch.equal(back_offsets, kept_offsets), backend
        assert torch.equal(back_values, kept_values), backend


def test_truncate_keeps_most_recent_items():
    values = torch.tensor([10, 11, 12, 13, 20, 30, 31])  # rows [10..13], [20], [], [30, 31]
    offsets = torch.tensor([0, 4, 5, 5, 7])
    kept, kept_offsets = truncate_jagged(values, offsets, max_len=2)
    assert kept.tolist() == [12, 13, 20, 30, 31]
    assert kept_offsets.tolist() == [0, 2, 3, 3, 5]


@pytest.mark.parametrize("backend", BACKENDS)
def test_lengths_offsets_round_trip(backend):
    lengths = torch.tensor([3, 0, 2, 0, 5])
    offsets = lengths_to_offsets(lengths, backend=backend)
    assert offsets.tolist() == [0, 3, 3, 5, 5, 10]
    assert torch.equal(offsets_to_lengths(offsets), lengths)
    assert lengths_to_offsets(torch.tensor([4]), backend=backend).tolist() == [0, 4]


def test_spell_out_ranges_writes_each_range_in_order():
    owner, values = spell_out_ranges(torch.tensor([7, 2, 0, 5]), torch.tensor([2, 0, 3, 1]))
    assert owner.tolist() == [0, 0, 2, 2, 2, 3]
    assert values.tolist() == [7, 8, 0, 1, 2, 5]
    empty = spell_out_ranges(torch.tensor([4]), torch.tensor([0]))
    assert [t.tolist() for t in empty] == [[], []]


@pytest.mark.parametrize(
    ("offsets", "message"),
    [
        (torch.tensor([1, 3, 5]), "start at 0"),
        (torch.tensor([0, 3, 4]), "end at the number of values"),
        (torch.tensor([0, 4, 3, 5]), "non-decreasing"),
        (torch.tensor([[0, 5]]), "1-D integer"),
        (torch.tensor([0.0, 5.0]), "1-D integer"),
        (torch.tensor([], dtype=torch.long), "1-D integer"),
    ],
)
def test_bad_offsets_raise(offsets, message):
    with pytest.raises(DataError, match=message):
        jagged_to_padded(torch.arange(5), offsets, max_len=4, pad_value=0, backend="torch")


def test_bad_lengths_and_shapes_raise():
    with pytest.raises(DataError, match="non-negative"):
        lengths_to_offsets(torch.tensor([2, -1]))
    with pytest.raises(DataError, match="exceeds the padded width"):
        padded_to_jagged(torch.zeros(2, 3), torch.tensor([1, 4]))
    with pytest.raises(DataError, match="B = len"):
        padded_to_jagged(torch.zeros(2, 3), torch.tensor([1, 1, 1]))
    with pytest.raises(DataError, match="unknown jagged backend"):
        lengths_to_offsets(torch.tensor([1, 2]), backend="triton")


def test_missing_fbgemm_fails_loudly_and_auto_falls_back(monkeypatch):
    monkeypatch.setitem(sys.modules, "fbgemm_gpu", None)  # makes `import fbgemm_gpu` fail
    values, offsets = torch.arange(5), torch.tensor([0, 2, 5])
    with pytest.raises(ModuleNotFoundError, match="fbgemm-gpu-cpu==1.8.0"):
        jagged_to_padded(values, offsets, max_len=3, pad_value=-1, backend="fbgemm")
    padded = jagged_to_padded(values, offsets, max_len=3, pad_value=-1, backend="auto")
    assert padded.tolist() == [[0, 1, -1], [2, 3, 4]]


# Three users, six items with 2-level codes; user 1 has an empty history.
ITEMS = torch.tensor([4, 0, 5, 2, 1, 3])  # [M]
OFFSETS = torch.tensor([0, 2, 2, 6])  # [B+1]
CODES = torch.tensor([[0, 1], [0, 2], [1, 0], [1, 1], [2, 0], [2, 1]])  # [I, L]


def test_history_kjt_keys_lengths_and_values():
    kjt = history_kjt(ITEMS, OFFSETS, CODES)
    assert kjt.keys() == ["item", "code_0", "code_1"]
    per_key = kjt.to_dict()
    for key in kjt.keys():
        assert per_key[key].lengths().tolist() == [2, 0, 4]
    assert per_key["item"].values().tolist() == ITEMS.tolist()
    for level in range(CODES.shape[1]):
        assert per_key[code_key(level)].values().tolist() == CODES[ITEMS, level].tolist()


def test_history_kjt_truncates_to_most_recent():
    kjt = history_kjt(ITEMS, OFFSETS, CODES, max_len=3)
    per_key = kjt.to_dict()
    assert per_key["item"].lengths().tolist() == [2, 0, 3]
    assert per_key["item"].values().tolist() == [4, 0, 2, 1, 3]  # user 2 loses item 5
    assert per_key["code_0"].values().tolist() == [2, 0, 1, 0, 1]


def test_history_kjt_feeds_embedding_collection():
    table_rows = {"item": CODES.shape[0]}
    table_rows |= {code_key(level): int(CODES.max()) + 1 for level in range(CODES.shape[1])}
    tables = [
        EmbeddingConfig(name=f"t_{key}", num_embeddings=rows, embedding_dim=4, feature_names=[key])
        for key, rows in table_rows.items()
    ]
    collection = EmbeddingCollection(tables=tables, device=torch.device("cpu"))
    kjt = history_kjt(ITEMS, OFFSETS, CODES)
    out = collection(kjt)  # {key: JaggedTensor of [M, 4] embeddings}
    weights = collection.state_dict()
    for key in kjt.keys():
        table = weights[f"embeddings.t_{key}.weight"]  # [rows, 4]
        assert out[key].lengths().tolist() == [2, 0, 4]
        assert torch.equal(out[key].values(), table[kjt[key].values()])
    # Gradients flow back into the tables (the model will train them).
    sum(jt.values().sum() for jt in out.values()).backward()


def test_history_kjt_rejects_bad_input():
    with pytest.raises(DataError, match=r"\[0, 6\)"):
        history_kjt(torch.tensor([0, 6]), torch.tensor([0, 1, 2]), CODES)
    with pytest.raises(DataError, match="integer table"):
        history_kjt(ITEMS, OFFSETS, CODES.float())
    with pytest.raises(DataError, match="end at the number of values"):
        history_kjt(ITEMS, torch.tensor([0, 2, 5]), CODES)
